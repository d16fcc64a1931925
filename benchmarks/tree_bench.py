"""Token trees against chains on Spec-Bench, real models, one run: plain `generate`, `transformers`'
prompt lookup and assisted generation (batch 1), hf_spin drafting chains, and hf_spin drafting trees.

    python -m benchmarks.tree_bench --questions ../shared/data/spec_bench/question.jsonl --per-group 2
    python -m benchmarks.tree_bench --drafter qwen2.5-coder-0.5b-instruct --cache rectangular
    python -m benchmarks.tree_bench --drafter qwen2.5-coder-0.5b-instruct --cache rectangular --profile auto

`--drafter`: prompt lookup (default; a tree of its matches' continuations) or a draft model (a tree it
grows a depth at a time, drafters/tree_expansion.py). With `--profile off` (default) both verify k
tokens a row and step, a chain of k or a tree cut to k nodes: the comparison is of what k verified
tokens buy. With `--profile auto` the planner sizes both from the measured cost profile (a tree node
by node): hf_spin as a user gets it.

Per task group: tokens committed per target forward, speed-up over plain `generate` in the same run,
rows identical to plain. Packed rows by default (`--cache rectangular`: trees under a 4D mask; a
model drafter grows trees only there).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

import hf_spin
from hf_spin.models import load
from hf_spin.policies import FixedLength

from .common import DEFAULT_QUESTIONS, encode, load_questions, machine, new_tokens, save_partial, timed, write_results

METHODS = ("plain", "transformers_lookup", "transformers_assisted", "hf_spin_chain", "hf_spin_tree")


def run_method(
    method: str,
    model,
    batch: dict,
    k: int,
    max_new_tokens: int,
    cache: str = "packed",
    drafter=None,
    profile: str = "off",
):
    """(output ids, seconds, tokens per target forward or None). drafter: a draft model, or None for
    prompt lookup; profile "off": k verified tokens a step (the tree cut to k nodes), else the planner's."""
    kwargs = dict(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    if method == "plain":
        out, seconds = timed(lambda: model.generate(**kwargs))
        return out, seconds, 1.0
    if method == "transformers_lookup":
        out, seconds = timed(lambda: model.generate(**kwargs, prompt_lookup_num_tokens=k))
        return out, seconds, None
    if method == "transformers_assisted":
        out, seconds = timed(lambda: model.generate(**kwargs, assistant_model=drafter))
        return out, seconds, None
    tree = False if method == "hf_spin_chain" else (k if profile == "off" else "auto")
    pool = hf_spin.AssistantPool(
        [drafter if drafter is not None else "prompt_lookup"],
        draft_length=FixedLength(k, min_confidence=0.0),
        cache=cache,
        profile=profile,
        tree=tree,
    )
    out, seconds = timed(lambda: model.generate(**kwargs, custom_generate=hf_spin.generate, assistant_pool=pool))
    return out, seconds, pool.last_stats.mean_accepted_length


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--per-group", type=int, default=2, help="questions per Spec-Bench task group")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--k", type=int, default=8, help="verified tokens per row and step: the chain's length, the tree's nodes"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument(
        "--cache",
        choices=["packed", "rectangular"],
        default="packed",
        help="hf_spin's target cache: packed rows (the kernel's tree masks) or the rectangular cache (a 4D mask)",
    )
    parser.add_argument(
        "--drafter", default="prompt_lookup", help="prompt_lookup, or a draft model's name (hf_spin.models)"
    )
    parser.add_argument(
        "--profile",
        choices=["off", "auto"],
        default="off",
        help="off: k verified tokens a step; auto: the planner sizes chains and trees",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tok = load(args.target, getattr(torch, args.dtype))
    drafter = None if args.drafter == "prompt_lookup" else load(args.drafter, getattr(torch, args.dtype))[0]
    questions = load_questions(args.questions, per_group=args.per_group, group_by="task")
    records = run(model, tok, drafter, questions, args)
    table = summarize(records)
    print(table)
    print(
        write_results(
            args.out,
            "tree_bench",
            {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "records": records},
            table,
        )
    )


def run(model, tok, drafter, questions: list[dict], args) -> list[dict]:
    """Every method on every batch of questions, in one run (records also appended to a partial file)."""
    partial = args.out / "tree_bench-partial.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for bs in args.batch_sizes:
        batches = [questions[i : i + bs] for i in range(0, len(questions), bs)]
        for group in tqdm(batches, desc=f"batch {bs}"):
            batch = encode(tok, group)
            L = batch["input_ids"].shape[1]
            reference = None
            for method in METHODS:
                if (
                    method.startswith("transformers")
                    and bs > 1
                    or method == "transformers_assisted"
                    and drafter is None
                ):
                    continue  # transformers' assisted generation runs at batch 1 only, with a draft model
                out, seconds, per_forward = run_method(
                    method, model, batch, args.k, args.max_new_tokens, args.cache, drafter, args.profile
                )
                texts = new_tokens(out, L, tok.pad_token_id)
                if method == "plain":
                    reference = texts
                record = {
                    "batch_size": bs,
                    "method": method,
                    "groups": [q["group"] for q in group],
                    "seconds": seconds,
                    "tokens": sum(map(len, texts)),
                    "per_forward": per_forward,
                    "identical": sum(a == b for a, b in zip(texts, reference)),
                }
                records.append(record)
                save_partial(partial, record)
    return records


def summarize(records: list[dict]) -> str:
    """Per batch size and task group: tokens per forward of chain and tree, speed-up over plain."""
    lines = []
    for bs in sorted({r["batch_size"] for r in records}):
        lines += [
            f"\nbatch {bs}",
            "| group | chain tok/forward | tree tok/forward | tree / chain | speed-up: chain | tree "
            "| transformers lookup | transformers assisted | identical (chain, tree) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        by = defaultdict(lambda: defaultdict(list))
        for r in records:
            if r["batch_size"] == bs:
                if bs == 1:  # a batch of several mixes task groups: ALL only
                    by[r["groups"][0]][r["method"]].append(r)
                by["ALL"][r["method"]].append(r)
        for group, methods in sorted(by.items(), key=lambda item: item[0] == "ALL"):  # ALL last
            plain = sum(r["seconds"] for r in methods["plain"])
            pf = {
                m: statistics.mean(r["per_forward"] for r in methods[m])
                for m in ("hf_spin_chain", "hf_spin_tree")
                if methods[m]
            }
            speed = {
                m: plain / sum(r["seconds"] for r in methods[m]) if methods[m] else float("nan") for m in METHODS[1:]
            }
            same = {
                m: f"{sum(r['identical'] for r in methods[m])}/{sum(len(r['groups']) for r in methods[m])}"
                for m in ("hf_spin_chain", "hf_spin_tree")
            }
            lines.append(
                f"| {group} | {pf['hf_spin_chain']:.2f} | {pf['hf_spin_tree']:.2f} "
                f"| {pf['hf_spin_tree'] / pf['hf_spin_chain']:.2f} | {speed['hf_spin_chain']:.2f} "
                f"| {speed['hf_spin_tree']:.2f} | {speed['transformers_lookup']:.2f} "
                f"| {speed['transformers_assisted']:.2f} | {same['hf_spin_chain']}, {same['hf_spin_tree']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
