"""Suffix drafting against prompt lookup on real models, one run (issue 35): plain `generate`,
`transformers`' prompt lookup (batch 1: it refuses more), hf_spin's prompt lookup, hf_spin's suffix
drafter and an LBSS pool of a draft model and the suffix drafter, on the same prompts.

    python -m benchmarks.suffix_bench --questions ../shared/data/spec_bench/question.jsonl --per-group 2

Workloads (benchmarks/workloads.py): `spec_bench` (first turns, per task group), `multi_turn`
(MT-Bench's two turns, turn 2 carrying turn 1's answer) and `schema` (repeated JSON records). Every
turn-2 prompt carries plain decoding's answer to turn 1, so every method sees the same prompts.

Each hf_spin method keeps one pool for a whole workload at a batch size, requests in order, as a server
would: the suffix drafter learns from the outputs before (a fresh pool per workload and batch size, so
batch 4 does not replay batch 1's outputs). Reported per workload, batch size and group (task group,
turn, record kind; a batch mixing groups counts in ALL only): speed-up over plain (summed plain seconds
over summed method seconds), tokens per target forward and acceptance (summed over the calls' rows),
outputs identical to plain, and suffix over hf_spin prompt lookup (speed and tokens per forward).
On a CPU only the ratios and counts mean anything.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

import hf_spin
from hf_spin import models
from hf_spin.pool import CACHE_LAYOUTS

from . import workloads
from .common import DEFAULT_QUESTIONS, machine, new_tokens, save_partial, timed, write_results

METHODS = ("plain", "transformers_lookup", "hf_spin_lookup", "hf_spin_suffix", "hf_spin_pool")
SPIN = {
    "hf_spin_lookup": "lookup",
    "hf_spin_suffix": "suffix",
    "hf_spin_pool": "pool",
}  # hf_spin methods -> column label
WARM_UP_TOKENS = 4  # every method once on the first prompt, unrecorded: one-off costs (and cost profiles) land there


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--workloads", nargs="+", default=list(workloads.WORKLOADS), choices=workloads.WORKLOADS)
    ap.add_argument(
        "--per-group",
        type=int,
        default=2,
        help="spec_bench: questions per task group; multi_turn: conversations per MT-Bench category",
    )
    ap.add_argument("--schema-requests", type=int, default=24, help="requests of the schema workload (at most 48)")
    ap.add_argument("--limit", type=int, default=None, help="cap on the conversations of each workload (quick runs)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--k",
        type=int,
        default=8,
        help="tokens drafted per row and step: hf_spin's draft_length (the planner's upper bound), "
        "transformers' prompt_lookup_num_tokens",
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=METHODS, help="plain always runs (the reference)"
    )
    ap.add_argument(
        "--profile",
        default="auto",
        choices=["auto", "off"],
        help="hf_spin pools: the planner's cost profile (auto) or the k given every step (off)",
    )
    ap.add_argument("--policy", default="lbss", help="hf_spin_pool's policy")
    ap.add_argument(
        "--cache",
        default="rectangular",
        choices=CACHE_LAYOUTS,
        help="hf_spin's KV cache layout: rectangular, or packed rows (the varlen kernel)",
    )
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", choices=models.NAMES)
    ap.add_argument(
        "--draft", default="qwen2.5-coder-0.5b-instruct", choices=models.NAMES, help="hf_spin_pool's draft model"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    args.methods = ["plain"] + [m for m in METHODS[1:] if m in args.methods]
    return args


def build_workloads(args) -> dict[str, list[workloads.Conversation]]:
    builders = {
        "spec_bench": lambda: workloads.spec_bench(args.questions, args.per_group, args.limit),
        "multi_turn": lambda: workloads.multi_turn(args.questions, args.per_group, args.limit),
        "schema": lambda: workloads.schema(
            min(args.schema_requests, args.limit if args.limit is not None else args.schema_requests)
        ),
    }
    return {name: builders[name]() for name in args.workloads}


class Bench:
    """The target, the draft model, the methods' pools and the runs."""

    def __init__(self, target, tok, draft, draft_tok, args):
        self.target, self.tok, self.draft, self.draft_tok, self.args = target, tok, draft, draft_tok, args
        self.gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    def pool(self, method: str) -> hf_spin.AssistantPool:
        """A fresh pool for an hf_spin method."""
        options = dict(draft_length=self.args.k, tokenizer=self.tok, profile=self.args.profile, cache=self.args.cache)
        if method == "hf_spin_lookup":
            return hf_spin.AssistantPool(["prompt_lookup"], **options)
        if method == "hf_spin_suffix":
            return hf_spin.AssistantPool(["suffix"], **options)
        same = self.draft_tok is None or self.draft_tok.get_vocab() == self.tok.get_vocab()
        draft = hf_spin.ModelDrafter(self.draft) if same else (self.draft, self.draft_tok)
        return hf_spin.AssistantPool([draft, "suffix"], policy=self.args.policy, **options)

    def call(self, method: str, batch: dict, pools: dict, gen: dict):
        """(output ids, seconds, the call's GenerationStats or None)."""
        if method == "plain":
            out, seconds = timed(lambda: self.target.generate(**batch, **gen))
            return out, seconds, None
        if method == "transformers_lookup":
            out, seconds = timed(lambda: self.target.generate(**batch, prompt_lookup_num_tokens=self.args.k, **gen))
            return out, seconds, None
        pool = pools[method]
        out, seconds = timed(
            lambda: self.target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, **gen)
        )
        return out, seconds, pool.last_stats

    def methods(self, batch_size: int) -> list[str]:
        # transformers' assisted generation (prompt lookup included) raises at batch > 1
        return [m for m in self.args.methods if not (m == "transformers_lookup" and batch_size > 1)]

    def warm_up(self, conversation: workloads.Conversation) -> None:
        """Every method on one prompt for WARM_UP_TOKENS tokens with throwaway pools (what they learn
        is not kept; the cost profiles they measure are, on disk)."""
        batch = workloads.encode_chats(self.tok, [conversation.messages(0, [])])
        pools = {m: self.pool(m) for m in self.args.methods if m in SPIN}
        for method in self.methods(1):
            self.call(method, batch, pools, {**self.gen, "max_new_tokens": WARM_UP_TOKENS})

    def run(
        self, workload: str, conversations: list[workloads.Conversation], batch_size: int, partial: Path | None = None
    ) -> list[dict]:
        """One record per call (method x batch x turn). Batches of spec_bench keep to one task group."""
        pools = {
            m: self.pool(m) for m in self.methods(batch_size) if m in SPIN
        }  # one per method for the whole workload
        records = []
        for chunk in tqdm(
            batches(conversations, batch_size, by_group=workload == "spec_bench"),
            desc=f"{workload}, batch {batch_size}",
        ):
            answers: list[list[str]] = [[] for _ in chunk]  # plain decoding's answers, turn by turn
            for turn in range(max(len(c.turns) for c in chunk)):
                rows = [i for i, c in enumerate(chunk) if turn < len(c.turns)]
                batch = workloads.encode_chats(self.tok, [chunk[i].messages(turn, answers[i]) for i in rows])
                P = batch["input_ids"].shape[1]
                groups = [f"turn {turn + 1}" if workload == "multi_turn" else chunk[i].group for i in rows]
                reference = None
                for method in self.methods(batch_size):
                    out, seconds, stats = self.call(method, batch, pools, self.gen)
                    texts = new_tokens(out, P, self.tok.pad_token_id)
                    if method == "plain":
                        reference = texts
                        for i, t in zip(rows, texts):
                            answers[i].append(self.tok.decode(t, skip_special_tokens=True))
                    record = {
                        "workload": workload,
                        "batch_size": batch_size,
                        "method": method,
                        "turn": turn + 1,
                        "ids": [chunk[i].id for i in rows],
                        "groups": groups,
                        "prompt_tokens": int(batch["attention_mask"].sum()),
                        "seconds": seconds,
                        "new_tokens": sum(map(len, texts)),
                        "identical": sum(a == b for a, b in zip(texts, reference)),
                        **(spin_counts(stats) if stats is not None else {}),
                    }
                    records.append(record)
                    save_partial(partial, record)
        return records


def batches(conversations: list, batch_size: int, by_group: bool) -> list[list]:
    """Consecutive conversations in batches of `batch_size` (by_group: each group's apart, so no batch mixes groups)."""
    runs = defaultdict(list)
    for c in conversations:
        runs[c.group if by_group else None].append(c)
    return [run[i : i + batch_size] for run in runs.values() for i in range(0, len(run), batch_size)]


def spin_counts(stats) -> dict:
    """A call's counts summed over its rows (rates are taken over sums, never averaged)."""
    chosen = Counter()
    for row in stats.rows:
        chosen.update(row.drafters)
    return {
        "drafted": sum(r.drafted for r in stats.rows),
        "accepted": sum(r.accepted for r in stats.rows),
        "target_forwards": sum(r.target_forwards for r in stats.rows),
        "stats_new_tokens": stats.new_tokens,
        "chosen": dict(chosen),
    }


def summarize(records: list[dict]) -> dict:
    """workload -> batch size -> group (ALL last) -> method -> speed-up, tokens per forward, acceptance,
    identical; plus suffix over hf_spin prompt lookup."""
    out: dict = {}
    for r in records:
        keys = ["ALL"] + ([r["groups"][0]] if len(set(r["groups"])) == 1 else [])  # a batch mixing groups: ALL only
        for key in keys:
            cell = out.setdefault(r["workload"], {}).setdefault(r["batch_size"], {}).setdefault(key, {})
            m = cell.setdefault(r["method"], Counter())
            m.update(
                {
                    k: r[k]
                    for k in (
                        "seconds",
                        "new_tokens",
                        "identical",
                        "drafted",
                        "accepted",
                        "target_forwards",
                        "stats_new_tokens",
                    )
                    if k in r
                }
            )
            m["rows"] += len(r["ids"])
            m.update({f"chosen:{name}": n for name, n in r.get("chosen", {}).items()})
    for per_bs in out.values():
        for bs, groups in per_bs.items():
            ordered = sorted(groups, key=lambda g: (g == "ALL", g))
            per_bs[bs] = {g: derive(groups[g]) for g in ordered}
    return out


def derive(cell: dict[str, Counter]) -> dict:
    plain = cell["plain"]["seconds"]
    row = {"rows": cell["plain"]["rows"], "plain_tokens": cell["plain"]["new_tokens"]}
    for method, c in cell.items():
        chosen = {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("chosen:")}
        row[method] = {
            "speedup": plain / c["seconds"] if c["seconds"] else None,
            "tokens_per_forward": (c["stats_new_tokens"] / c["target_forwards"] if c["target_forwards"] else None)
            if method in SPIN
            else (1.0 if method == "plain" else None),
            "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else (0.0 if method in SPIN else None),
            "identical": f"{c['identical']}/{c['rows']}",
            "chosen": {k: v / sum(chosen.values()) for k, v in chosen.items()} if chosen else None,
        }
    lookup, suffix = row.get("hf_spin_lookup"), row.get("hf_spin_suffix")
    if lookup and suffix:
        row["suffix_over_lookup"] = {
            "speed": cell["hf_spin_lookup"]["seconds"] / cell["hf_spin_suffix"]["seconds"],
            "tokens_per_forward": _ratio(suffix["tokens_per_forward"], lookup["tokens_per_forward"]),
        }
    return row


def _ratio(a, b):
    return a / b if a is not None and b else None


def markdown(summary: dict, env: dict) -> str:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = [
        f"Suffix drafting benchmark: greedy, {env['dtype']}, {env['max_new_tokens']} new tokens, k={env['k']}, "
        f"profile {env['profile']}, "
        f"cache={env['cache']}; target {env['target']}, pool = {env['draft']} + suffix ({env['policy']}); "
        f"{env['machine']}; torch {env['torch']}, transformers {env['transformers']}, hf_spin {env['hf_spin']}. "
        "Speed-up: summed plain seconds over summed method seconds, same prompts, same run.",
    ]
    for workload, per_bs in summary.items():
        for bs, groups in per_bs.items():
            methods = [m for m in METHODS[1:] if m in groups["ALL"]]
            spin = [m for m in methods if m in SPIN]
            header = ["group", "rows"] + [f"speed-up {SPIN.get(m, 'transformers lookup')}" for m in methods]
            header += [f"tok/fwd {SPIN[m]}" for m in spin] + [f"accept {SPIN[m]}" for m in spin]
            header += [
                "suffix/lookup speed",
                "suffix/lookup tok/fwd",
                "identical " + ", ".join(SPIN.get(m, "transformers") for m in methods),
            ]
            if "hf_spin_pool" in spin:
                header.append("pool's choices (row-steps)")
            lines += [
                "",
                f"### {workload}, batch {bs}",
                "",
                "| " + " | ".join(header) + " |",
                "|---" * len(header) + "|",
            ]
            for group, row in groups.items():
                cells = [group, str(row["rows"])] + [fmt(row[m]["speedup"]) for m in methods]
                cells += [fmt(row[m]["tokens_per_forward"]) for m in spin] + [
                    fmt(row[m]["acceptance_rate"], ".0%") for m in spin
                ]
                ratio = row.get("suffix_over_lookup", {})
                cells += [
                    fmt(ratio.get("speed")),
                    fmt(ratio.get("tokens_per_forward")),
                    ", ".join(row[m]["identical"] for m in methods),
                ]
                if "hf_spin_pool" in spin:
                    chosen = row["hf_spin_pool"]["chosen"] or {}
                    cells.append(
                        ", ".join(
                            f"{k.split('/')[-1]} {v:.0%}" for k, v in sorted(chosen.items(), key=lambda kv: -kv[1])
                        )
                        or "plain"
                    )
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(bench: Bench, conversations: dict[str, list], args) -> list[dict]:
    """Every workload at every batch size, in order; records as they come go to the partial file."""
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "suffix_bench-partial.jsonl"
    partial.write_text("")  # this run's records only
    first = next((c[0] for c in conversations.values() if c), None)
    if first is not None:
        bench.warm_up(first)
    records = []
    for workload, convs in conversations.items():
        for bs in args.batch_sizes:
            records += bench.run(workload, convs, bs, partial)
    return records


def report(args, records: list[dict]) -> tuple[dict, str, Path]:
    env = {**machine(), **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    summary = summarize(records)
    table = markdown(summary, env)
    path = write_results(args.out, "suffix_bench", {"env": env, "summary": summary, "records": records}, table)
    return summary, table, path


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # explicit: an oversubscribed CPU collapses ~10x
    conversations = build_workloads(args)
    dtype = getattr(torch, args.dtype)
    target, tok = models.load(args.target, dtype)
    draft, draft_tok = models.load(args.draft, dtype) if "hf_spin_pool" in args.methods else (None, None)
    records = run(Bench(target, tok, draft, draft_tok, args), conversations, args)
    _, table, path = report(args, records)
    print(table)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
