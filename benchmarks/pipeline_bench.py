"""Pipelining on and off, in process (no HTTP): the same rows through `SpinEngine` and through
`Pipeline` with 2 (or `--micro-batches`) micro-batches, alternating runs, on the packaged models.

    python -m benchmarks.pipeline_bench                          # 4 Spec-Bench prompts, 16 new tokens, 2 runs each
    python -m benchmarks.pipeline_bench --rows 8 --max-new-tokens 32 --runs 3

Reports wall seconds, tokens/s, the pipeline's time blocked on each side (drafting thread on the
full result pool, target thread waiting for drafts) and whether the greedy outputs are identical.
Speed ratios only mean something on an otherwise idle machine; on this 2-core CPU the drafting and
verification threads share the cores the matmuls already use.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria

import hf_spin
from benchmarks.common import DEFAULT_QUESTIONS, load_questions, machine, write_results
from hf_spin import models


def run(engine, requests) -> tuple[float, list[list[int]]]:
    rows = [engine.add(r) for r in requests]
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    engine.close()
    return seconds, [r.generated for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads in all (the pipeline splits them between its two threads)"
    )
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()

    target, tok = models.load(args.model)
    draft, _ = models.load(args.drafter)
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    questions = load_questions(args.questions, per_group=1, limit=args.rows)

    def requests():
        out = []
        for q in questions:
            text = tok.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append(
                hf_spin.Request(
                    prompt=ids,
                    max_new_tokens=args.max_new_tokens,
                    stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos)]),
                )
            )
        return out

    def pool():
        return hf_spin.AssistantPool([draft], policy="fixed", tokenizer=tok)

    split = (max(1, args.threads - args.threads // 2), max(1, args.threads // 2))
    records, outputs = [], {}
    for i in range(args.runs):
        for mode in ("engine", "pipeline"):
            if mode == "engine":
                torch.set_num_threads(args.threads)
                engine = hf_spin.SpinEngine(target, pool(), tok)
            else:
                torch.set_num_threads(split[0])
                engine = hf_spin.Pipeline(target, pool(), tok, micro_batches=args.micro_batches, draft_threads=split[1])
            seconds, gen = run(engine, requests())
            tokens = sum(len(g) for g in gen)
            rec = {"run": i, "mode": mode, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
            if mode == "pipeline":
                rec.update(
                    pool_wait_s=engine.pool_wait_seconds, target_wait_s=engine.target_wait_seconds, steps=engine.steps
                )
            records.append(rec)
            outputs.setdefault(mode, gen)
            print(rec, flush=True)
    same = sum(a == b for a, b in zip(outputs["engine"], outputs["pipeline"]))
    lines = [
        "| run | mode | seconds | tokens | tok/s | drafting blocked s | target waiting s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['run']} | {r['mode']} | {r['seconds']:.1f} | {r['tokens']} | {r['tok_s']:.2f} | "
            f"{r.get('pool_wait_s', 0):.1f} | {r.get('target_wait_s', 0):.1f} |"
        )
    lines.append(f"\nidentical greedy outputs (pipeline vs engine): {same}/{len(outputs['engine'])}")
    table = "\n".join(lines) + "\n"
    print(table)
    md = write_results(
        args.out,
        "pipeline_bench",
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": machine(),
            "records": records,
            "identical": same,
        },
        table,
    )
    print(f"results: {md}")


if __name__ == "__main__":
    main()
