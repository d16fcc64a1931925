"""The floor of "never slower than plain decoding": hf_spin decoding plainly vs plain `generate`.

    python -m benchmarks.research.plain_floor --per-task 2 --batch-size 4 --repeats 2

On the pool benchmark's batches (the first `--per-task` Spec-Bench questions of each task, in
batches of `--batch-size`), side by side, `--repeats` times: plain `generate`; hf_spin with a policy
that never drafts (every step a plain step through hf_spin's loop and cache), on the rectangular
cache and on packed rows; hf_spin with prompt lookup alone. A policy that decodes plainly where no
drafter pays can be no faster than the never-drafting rows; the spread between repetitions of the
same work is the noise any per-batch ratio of `pool_bench.py` carries.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

import hf_spin
from benchmarks.common import DEFAULT_QUESTIONS, encode, load_questions, machine, new_tokens, timed, write_results
from hf_spin import models
from hf_spin.policies.base import Policy

TARGET = "qwen2.5-coder-1.5b-instruct"


class NeverDraft(Policy):
    """Every row decodes plainly at every step."""

    def select(self, view):
        return [()] * view.batch_size


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-task", type=int, default=2, help="questions per Spec-Bench task (6 tasks)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every batch by every method")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, tok = models.load(TARGET, dtype=getattr(torch, args.dtype))
    questions = load_questions(args.questions, args.per_task, None, group_by="task")
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    pools = {
        "never drafting": hf_spin.AssistantPool(["prompt_lookup"], policy=NeverDraft(), tokenizer=tok),
        "never drafting, packed rows": hf_spin.AssistantPool(
            ["prompt_lookup"], policy=NeverDraft(), tokenizer=tok, cache="packed"
        ),
        "prompt lookup, k = 5": hf_spin.AssistantPool(["prompt_lookup"], tokenizer=tok, draft_length=5),
    }

    def run(method: str, batch: dict) -> tuple[torch.Tensor, float]:
        if method == "plain":
            return timed(lambda: target.generate(**batch, **gen))
        return timed(
            lambda: target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pools[method], **gen)
        )

    methods = ["plain", *pools]
    first = encode(tok, questions[:1])  # one-off allocation costs would bias whichever method runs first
    for method in methods:
        run(method, first)
    batches = [questions[i : i + args.batch_size] for i in range(0, len(questions), args.batch_size)]
    records = []
    for rep in tqdm(range(args.repeats), desc="repeats"):
        for i, chunk in enumerate(batches):
            batch = encode(tok, chunk)
            P = batch["input_ids"].shape[1]
            reference = None
            for method in methods:
                out, seconds = run(method, batch)
                got = new_tokens(out, P, tok.pad_token_id)
                reference = reference or got
                stats = pools[method].last_stats if method != "plain" else None
                records.append(
                    {
                        "repeat": rep,
                        "batch": i,
                        "padded_prompt": P,
                        "method": method,
                        "seconds": seconds,
                        "identical_rows": sum(a == b for a, b in zip(got, reference)),
                        "rows": len(got),
                        "prefill_seconds": stats.prefill_seconds if stats else None,
                        "verify_seconds": stats.verify_seconds if stats else None,
                    }
                )
    plain = {(r["repeat"], r["batch"]): r["seconds"] for r in records if r["method"] == "plain"}
    lines = [
        f"hf_spin decoding plainly vs plain `generate`: batch {args.batch_size}, "
        f"{len(batches)} batches x {args.repeats} repeats, {args.max_new_tokens} new tokens, {args.dtype}; "
        f"target {TARGET}; {machine()}.",
        "",
        "| method | seconds | time ratio vs plain | per batch run (min-max) | prefill s | verify s | identical rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in methods:
        rs = [r for r in records if r["method"] == method]
        total = sum(r["seconds"] for r in rs)
        ratios = [plain[(r["repeat"], r["batch"])] / r["seconds"] for r in rs]
        prefill = sum(r["prefill_seconds"] or 0 for r in rs) if method != "plain" else None
        verify = sum(r["verify_seconds"] or 0 for r in rs) if method != "plain" else None
        lines.append(
            f"| {method} | {total:.1f} | {sum(plain.values()) / total:.2f}x | {min(ratios):.2f}-{max(ratios):.2f} | "
            f"{'-' if prefill is None else f'{prefill:.1f}'} | {'-' if verify is None else f'{verify:.1f}'} | "
            f"{sum(r['identical_rows'] for r in rs)}/{sum(r['rows'] for r in rs)} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    md = write_results(
        args.out,
        "plain_floor",
        {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "records": records},
        table,
    )
    print(f"written: {md}")


if __name__ == "__main__":
    main()
