"""Demo: the packaged Qwen2.5-Coder-1.5B target with a pool of heterogeneous drafters.

    python examples/demo.py                 # prompts of its own
    python examples/demo.py --questions ../shared/data/spec_bench/question.jsonl --n 4
    python examples/demo.py --pool qwen-0.5b --dtype float32

The pool: Qwen2.5-Coder-0.5B (same tokenizer), SmolLM2-135M (another tokenizer: token translation)
and prompt lookup, LBSS choosing per request. Prints the machine, the cost profile hf_spin measured
on it and its verdict (speculate, or decode plainly where speculation cannot pay), each answer, then
the speed-up over plain `generate` on the same prompts, whether the outputs were identical, and
what each drafter did. CPU: expect minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_spin
from hf_spin import models
from hf_spin.planning.machine import describe

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences what a hash map is and when to use one.",
    "Refactor this code to use a list comprehension:\n"
    "result = []\nfor x in range(10):\n    if x % 2 == 0:\n        result.append(x * x)",
    "Write a SQL query that returns the five customers with the highest total order value.",
]
DRAFTERS = {"qwen-0.5b": "qwen2.5-coder-0.5b-instruct", "smollm2-135m": "smollm2-135m-instruct", "prompt_lookup": None}
# Within this of 1.0 a speed ratio is timing noise on a shared CPU (runs of the same thing differ by ~5%).
NOISE = 0.05


def main() -> None:
    ap = argparse.ArgumentParser(description="hf_spin demo on the packaged real models")
    ap.add_argument("--questions", type=Path, help="a Spec-Bench question.jsonl to take prompts from instead")
    ap.add_argument("--n", type=int, default=4, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--pool",
        nargs="+",
        default=list(DRAFTERS),
        choices=list(DRAFTERS),
        help="the drafters (one: policy 'fixed'; several: 'lbss')",
    )
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="bfloat16: the packaged weights' own dtype"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # explicit: an oversubscribed CPU collapses ~10x

    prompts = PROMPTS
    if args.questions:
        prompts = [json.loads(line)["turns"][0] for line in args.questions.read_text().splitlines()]
    prompts = prompts[: args.n]

    dtype = getattr(torch, args.dtype)
    target, tok = models.load("qwen2.5-coder-1.5b-instruct", dtype=dtype)
    entries = []
    for label in args.pool:
        if DRAFTERS[label] is None:
            entries.append("prompt_lookup")
            continue
        model, draft_tok = models.load(DRAFTERS[label], dtype=dtype)
        entries.append(
            hf_spin.ModelDrafter(model, name=label)
            if draft_tok.get_vocab() == tok.get_vocab()
            else hf_spin.TranslatingDrafter(model, draft_tok, tok, name=label)
        )
    pool = hf_spin.AssistantPool(entries, policy="lbss" if len(entries) > 1 else "fixed", tokenizer=tok)
    hf_spin.enable()
    why = "the packaged weights' own dtype" if args.dtype == "bfloat16" else "chosen with --dtype"
    print(
        f"machine: {describe(target.device)}; dtype {args.dtype} "
        f"({why}; the profile below says whether speculation pays in it)"
    )

    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    start = time.perf_counter()
    pool.bind(target, tok)  # measures the cost profile (once per machine, dtype and thread count; then read from disk)
    print(f"cost profile ({time.perf_counter() - start:.1f} s):\n{pool.cost_profile}\n")
    warm = tok("Hello", return_tensors="pt")
    target.generate(**warm, **{**gen, "max_new_tokens": 4})  # one-off allocations, outside the timings
    target.generate(**warm, assistant_pool=pool, **{**gen, "max_new_tokens": 4})
    hf_spin.freeze_gc()  # the loaded models out of the garbage collector's full scans (a pause of ~0.2 s each)

    plain_s = spin_s = 0.0
    identical = 0
    for prompt in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        batch = tok(text, return_tensors="pt")
        t = time.perf_counter()
        plain = target.generate(**batch, **gen)
        plain_s += time.perf_counter() - t
        t = time.perf_counter()
        spin = target.generate(**batch, assistant_pool=pool, **gen)
        spin_s += time.perf_counter() - t
        identical += torch.equal(plain, spin)
        answer = tok.decode(spin[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"\n### {prompt}\n{answer}\n--- {pool.last_stats}")

    ratio = plain_s / spin_s
    verdict = (
        "within timing noise of plain decoding" if abs(ratio - 1) <= NOISE else ("faster" if ratio > 1 else "slower")
    )
    drafted = {
        name: f"{d.drafted} drafted, {d.acceptance_rate:.0%} accepted, {d.steps} steps"
        for name, d in pool.totals.items()
        if d.steps
    }
    print(
        f"\n{len(prompts)} prompts on {describe(target.device)}, {args.dtype}: "
        f"hf_spin {plain_s / spin_s:.2f}x plain generate ({plain_s:.1f}s -> {spin_s:.1f}s, {verdict}), "
        f"identical outputs {identical}/{len(prompts)}\n"
        f"profile: {pool.cost_profile.outlook()}\n"
        f"drafters: {drafted or 'none drafted: every step was plain'}"
    )


if __name__ == "__main__":
    main()
