"""Why LBSS chose what it chose: a per-step trace of its decisions on the pool benchmark's batches.

    python -m benchmarks.research.lbss_trace --per-task 2 --batch-sizes 4            # cold, as pool_bench.py
    python -m benchmarks.research.lbss_trace --per-task 3 --batch-sizes 1 --policy-warmup 1

The same models, prompts, batches and warm-up as `pool_bench.py` (its flags), but only plain
`generate` and one LBSS pool, whose policy records every step: per row its schedule (epoch,
exploring), the drafters it could explore, its choice, and per drafter the estimate the matching saw
(tokens a step commits, the row's seconds at this batch size, catch-up lag); then what the step did
(drafted, accepted, verify and draft seconds). Written as JSON lines (`lbss_trace-*.jsonl`), with a
calibration table: per drafter, the tokens and seconds LBSS predicted for the steps it chose against
what those steps took. The predictions carry `LBSSConfig.optimism` (an upper confidence bound), so
predicted tokens sit above the measured ones by design; a drafter whose excess stands out from the
others' is one the policy over-chooses.
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch
from tqdm import tqdm

import hf_spin
from benchmarks.common import machine, write_results
from benchmarks.pool_bench import Bench, parse_args, workload
from hf_spin.policies import make_draft_length
from hf_spin.policies.lbss import LBSSPolicy


class TracedLBSS(LBSSPolicy):
    """LBSS that keeps a record of what it saw and chose at each step (`trace`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace: list[dict] = []

    def select(self, view):
        self.batch_size = view.batch_size
        before = {}
        for b, rid in enumerate(view.row_ids):
            row = self.rows.get(rid)
            if row is not None:  # its schedule and options as this step's selection finds them
                self.refresh(row, view, b)
                before[b] = {"explorable": sorted(self.explorable(row, row.age)), "steps_left": self.steps_left(row)}
        choice = super().select(view)
        B = view.batch_size
        rows = []
        for b, rid in enumerate(view.row_ids):
            row = self.rows[rid]
            estimates = {}
            for d, info in enumerate(self.drafters):
                k = self.draft_length.k(d, b, view)
                estimates[info.name] = {
                    "tokens": self.expected_tokens(row, d, k),
                    "seconds": self.row_seconds(d, k, B),
                    "lag": self.lag(row, d),
                }
            stage = self.stage(row.age - 1)
            rows.append(
                {
                    "row_id": rid,
                    "age": row.age - 1,
                    "epoch": stage.epoch,
                    "explore": stage.explore,
                    **before.get(b, {}),
                    "choice": list(choice[b]),
                    "pending": row.pending,
                    "runner_up": row.runner_up,
                    "estimates": estimates,
                }
            )
        catch_up = {self.drafters[d].name: batch_rows for d, batch_rows in self._catch_up.items()}
        self.trace.append(
            {"batch_size": B, "plain_seconds": self.costs.plain_seconds(B), "catch_up": catch_up, "rows": rows}
        )
        return choice

    def update(self, feedback):
        self.trace[-1]["feedback"] = {
            "drafters": [list(d) for d in feedback.plan.drafters],
            "drafted": feedback.drafted,
            "accepted": feedback.accepted,
            "verify_seconds": feedback.verify_seconds,
            "draft_seconds": feedback.draft_seconds,
        }
        super().update(feedback)


def calibration(trace: list[dict]) -> dict:
    """Per drafter (and plain): the steps LBSS chose it on a row, predicted against measured tokens
    and row seconds. Measured: the engine's split (`StepFeedback.measured_row_seconds`), verify / B plus the
    drafter's seconds over the rows it served; predicted: `LBSSPolicy.row_seconds` with every row
    drafting (a row drafting alone on a padded batch was charged more by the matching)."""
    out = defaultdict(lambda: defaultdict(float))
    for step in trace:
        fb = step.get("feedback")
        if fb is None:
            continue
        B = len(fb["drafters"])
        served = defaultdict(int)
        for ds in fb["drafters"]:
            for d in ds:
                served[d] += 1
        for b, (ds, row) in enumerate(zip(fb["drafters"], step["rows"])):
            names = list(row["estimates"])
            if len(ds) > 1:
                continue
            if ds:
                est = row["estimates"][names[ds[0]]]
                name, tokens, seconds = names[ds[0]], est["tokens"], est["seconds"] or 0.0
                measured = fb["verify_seconds"] / B + fb["draft_seconds"][ds[0]] / served[ds[0]]
            else:
                name, tokens, seconds = "plain", 1.0, (step["plain_seconds"] or 0.0) / B
                measured = fb["verify_seconds"] / B
            c = out[name]
            c["steps"] += 1
            c["predicted_tokens"] += tokens
            c["tokens"] += fb["accepted"][b] + 1
            c["predicted_seconds"] += seconds
            c["seconds"] += measured
    return {name: dict(c) for name, c in out.items()}


def markdown(env: dict, batches: list[dict], calib: dict) -> str:
    lines = [
        f"LBSS trace: batch size {env['batch_size']}, {env['max_new_tokens']} new tokens, "
        f"warm-up {env['policy_warmup']} question(s) per task; "
        f"{env['machine']}, torch {env['torch']}, transformers {env['transformers']}, hf_spin {env['hf_spin']}",
        "",
        "| batch | tasks | plain s | LBSS s | speed-up | drafters chosen (row-steps) |",
        "|---|---|---|---|---|---|",
    ]
    for i, b in enumerate(batches):
        chosen = ", ".join(f"{k} {v}" for k, v in sorted(b["chosen"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {i} | {', '.join(b['tasks'])} | {b['plain_seconds']:.1f} | {b['lbss_seconds']:.1f} "
            f"| {b['plain_seconds'] / b['lbss_seconds']:.2f}x | {chosen} |"
        )
    lines += [
        "",
        "| chosen | steps | predicted tokens | measured tokens | predicted row s | measured row s "
        "| predicted goodput | measured goodput |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in sorted(calib.items(), key=lambda kv: -kv[1]["steps"]):
        n = c["steps"]
        pg = c["predicted_tokens"] / c["predicted_seconds"] if c["predicted_seconds"] else float("nan")
        lines.append(
            f"| {name} | {n:.0f} | {c['predicted_tokens'] / n:.2f} | {c['tokens'] / n:.2f} "
            f"| {c['predicted_seconds'] / n:.3f} | {c['seconds'] / n:.3f} | {pg:.2f} "
            f"| {c['tokens'] / c['seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    args.policies = ["lbss"]  # the pool it makes is replaced by the traced one
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    policy = TracedLBSS(make_draft_length(int(args.draft_length) if args.draft_length.isdigit() else args.draft_length))
    pool = hf_spin.AssistantPool(list(bench.entries.values()), policy=policy, tokenizer=bench.tok, cache=args.cache)
    bench.pools = {"policy:lbss": pool}
    bs = args.batch_sizes[0]
    questions, held_out = workload(args)
    bench.warm_up(questions[0])
    for i in tqdm(range(0, len(held_out), bs), desc="policy warm-up", disable=not held_out):
        bench.learn(held_out[i : i + bs])
    policy.trace.clear()
    batches = []
    for i in tqdm(range(0, len(questions), bs), desc=f"batch {bs}"):
        first = len(policy.trace)
        records = bench.run(questions[i : i + bs])
        chosen = defaultdict(int)
        for r in records:
            for name, n in r["methods"]["policy:lbss"]["chosen"].items():
                chosen[name] += n
        batches.append(
            {
                "tasks": [r["task"] for r in records],
                "plain_seconds": records[0]["methods"]["plain"]["seconds"],
                "lbss_seconds": records[0]["methods"]["policy:lbss"]["seconds"],
                "chosen": dict(chosen),
                "steps": [first, len(policy.trace)],
            }
        )
    env = {
        **machine(),
        "batch_size": bs,
        "max_new_tokens": args.max_new_tokens,
        "policy_warmup": args.policy_warmup,
        "per_task": args.per_task,
    }
    calib = calibration(policy.trace)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lbss_trace-steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in policy.trace))
    md = write_results(
        args.out, "lbss_trace", {"env": env, "batches": batches, "calibration": calib}, markdown(env, batches, calib)
    )
    print(md.read_text())
    print(f"written: {md}")


if __name__ == "__main__":
    main()
