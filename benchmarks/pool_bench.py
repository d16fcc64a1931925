"""A heterogeneous pool on Spec-Bench: every policy against every single drafter and the oracle, one run.

    python -m benchmarks.pool_bench --per-task 1 --max-new-tokens 32 --batch-sizes 1 4
    accelerate launch --num_processes 2 -m benchmarks.pool_bench ...   # questions sharded over processes

Target Qwen2.5-Coder-1.5B; pool: Qwen2.5-Coder-0.5B (same tokenizer), SmolLM2-135M and Gemma-3-270M
(token translation), prompt lookup. For each batch of questions, side by side on the same prompts:
plain `generate`; at batch 1 `transformers`' assisted generation with each single drafter (its
defaults; universal assisted generation for the other tokenizers, `prompt_lookup_num_tokens` for
prompt lookup); hf_spin with each single drafter (policy "fixed"); hf_spin with each policy over the
whole pool. Reported per Spec-Bench task and overall: speed-up over plain, acceptance, mean accepted
length, goodput, identical outputs, how often each drafter was chosen, and each method's goodput as
a fraction of the per-request oracle (the best single drafter, or plain decoding, in hindsight).

The pools are made once and keep what they learn across requests, as a server's would. They start
cold: the first requests pay for learning which drafter serves what (`--policy-warmup N` first runs
N held-out questions per task through them, unrecorded, to measure a pool that has served requests).
`--repeats N` times every method N times per batch, alternating their order, each pool from the same
learned state, and reports the median with the runs' spread: one request's time moves by ±5-10% on a
shared CPU, so a single run cannot tell a 0.97x cell from noise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import Counter, defaultdict
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
from hf_spin.policies import POLICIES, make_draft_length
from hf_spin.pool import CACHE_LAYOUTS

TARGET = "qwen2.5-coder-1.5b-instruct"
# label -> packaged model name (None: prompt lookup)
DRAFTERS = {
    "qwen-0.5b": "qwen2.5-coder-0.5b-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "gemma3-270m": "gemma-3-270m",
    "prompt_lookup": None,
}
WARM_UP_TOKENS = 4  # Bench.warm_up: every method on the first question for this many tokens
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens


def parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The flags of this benchmark, shared by the scripts that run its workload (research/lbss_trace.py,
    research/policy_replay.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-task", type=int, default=1, help="questions per Spec-Bench task (6 tasks)")
    ap.add_argument("--limit", type=int, default=None, help="cap on the number of questions")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--policies", nargs="+", default=None, help=f"default: every registered policy but 'fixed' ({sorted(POLICIES)})"
    )
    ap.add_argument("--draft-length", default="5", help="an int or a DraftLength name, for every hf_spin run")
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument(
        "--singles",
        nargs="*",
        default=None,
        choices=list(DRAFTERS),
        help="drafters run alone too (hf_spin's default pool of one, and transformers' assisted generation); "
        "default: every --drafters",
    )
    ap.add_argument(
        "--summarize", type=Path, default=None, help="only rebuild the tables from a partial .jsonl (no models loaded)"
    )
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a partial .jsonl of an interrupted run: its questions are not run again",
    )
    ap.add_argument(
        "--cache",
        default="rectangular",
        choices=CACHE_LAYOUTS,
        help="hf_spin's KV cache layout (AssistantPool(cache=...)): rectangular, or packed rows",
    )
    ap.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted generation runs")
    ap.add_argument(
        "--policy-warmup",
        type=int,
        default=0,
        help="held-out questions per task (the ones after the measured ones) run through every hf_spin pool at each "
        "batch size before it is measured, not recorded: the learned state of a pool that has served requests "
        "(0: the pools start cold)",
    )
    ap.add_argument(
        "--draft-vocabulary",
        type=int,
        default=None,
        help="model drafters sharing the target's tokenizer score only the N lowest ids (draft_vocabulary=N)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every method on each batch, in alternating order, each pool from the same learned state; "
        "a method's time is the median (odd N gives the middle run)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap


def parse_args() -> argparse.Namespace:
    return parser().parse_args()


class Bench:
    """The models, the pools (made once, as a user would: learned state carries across requests) and the runs."""

    def __init__(self, args):
        dtype = getattr(torch, args.dtype)
        self.args = args
        self.target, self.tok = models.load(TARGET, dtype=dtype)
        self.entries = {}  # label -> pool entry
        self.assist = {}  # label -> kwargs for transformers' assisted generation
        for label in args.drafters:
            name = DRAFTERS[label]
            if name is None:
                self.entries[label] = "prompt_lookup"
                self.assist[label] = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
                continue
            model, tok = models.load(name, dtype=dtype)
            same = tok.get_vocab() == self.tok.get_vocab()
            # named drafter objects: the statistics say "qwen-0.5b", not a cache path
            self.entries[label] = (
                hf_spin.ModelDrafter(model, name=label, draft_vocabulary=args.draft_vocabulary)
                if same
                else hf_spin.TranslatingDrafter(model, tok, self.tok, name=label)
            )
            self.assist[label] = (
                {"assistant_model": model}
                if same
                else {"assistant_model": model, "tokenizer": self.tok, "assistant_tokenizer": tok}
            )
        draft_length = int(args.draft_length) if args.draft_length.isdigit() else args.draft_length
        policies = args.policies or sorted(p for p in POLICIES if p != "fixed")
        options = dict(tokenizer=self.tok, cache=args.cache)
        singles = args.drafters if args.singles is None else args.singles
        self.assist = {label: kwargs for label, kwargs in self.assist.items() if label in singles}
        self.pools = {
            f"spin:{label}": hf_spin.AssistantPool([entry], draft_length=make_draft_length(draft_length), **options)
            for label, entry in self.entries.items()
            if label in singles
        }
        for policy in policies:
            self.pools[f"policy:{policy}"] = hf_spin.AssistantPool(
                list(self.entries.values()), policy=policy, draft_length=make_draft_length(draft_length), **options
            )
        self.gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id)

    def spin(self, batch: dict, pool: hf_spin.AssistantPool):
        """hf_spin's `generate` on `batch` with `pool`."""
        return self.target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, **self.gen)

    def warm_up(self, question: dict) -> None:
        """Every method on one question for WARM_UP_TOKENS tokens: one-off allocation costs would bias whichever
        method runs first (the pools learn from it too)."""
        self.gen, full = {**self.gen, "max_new_tokens": WARM_UP_TOKENS}, self.gen
        self.run([question])
        self.gen = full

    def learn(self, questions: list[dict]) -> None:
        """Runs `questions` through every hf_spin pool, unrecorded: what a pool learns from serving them."""
        batch = encode(self.tok, questions)
        for pool in self.pools.values():
            self.spin(batch, pool)

    def methods(self, batch: dict) -> dict:
        """method -> a thunk generating `batch` with it: plain `generate`, at batch 1 `transformers`' assisted
        generation with each single drafter, and every hf_spin pool."""
        thunks = {"plain": lambda: self.target.generate(**batch, **self.gen)}
        if batch["input_ids"].shape[0] == 1 and not self.args.no_assisted:
            for label, kwargs in self.assist.items():
                thunks[f"assisted:{label}"] = lambda kwargs=kwargs: self.target.generate(**batch, **kwargs, **self.gen)
        for method, pool in self.pools.items():
            thunks[method] = lambda pool=pool: self.spin(batch, pool)
        return thunks

    def run(self, questions: list[dict], repeats: int = 1) -> list[dict]:
        """One record per question of this batch: each method's time, identity, and per-row stats.

        With `repeats` > 1 every method runs that many times, in the listed order and reversed by turns (a
        drift of the machine falls on every method alike), each hf_spin pool from the learned state it had
        before the batch (`AssistantPool.snapshot`): a method's time is its runs' median, its counts that run's."""
        batch = encode(self.tok, questions)
        P = batch["input_ids"].shape[1]
        pad = self.tok.pad_token_id
        thunks = self.methods(batch)
        learned = {m: pool.snapshot() for m, pool in self.pools.items()}
        runs = {m: [] for m in thunks}  # method -> [(seconds, new tokens per row, that call's stats)] per repeat
        for repeat in range(repeats):
            for method in list(thunks)[:: 1 if repeat % 2 == 0 else -1]:
                if method in self.pools:
                    self.pools[method].restore(learned[method])
                try:  # a baseline that crashes is recorded as such, not allowed to end the run
                    out, t = timed(thunks[method])
                except Exception as err:  # noqa: BLE001
                    if method in self.pools or method == "plain":
                        raise
                    runs[method] = repr(err)[:300]
                    del thunks[method]
                    continue
                stats = self.pools[method].last_stats if method in self.pools else None
                runs[method].append((t, new_tokens(out, P, pad), stats))
        ref = runs["plain"][0][1]
        records = [
            {
                "question_id": q["question_id"],
                "task": q["group"],
                "batch_size": len(questions),
                "new_tokens": len(r),
                "methods": {},
            }
            for q, r in zip(questions, ref)
        ]
        for method, measured in runs.items():
            if isinstance(measured, str):
                records[0]["methods"][method] = {"error": measured}
                continue
            seconds = [t for t, _, _ in measured]
            t, _, stats = sorted(measured, key=lambda m: m[0])[(len(measured) - 1) // 2]  # the median run
            for i, record in enumerate(records):
                entry = {
                    "seconds": t,
                    "runs": seconds,
                    "identical": all(out[i] == ref[i] for _, out, _ in measured),
                }
                if stats is not None:
                    row = stats.rows[i]
                    entry |= {
                        "row_seconds": row.wall_seconds,
                        "drafted": row.drafted,
                        "accepted": row.accepted,
                        "target_forwards": row.target_forwards,
                        "chosen": dict(row.drafters),
                        "failures": {name: d.failures for name, d in stats.drafters.items() if d.failures},
                    }
                record["methods"][method] = entry
        return records


def speed(r: dict, method: str) -> float:
    """Tokens per second of a request under a method (the whole call's time: rows of a batch share it)."""
    return r["new_tokens"] / r["methods"][method]["seconds"]


def spread(entries: list[dict]) -> float | None:
    """Repeated runs' spread, (slowest - fastest) / median, averaged over requests: the noise band of a
    method's times (None: one run each)."""
    bands = [(max(e["runs"]) - min(e["runs"])) / e["seconds"] for e in entries if len(e.get("runs", [])) > 1]
    return statistics.mean(bands) if bands else None


def speedup_interval(group: list[dict], method: str, level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """The `level` interval of a group's speed-up (`summarize`'s: mean speed / mean plain speed, each
    request's time the median of its runs) by the bootstrap: requests drawn with replacement, each
    request's runs drawn with replacement for every method, the median taken again. What one run's
    group ratio cannot say on its own: whether a 0.96 is below 0.97 or inside the machine's noise."""
    rng = random.Random(0)

    def median_speed(r: dict, m: str) -> float:
        runs = r["methods"][m].get("runs") or [r["methods"][m]["seconds"]]
        return r["new_tokens"] / statistics.median(rng.choices(runs, k=len(runs)))

    ratios = []
    for _ in range(draws):
        sample = rng.choices(group, k=len(group))
        ratios.append(
            statistics.mean(median_speed(r, method) for r in sample)
            / statistics.mean(median_speed(r, "plain") for r in sample)
        )
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * (draws - 1))], ratios[int((1 - tail) * (draws - 1))]


def row_goodput(r: dict, method: str) -> float:
    """Tokens per second until the row's own last token (its goodput within the batch)."""
    m = r["methods"][method]
    return r["new_tokens"] / m.get("row_seconds", m["seconds"])


def oracle_pick(r: dict, singles: list[str]) -> str:
    """The per-request oracle's method: the best of the single drafters and plain decoding, in hindsight."""
    return max(singles + ["plain"], key=lambda m: row_goodput(r, m))


def summarize(records: list[dict]) -> dict:
    """Per batch size, per task and ALL: speed-ups, rates, choices and oracle fractions."""
    out = {}

    def requested(r):  # the last chunk of a run may be smaller than the batch size asked for
        return r.get("requested_batch_size", r["batch_size"])

    for bs in sorted({requested(r) for r in records}):
        rs = [r for r in records if requested(r) == bs]
        methods = list(dict.fromkeys(m for r in rs for m in r["methods"]))
        singles = [m for m in methods if m.startswith("spin:")]
        # oracle: per request, the best of the single drafters and plain decoding, in hindsight
        for r in rs:
            best = oracle_pick(r, singles)
            r["oracle"] = {"method": best, "goodput": row_goodput(r, best)}
        tasks = defaultdict(list)
        for r in rs:
            tasks[r["task"]].append(r)
            tasks["ALL"].append(r)
        table = {}
        for task, group in tasks.items():
            row = {
                "n": len(group),
                "plain_tok_s": statistics.mean(speed(r, "plain") for r in group),
                "oracle_choice": dict(Counter(r["oracle"]["method"] for r in group)),
            }
            for m in methods:
                ran = [r for r in group if "seconds" in r["methods"].get(m, {})]  # a crashed baseline is left out
                if not ran:
                    row[m] = {"errors": len(group)}
                    continue
                plain = statistics.mean(speed(r, "plain") for r in ran)
                oracle = sum(r["oracle"]["goodput"] for r in ran)
                ms = [r["methods"][m] for r in ran]
                drafted = sum(x.get("drafted", 0) for x in ms)
                forwards = sum(x.get("target_forwards", 0) for x in ms)
                chosen = Counter()
                for x in ms:
                    chosen.update(x.get("chosen", {}))
                row[m] = {
                    "errors": len(group) - len(ran),
                    "speedup": statistics.mean(speed(r, m) for r in ran) / plain,
                    "goodput": statistics.mean(row_goodput(r, m) for r in ran),
                    "oracle_fraction": sum(row_goodput(r, m) for r in ran) / oracle,
                    "acceptance_rate": sum(x.get("accepted", 0) for x in ms) / drafted if drafted else None,
                    "mean_accepted_length": sum(r["new_tokens"] for r in group) / forwards if forwards else None,
                    "identical": f"{sum(x['identical'] for x in ms)}/{len(ms)}",
                    "chosen": {k: v / max(sum(chosen.values()), 1) for k, v in chosen.items()},
                    "spread": spread(ms),
                    "interval": speedup_interval(ran, m),
                }
            table[task] = row
        out[bs] = table
    return out


def markdown(summary: dict, env: dict) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"Spec-Bench pool benchmark: greedy, {env['dtype']}, {env['max_new_tokens']} new tokens, "
        f"draft_length={env['draft_length']}, cache={env['cache']}, "
        f"pools warmed on {env.get('policy_warmup', 0)} held-out question(s) per task before each batch size; "
        f"{env.get('repeats', 1)} run(s) of each method per batch, alternating, its median timed; "
        f"target {TARGET}; {env['machine']}, {env['processes']} process(es); "
        f"torch {env['torch']}, transformers {env['transformers']}, hf_spin {env['hf_spin']}.",
    ]
    for bs, table in summary.items():
        tasks = sorted((t for t in table if t != "ALL")) + ["ALL"]
        methods = [m for m in table["ALL"] if isinstance(table["ALL"][m], dict) and "errors" in table["ALL"][m]]
        lines += ["", f"### batch {bs}: speed-up over plain `generate` (Spec-Bench: mean speed / mean plain speed)", ""]
        lines += [
            "| method | "
            + " | ".join(tasks)
            + " | acceptance | mean accepted len | goodput tok/s | oracle fraction | identical | run spread | crashed |"
        ]
        lines += ["|---" * (len(tasks) + 8) + "|"]
        for m in methods:
            a = table["ALL"][m]
            if "speedup" not in a:
                lines.append(f"| {m} | " + " | ".join("crashed" for _ in tasks) + f" | | | | | | | {a['errors']} |")
                continue
            speeds = [f"{table[t][m]['speedup']:.2f}" if "speedup" in table[t].get(m, {}) else "crashed" for t in tasks]
            lines.append(
                f"| {m} | "
                + " | ".join(speeds)
                + f" | {fmt(a['acceptance_rate'], '.1%')} | {fmt(a['mean_accepted_length'], '.2f')} "
                f"| {a['goodput']:.2f} | {a['oracle_fraction']:.2f} | {a['identical']} "
                f"| {fmt(a.get('spread'), '.1%')} | {a['errors']} |"
            )
        lines.append(
            "| plain tok/s | " + " | ".join(f"{table[t]['plain_tok_s']:.2f}" for t in tasks) + " | | | | | | | |"
        )
        lines += [
            "",
            f"### batch {bs}: 90% interval of each speed-up (bootstrap over the group's requests and each one's runs)",
            "",
            "| method | " + " | ".join(tasks) + " |",
            "|---" * (len(tasks) + 1) + "|",
        ]
        for m in methods:
            cells = [table[t].get(m, {}).get("interval") for t in tasks]
            lines.append(f"| {m} | " + " | ".join(f"{c[0]:.2f}-{c[1]:.2f}" if c else "-" for c in cells) + " |")
        lines += [
            "",
            f"### batch {bs}: which drafter each policy chose (share of row-steps), and the oracle's choice",
            "",
        ]
        lines += ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for m in [m for m in methods if m.startswith("policy:")]:
            cells = []
            for t in tasks:
                chosen = table[t][m].get("chosen", {})
                cells.append(
                    ", ".join(f"{k.split('/')[-1]} {v:.0%}" for k, v in sorted(chosen.items(), key=lambda kv: -kv[1]))
                    or "plain"
                )
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append(
            "| oracle | "
            + " | ".join(", ".join(f"{k} x{v}" for k, v in table[t]["oracle_choice"].items()) for t in tasks)
            + " |"
        )
    return "\n".join(lines) + "\n"


def report(args, records: list[dict], num_processes: int) -> None:
    env = {
        **machine(num_processes),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "draft_length": args.draft_length,
        "cache": args.cache,
        "draft_vocabulary": args.draft_vocabulary,
        "policy_warmup": args.policy_warmup,
        "repeats": args.repeats,
    }
    summary = summarize(records)
    table = markdown(summary, env)
    path = write_results(args.out, "pool_bench", {"env": env, "summary": summary, "records": records}, table)
    print(table)
    print(f"written: {path}")


def workload(args) -> tuple[list[dict], list[dict]]:
    """The questions measured (`--per-task` per task) and the held-out ones the pools learn from
    first (`--policy-warmup` per task)."""
    measured = load_questions(args.questions, args.per_task, None, group_by="task")
    held_out = [
        q
        for q in load_questions(args.questions, args.per_task + args.policy_warmup, None, group_by="task")
        if q not in measured
    ]
    questions = measured[: args.limit]  # --limit caps the measured ones; the held-out ones stay those after them
    return questions, held_out


def main() -> None:
    args = parse_args()
    if args.summarize:  # the settings flags must match the run's: they are only echoed into the header
        return report(args, [json.loads(line) for line in args.summarize.read_text().splitlines()], 1)
    torch.set_num_threads(args.threads)  # explicit: an oversubscribed CPU collapses ~10x
    state = PartialState()
    bench = Bench(args)
    questions, held_out = workload(args)
    bench.warm_up(questions[0])
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"pool_bench-partial-{state.process_index}.jsonl"
    records = [json.loads(line) for line in args.resume.read_text().splitlines()] if args.resume else []
    done = {(r["question_id"], r.get("requested_batch_size", r["batch_size"])) for r in records}
    if args.resume:
        partial.write_text("".join(json.dumps(r) + "\n" for r in records))
    with state.split_between_processes(questions) as shard:
        for bs in args.batch_sizes:
            todo = [q for q in shard if (q["question_id"], bs) not in done]
            chunks = [todo[i : i + bs] for i in range(0, len(todo), bs)]
            learn = [held_out[i : i + bs] for i in range(0, len(held_out), bs)] if todo else []
            for chunk in tqdm(learn, desc=f"policy warm-up, batch {bs}", disable=not (learn and state.is_main_process)):
                bench.learn(chunk)
            for chunk in tqdm(chunks, desc=f"batch {bs}", disable=not state.is_main_process):
                for record in bench.run(chunk, args.repeats):
                    record["requested_batch_size"] = bs
                    records.append(record)
                    save_partial(partial, record)
    records = gather_object(records)
    if not state.is_main_process:
        return
    report(args, records, state.num_processes)


if __name__ == "__main__":
    main()
