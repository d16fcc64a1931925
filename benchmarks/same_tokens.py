"""Same tokens at two commits: a refactor's check on the real pair (docs/benchmarks.md).

    python -m benchmarks.same_tokens --out A.json              # at one commit
    python -m benchmarks.same_tokens --out B.json              # at another
    python -m benchmarks.same_tokens --compare A.json B.json   # exit 1 unless every row and count agrees

Target Qwen2.5-Coder-1.5B in float32 (greedy output is then exact), pool [Qwen2.5-Coder-0.5B, prompt
lookup], the round-robin policy with the profile off and k = 8: nothing in a step's decisions reads the
clock, so two commits that decode alike take the same steps, and each row's drafted, accepted and
target-forward counts must agree too, not only its tokens. Batch 1 and 4, on both cache layouts; plain
`generate` once per batch, so each file also says whether hf_spin's rows equal plain decoding.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

import hf_spin
from benchmarks.common import DEFAULT_QUESTIONS, encode, load_questions, machine, new_tokens
from hf_spin import models

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFTER = "qwen2.5-coder-0.5b-instruct"
LAYOUTS = ("rectangular", "packed")
COUNTS = ("drafted", "accepted", "target_forwards", "new_tokens")


def layout_option(layout: str) -> dict:
    """The pool's cache-layout keyword: `cache=` where the pool takes it, else the older `ragged_attention=`
    (so one script runs at commits before and after the rename)."""
    if "cache" in inspect.signature(hf_spin.AssistantPool).parameters:
        return {"cache": layout}
    return {"ragged_attention": layout == "packed"}


def run(args) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    target, tok = models.load(TARGET, dtype=torch.float32)
    draft, _ = models.load(DRAFTER, dtype=torch.float32)
    questions = load_questions(args.questions, per_group=1, group_by="task")[: args.questions_count]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    runs = {}
    for bs in args.batch_sizes:
        batches = [questions[i : i + bs] for i in range(0, len(questions), bs)]
        plain = []
        for batch in batches:
            enc = encode(tok, batch)
            plain += new_tokens(target.generate(**enc, **gen), enc["input_ids"].shape[1], tok.pad_token_id)
        runs[f"plain/b{bs}"] = {"rows": plain}
        for layout in LAYOUTS:
            pool = hf_spin.AssistantPool(
                [hf_spin.ModelDrafter(draft, name="qwen-0.5b"), "prompt_lookup"],
                policy="round_robin",
                draft_length=8,
                profile="off",
                tokenizer=tok,
                **layout_option(layout),
            )
            rows, counts = [], []
            for batch in batches:
                enc = encode(tok, batch)
                out = target.generate(**enc, custom_generate=hf_spin.generate, assistant_pool=pool, **gen)
                rows += new_tokens(out, enc["input_ids"].shape[1], tok.pad_token_id)
                counts += [{c: getattr(r, c) for c in COUNTS} for r in pool.last_stats.rows]
            runs[f"{layout}/b{bs}"] = {"rows": rows, "counts": counts, "equals_plain": rows == plain}
            print(f"batch {bs} {layout}: rows equal plain generate: {rows == plain}", flush=True)
    return {"machine": machine(), "commit_note": args.note, "max_new_tokens": args.max_new_tokens, "runs": runs}


def compare(a: dict, b: dict) -> list[str]:
    """What differs between two files' runs (empty: the same tokens and counts)."""
    diffs = []
    for name in sorted(set(a["runs"]) | set(b["runs"])):
        ra, rb = a["runs"].get(name), b["runs"].get(name)
        if ra is None or rb is None:
            diffs.append(f"{name}: only in {'the first' if rb is None else 'the second'} file")
            continue
        for i, (x, y) in enumerate(zip(ra["rows"], rb["rows"])):
            if x != y:
                at = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
                diffs.append(f"{name} row {i}: tokens differ from position {at}")
        if ra.get("counts") != rb.get("counts"):
            diffs.append(f"{name}: per-row counts differ: {ra.get('counts')} vs {rb.get('counts')}")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--questions-count", type=int, default=4, help="first question of this many task groups")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="", help="what commit this is, stored in the file")
    ap.add_argument("--out", type=Path, help="write this run's rows and counts here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two files; no models loaded")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a, b)
        rows = sum(len(r["rows"]) for r in a["runs"].values())
        print("\n".join(diffs) if diffs else f"identical: {len(a['runs'])} runs, {rows} rows, tokens and counts")
        sys.exit(1 if diffs else 0)
    if args.out is None:
        ap.error("give --out FILE (or --compare A B)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
