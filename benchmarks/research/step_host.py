"""The host's work a plain step: hf_spin's engine against `generate`'s loop, around a device of fixed step cost.

    python -m benchmarks.research.step_host --step-ms 5 --batch-sizes 1 4 --repeats 9

Where a device's step is short (a GPU's captured 1.5B step: 4-5 ms) the host's work around each forward counts:
an engine that spends 0.5 ms more a step than `generate`'s loop runs 0.91x it while drafting nothing. This paces
a one-layer stand-in's every forward to `--step-ms` of wall time (`benchmarks.injected_costs.pace`: the host's
own work runs as it would beside such a device) and times the gaps between the starts of consecutive decode
forwards, less the pace: for plain `generate`, for hf_spin never drafting (`plain_floor.NeverDraft`, the
planner on, flat injected costs) and for hf_spin with prompt lookup on the same costs (random prompts: it
finds nothing to draft, so its steps are plain ones that also look). Each method `--repeats` calls in turns, the
median of each call's median gap. docs/benchmarks.md lists it; `python -m benchmarks.replay host` measures the
same work on real acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import hf_spin
from benchmarks.common import machine, write_results
from benchmarks.injected_costs import pace, profile_of, table
from benchmarks.replay.costs import STAND_IN
from benchmarks.research.plain_floor import NeverDraft


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=5.0, help="every forward's wall time (a device's step)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens a row")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=9, help="calls of every method, in turns")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


@torch.no_grad()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1583, max_position_embeddings=4096, **STAND_IN)  # a compact trace's vocabulary
    model = Qwen2ForCausalLM(config).eval()
    flat = table(lambda n: args.step_ms * 1e-3)
    pace(model, flat)
    starts: list[float] = []
    model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    pools = {
        "hf_spin, never drafting": hf_spin.AssistantPool(
            ["prompt_lookup"], policy=NeverDraft(), profile=profile_of(flat, [None], ["prompt_lookup"])
        ),
        "hf_spin, prompt lookup": hf_spin.AssistantPool(
            ["prompt_lookup"], profile=profile_of(flat, [None], ["prompt_lookup"])
        ),
    }
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    host = {}  # (method, batch) -> [ms a step, one per call]
    for B in args.batch_sizes:
        ids = torch.randint(3, config.vocab_size, (B, args.prompt))  # [B, P]
        calls = {"generate": lambda ids=ids: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)}
        for name, pool in pools.items():
            calls[name] = lambda ids=ids, pool=pool: model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                custom_generate=hf_spin.generate,
                assistant_pool=pool,
                **gen,
            )
        for call in calls.values():  # warm-up: allocations, the pools' first call
            call()
        for _ in range(args.repeats):
            for name, call in calls.items():
                starts.clear()
                call()
                gaps = [b - a for a, b in zip(starts[1:], starts[2:])]  # decode steps, past the prefill's
                host.setdefault((name, B), []).append(statistics.median(gaps) * 1e3 - args.step_ms)
    methods = ["generate", *pools]
    lines = [
        f"The host's milliseconds a plain step around a forward paced to {args.step_ms:g} ms (a one-layer stand-in, "
        f"{args.prompt}-token prompts, {args.new_tokens} new tokens; the median of {args.repeats} calls' median "
        f"gaps, range in brackets); {machine()['machine']}.",
        "",
        "| batch | " + " | ".join(methods) + " | x generate's step (never drafting) |",
        "|---|" + "---|" * (len(methods) + 1),
    ]
    for B in args.batch_sizes:
        cells = [f"{statistics.median(host[m, B]):.3f} [{min(host[m, B]):.3f}-{max(host[m, B]):.3f}]" for m in methods]
        plain, never = (statistics.median(host[m, B]) + args.step_ms for m in methods[:2])
        lines.append(f"| {B} | " + " | ".join(cells) + f" | {plain / never:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    per_call = {f"{m}, batch {B}": v for (m, B), v in host.items()}
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "host_ms": per_call}
    print(write_results(args.out, "step_host", payload, text))


if __name__ == "__main__":
    main()
