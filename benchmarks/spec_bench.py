"""Spec-Bench side by side: plain `generate`, `transformers`' assisted generation and hf_spin, one run.

    python -m benchmarks.spec_bench --per-category 1 --max-new-tokens 64
    accelerate launch --num_processes 2 -m benchmarks.spec_bench --per-category 1   # prompts sharded

Protocol (Spec-Bench's, on the first turn of each question): greedy, speed per question = new tokens
/ wall time, speed-up = mean speed / mean speed of plain decoding on the same prompts, mean accepted
length = tokens per target forward. Batch 1 compares all three; batch > 1 compares plain batched
`generate` with hf_spin (`transformers`' assisted generation refuses batch > 1). Every output is
checked against plain decoding. Writes JSON and a markdown table to --out.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm

import hf_spin
from benchmarks.common import (
    DEFAULT_QUESTIONS,
    encode,
    load_questions,
    machine,
    new_tokens,
    save_partial,
    timed,
    write_results,
)
from hf_spin import models
from hf_spin.policies import FixedLength


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=1, help="questions taken from each category")
    ap.add_argument("--limit", type=int, default=None, help="cap on the number of questions (quick runs)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", choices=models.NAMES)
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", choices=models.NAMES)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-length", type=int, default=hf_spin.policies.DEFAULT_DRAFT_LENGTH, help="hf_spin's k")
    ap.add_argument(
        "--min-confidence",
        type=float,
        default=hf_spin.policies.DEFAULT_MIN_CONFIDENCE,
        help="hf_spin's confidence stop (transformers' assistant default: 0.4 with k <= 20)",
    )
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 8], help="batched comparisons (besides batch 1)")
    ap.add_argument("--skip-batch1", action="store_true", help="only the batched comparisons")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


def run_batch1(target, drafter, tok, questions, args) -> list[dict]:
    """One record per question: speed, identity and acceptance of each method."""
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    records = []
    for q in tqdm(questions, desc="batch 1", disable=not PartialState().is_main_process):
        batch = encode(tok, [q])
        P = batch["input_ids"].shape[1]
        plain, t_plain = timed(lambda: target.generate(**batch, **gen))
        assisted, t_assisted = timed(lambda: target.generate(**batch, assistant_model=drafter, **gen))
        pool = hf_spin.AssistantPool([drafter], draft_length=FixedLength(args.draft_length, args.min_confidence))
        spin, t_spin = timed(
            lambda: target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, **gen)
        )
        ref = new_tokens(plain, P, tok.pad_token_id)[0]
        stats = pool.last_stats
        records.append(
            {
                "question_id": q["question_id"],
                "category": q["category"],
                "new_tokens": len(ref),
                "seconds": {"plain": t_plain, "assisted": t_assisted, "hf_spin": t_spin},
                "identical": {
                    "assisted": new_tokens(assisted, P, tok.pad_token_id)[0] == ref,
                    "hf_spin": new_tokens(spin, P, tok.pad_token_id)[0] == ref,
                },
                "hf_spin": {
                    "acceptance_rate": stats.acceptance_rate,
                    "mean_accepted_length": stats.mean_accepted_length,
                    "goodput": stats.goodput,
                    "draft_seconds": sum(d.draft_seconds for d in stats.drafters.values()),
                    "verify_seconds": stats.verify_seconds,
                },
            }
        )
        save_partial(getattr(args, "partial", None), records[-1])
    return records


# hf_spin variants at batch > 1: the rectangular cache with holes, and packed rows (no padding at all)
BATCHED_VARIANTS = {"hf_spin": {}, "hf_spin_packed": {"cache": "packed"}}


def run_batched(target, drafter, tok, questions, batch_size, args) -> list[dict]:
    """One record per batch: plain batched `generate` and each hf_spin variant, with where the time went."""
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    records = []
    chunks = [questions[i : i + batch_size] for i in range(0, len(questions), batch_size)]
    for chunk in tqdm(chunks, desc=f"batch {batch_size}", disable=not PartialState().is_main_process):
        batch = encode(tok, chunk)
        P = batch["input_ids"].shape[1]
        plain, t_plain = timed(lambda: target.generate(**batch, **gen))
        ref = new_tokens(plain, P, tok.pad_token_id)
        record = {
            "batch_size": len(chunk),
            "categories": [q["category"] for q in chunk],
            "prompt_tokens": int(batch["attention_mask"].sum()),
            "padded_prompt_tokens": int(batch["attention_mask"].numel()),
            "new_tokens": sum(len(r) for r in ref),
            "seconds": {"plain": t_plain},
        }
        for variant, options in BATCHED_VARIANTS.items():
            pool = hf_spin.AssistantPool(
                [drafter], draft_length=FixedLength(args.draft_length, args.min_confidence), **options
            )
            spin, t_spin = timed(
                lambda: target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, **gen)
            )
            stats = pool.last_stats
            record["seconds"][variant] = t_spin
            record[variant] = {
                "identical_rows": sum(a == b for a, b in zip(new_tokens(spin, P, tok.pad_token_id), ref)),
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length,
                "steps": stats.steps,
                "prefill_seconds": stats.prefill_seconds,
                "draft_seconds": sum(d.draft_seconds for d in stats.drafters.values()),
                "verify_seconds": stats.verify_seconds,
            }
        records.append(record)
        save_partial(getattr(args, "partial", None), records[-1])
    return records


def summarize(records: list[dict], batched: dict[int, list[dict]]) -> dict:
    """Per category and overall: Spec-Bench speed-ups (mean speed / mean plain speed) and rates."""
    groups = defaultdict(list)
    for r in records:
        groups[r["category"]].append(r)
        groups["ALL"].append(r)

    def speed(rs, method):
        return statistics.mean(r["new_tokens"] / r["seconds"][method] for r in rs)

    table = {}
    for cat, rs in groups.items():
        plain = speed(rs, "plain")
        table[cat] = {
            "n": len(rs),
            "plain_tok_s": plain,
            "assisted_speedup": speed(rs, "assisted") / plain,
            "hf_spin_speedup": speed(rs, "hf_spin") / plain,
            "hf_spin_vs_assisted": speed(rs, "hf_spin") / speed(rs, "assisted"),
            "acceptance_rate": statistics.mean(r["hf_spin"]["acceptance_rate"] for r in rs),
            "mean_accepted_length": statistics.mean(r["hf_spin"]["mean_accepted_length"] for r in rs),
            "hf_spin_goodput": statistics.mean(r["hf_spin"]["goodput"] for r in rs),
            "identical_hf_spin": sum(r["identical"]["hf_spin"] for r in rs),
            "identical_assisted": sum(r["identical"]["assisted"] for r in rs),
        }
    batch_table = {}
    for bs, rs in batched.items():
        tokens = sum(r["new_tokens"] for r in rs)
        plain_s = sum(r["seconds"]["plain"] for r in rs)
        row = {
            "batches": len(rs),
            "plain_tok_s": tokens / plain_s,
            "padded_prompt_fraction": 1
            - sum(r["prompt_tokens"] for r in rs) / sum(r["padded_prompt_tokens"] for r in rs),
        }
        for variant in BATCHED_VARIANTS:
            total = sum(r["seconds"][variant] for r in rs)
            row[variant] = {
                "tok_s": tokens / total,
                "throughput_ratio": plain_s / total,
                "acceptance_rate": statistics.mean(r[variant]["acceptance_rate"] for r in rs),
                "mean_accepted_length": statistics.mean(r[variant]["mean_accepted_length"] for r in rs),
                "identical_rows": f"{sum(r[variant]['identical_rows'] for r in rs)}/{sum(r['batch_size'] for r in rs)}",
                **{
                    k: sum(r[variant][k] for r in rs)
                    for k in ("steps", "prefill_seconds", "draft_seconds", "verify_seconds")
                },
            }
        batch_table[bs] = row
    return {"batch1": table, "batched": batch_table}


def markdown(summary: dict, env: dict) -> str:
    lines = [
        f"Spec-Bench, greedy, {env['dtype']}, {env['max_new_tokens']} new tokens, {env['threads']} threads; "
        f"target {env['target']}, drafter {env['drafter']} "
        f"(hf_spin k={env['draft_length']}, min_confidence={env['min_confidence']}); "
        f"{env['machine']}, {env['processes']} process(es); "
        f"torch {env['torch']}, transformers {env['transformers']}, hf_spin {env['hf_spin']}.",
    ]
    if summary["batch1"]:
        lines += [
            "",
            "| category | n | plain tok/s | assisted x | hf_spin x | hf_spin / assisted | acceptance "
            "| mean accepted len | identical (spin / assisted) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for cat, r in sorted(summary["batch1"].items(), key=lambda kv: (kv[0] == "ALL", kv[0])):  # empty with --skip-batch1
        lines.append(
            f"| {cat} | {r['n']} | {r['plain_tok_s']:.2f} | {r['assisted_speedup']:.2f} | {r['hf_spin_speedup']:.2f} | "
            f"{r['hf_spin_vs_assisted']:.2f} | {r['acceptance_rate']:.1%} | {r['mean_accepted_length']:.2f} | "
            f"{r['identical_hf_spin']}/{r['n']} / {r['identical_assisted']}/{r['n']} |"
        )
    if summary["batched"]:
        lines += [
            "",
            "Batch > 1: plain batched `generate` vs hf_spin on the rectangular cache (`hf_spin`) and on packed rows "
            "(`hf_spin_packed`, `cache='packed'`); seconds summed over the batches (prefill = until the first token).",
            "",
            "| batch | batches | padded prompt share | plain tok/s | variant | tok/s | ratio | acceptance "
            "| mean accepted len | steps | prefill s | draft s | verify s | identical rows |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for bs, r in summary["batched"].items():
            for variant in BATCHED_VARIANTS:
                v = r[variant]
                lines.append(
                    f"| {bs} | {r['batches']} | {r['padded_prompt_fraction']:.0%} | {r['plain_tok_s']:.2f} "
                    f"| {variant} | {v['tok_s']:.2f} | {v['throughput_ratio']:.2f} | {v['acceptance_rate']:.1%} "
                    f"| {v['mean_accepted_length']:.2f} | {v['steps']} | {v['prefill_seconds']:.1f} "
                    f"| {v['draft_seconds']:.1f} | {v['verify_seconds']:.1f} | {v['identical_rows']} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # explicit: the default can oversubscribe and collapse ~10x
    state = PartialState()
    dtype = getattr(torch, args.dtype)
    target, tok = models.load(args.target, dtype=dtype)
    drafter, _ = models.load(args.drafter, dtype=dtype)
    questions = load_questions(args.questions, args.per_category, args.limit)
    # warm-up: first calls pay one-off allocation costs that would bias whichever method runs first
    run_batch1(target, drafter, tok, questions[:1], argparse.Namespace(**{**vars(args), "max_new_tokens": 4}))
    args.out.mkdir(parents=True, exist_ok=True)
    args.partial = args.out / f"partial-{state.process_index}.jsonl"
    with state.split_between_processes(questions) as shard:
        records = [] if args.skip_batch1 else run_batch1(target, drafter, tok, shard, args)
        batched = {bs: run_batched(target, drafter, tok, shard, bs, args) for bs in args.batch_sizes}
    records = gather_object(records)
    batched = {bs: gather_object(rs) for bs, rs in batched.items()}
    if not state.is_main_process:
        return
    env = {
        **machine(state.num_processes),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "target": args.target,
        "drafter": args.drafter,
        "draft_length": args.draft_length,
        "min_confidence": args.min_confidence,
        "questions": len(records),
    }
    summary = summarize(records, batched)
    table = markdown(summary, env)
    write_results(
        args.out, "spec_bench", {"env": env, "summary": summary, "records": records, "batched": batched}, table
    )
    print(table)


if __name__ == "__main__":
    main()
