r"""Selection policies replayed on recorded drafts: the pool benchmark's batch-1 comparison with no
models and no timing noise, in seconds instead of the 20 minutes of a `pool_bench.py` run whose
policy ratios move by +-5% from run to run.

    # records (models), then replays:
    python -m benchmarks.research.policy_replay --per-task 3 --max-new-tokens 32 \
        --out benchmarks/results/replay
    python -m benchmarks.research.policy_replay --drafts benchmarks/results/replay/drafts.json \
        --lbss "" "optimism=0.5" --seeds 0 1 2

Greedy decoding commits the target's greedy tokens whatever it verifies, so what a drafter proposes
at a position depends only on the committed prefix there. Recorded once per drafter and position
(the drafter's own `draft` on that prefix with k = --draft-length and the default confidence stop),
it answers every policy's "what would d have proposed here"; a shorter k takes a prefix of it.
The seconds come from fits measured in the same recording: target forwards verifying 1..k+1 tokens
after each prompt, each drafter's draft calls (seconds per forward, per token caught up).
The replay drives the simulated engine of the policy tests (tests/sim.py: plan -> proposals ->
verify -> commit -> catch-up -> feedback), with seeded log-normal noise on the costs, over the
questions in the benchmark's order (its warm-up question first, then `--policy-warmup` held-out
ones, unrecorded), and reports them with the benchmark's own tables (`pool_bench.summarize`).

Batches (`--batch-sizes 4`): the bench's batches of that size (its order and chunks) replayed as
one simulated batch each, rows leaving as they finish, with that batch's own costs, recorded into
the same drafts.json the first time they are asked for: plain batched `generate`, the prefill and
the verify forwards of 1..k+1 tokens per row (padded, as the rectangular cache verifies), and each
drafter's seconds per draft forward on all the batch's rows (fitted with the batch-1 forwards as a
per-forward part and a per-row part). Every row's drafts and truth are its batch-1 recording's.

Left out: bf16 rounding (a real verify can commit another token; every replayed output is
identical, and a padded batch rounds differently from one row), the engine's own per-step seconds,
and the cap of a draft by the row's room.
"""

from __future__ import annotations

import ast
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

import hf_spin
from benchmarks.common import encode, machine, timed, write_results
from benchmarks.pool_bench import WARM_UP_TOKENS, Bench, markdown, parser, summarize, workload
from hf_spin.cache import CACHE_ARG
from hf_spin.drafters.base import DraftRequest
from hf_spin.policies import LBSSConfig, make_draft_length, make_policy
from hf_spin.policies.base import DEFAULT_MIN_CONFIDENCE
from tests.sim import SimDrafter, Simulator, SimVerify  # the policy tests' engine (run from the repository root)

POWERS = [p / 20 for p in range(4, 21)]  # exponents tried in the verify fit, 0.2..1.0
VERIFY_REPEATS = 3  # timed verify forwards per recorded request (or batch) and token count
DRAFT_CALLS = 8  # timed draft calls per drafter and recorded batch (after the one that feeds the prompts)


# --- recording (models) ----------------------------------------------------------------------------


@torch.no_grad()
def verify_seconds(target, batch: dict, continuations: list[list[int]], most: int) -> tuple[float, list[list[float]]]:
    """Seconds of the prompts' forward (B left-padded rows, as `generate` prefills: last logits
    only), and of forwards verifying 1..most tokens of each row's continuation after it: [[n, s], ...],
    VERIFY_REPEATS points per n. Every sample is kept: the fit then follows their mean, what a run's
    sum of steps pays (the faster of two, kept until 2026-11-25, sat ~5% under it on this CPU)."""
    (out, prefill) = timed(lambda: target(**batch, use_cache=True, logits_to_keep=1))
    cache, points = getattr(out, CACHE_ARG), []
    B = len(continuations)
    for n in range(1, most + 1):
        ids = torch.tensor([(c + [c[-1]] * n)[:n] for c in continuations])  # [B, n]
        mask = torch.cat([batch["attention_mask"], torch.ones(B, n, dtype=torch.long)], dim=1)  # [B, P + n]
        for _ in range(VERIFY_REPEATS):
            points.append(
                [n, timed(lambda: target(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_ARG: cache}))[1]]
            )
            cache.crop(-n)
    return prefill, points


def record(args) -> dict:
    """Per question: the target's greedy tokens and every drafter's draft at every position, timed."""
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    pool = hf_spin.AssistantPool(list(bench.entries.values()), tokenizer=bench.tok)
    K = int(args.draft_length)
    questions, held_out = workload(args)
    requests = []
    for q in tqdm(held_out + questions, desc="recording"):
        batch = encode(bench.tok, [q])
        ids = batch["input_ids"][0].tolist()
        gen, plain = timed(
            lambda: bench.target.generate(
                **batch, max_new_tokens=args.max_new_tokens + K, do_sample=False, pad_token_id=bench.tok.pad_token_id
            )
        )
        out = gen[0, len(ids) :].tolist()
        prefill, verify = verify_seconds(bench.target, batch, [out], K + 1)
        positions = min(args.max_new_tokens, len(out))
        drafts, calls, matches = {}, {}, {}
        for name, drafter in zip(pool.names, pool.drafters):
            drafter.start(bench.target, [ids])
            drafts[name], calls[name], matches[name] = [[]], [], [None]
            for g in range(1, positions):
                request = DraftRequest([0], [ids + out[:g]], [K], False, None, DEFAULT_MIN_CONFIDENCE)
                draft, seconds = timed(lambda: drafter.draft(request))
                drafts[name].append(draft.tokens[0])
                matches[name].append(draft.match_lengths[0] if draft.match_lengths else None)
                calls[name].append(seconds)
        requests.append(
            {
                "question_id": q["question_id"],
                "task": q["group"],
                "held_out": q in held_out,
                "prompt_length": len(ids),
                "plain_seconds": plain,
                "prefill_seconds": prefill,
                "verify": verify,
                "out": out,
                "positions": positions,
                "drafts": drafts,
                "draft_seconds": calls,
                "match_lengths": matches,
            }
        )
    infos = [{"name": i.name, "kind": i.kind, "num_parameters": i.num_parameters} for i in pool.infos]
    return {
        "env": {**machine(), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "draft_length": K},
        "drafters": infos,
        "requests": requests,
    }


def chunks(args, bs: int) -> list[tuple[list[dict], bool]]:
    """The bench's batches of size bs in its order: (questions, held out), the held-out ones first."""
    questions, held_out = workload(args)
    learn = [(held_out[i : i + bs], True) for i in range(0, len(held_out), bs)]
    return learn + [(questions[i : i + bs], False) for i in range(0, len(questions), bs)]


@torch.no_grad()
def record_batch(bench, pool, questions: list[dict], outs: list[list[int]], K: int, max_new_tokens: int) -> dict:
    """One batch's costs (B left-padded rows): plain `generate`, the prefill, verify forwards of
    1..K+1 tokens per row, and each drafter's seconds per draft forward on all B rows."""
    batch = encode(bench.tok, questions)
    B = len(questions)
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": bench.tok.pad_token_id}
    plain = min(timed(lambda: bench.target.generate(**batch, **gen))[1] for _ in range(2))
    prefill, verify = verify_seconds(bench.target, batch, outs, K + 1)
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    per_forward = {}
    for name, drafter in zip(pool.names, pool.drafters):
        drafter.start(bench.target, prompts)
        calls = []
        for g in range(1, DRAFT_CALLS + 2):  # the first call feeds the prompts: left out
            request = DraftRequest(
                list(range(B)), [p + o[:g] for p, o in zip(prompts, outs)], [K] * B, False, None, DEFAULT_MIN_CONFIDENCE
            )
            draft, seconds = timed(lambda: drafter.draft(request))
            calls.append(seconds / max(1, max(map(len, draft.tokens))))
        per_forward[name] = statistics.median(calls[1:])
    return {
        "question_ids": [q["question_id"] for q in questions],
        "plain_seconds": plain,
        "prefill_seconds": prefill,
        "verify": verify,
        "draft_forward_seconds": per_forward,
    }


def record_batches(args, rec: dict, bs: int) -> list[dict]:
    """The costs of the bench's batches of size bs (its order), measured (models) for those the
    recording lacks and kept in it."""
    wanted = chunks(args, bs)
    stored = rec.setdefault("batches", [])
    have = {tuple(c["question_ids"]): c for c in stored}
    todo = [(qs, held_out) for qs, held_out in wanted if tuple(q["question_id"] for q in qs) not in have]
    if todo:
        outs = {r["question_id"]: r["out"] for r in rec["requests"]}
        missing = [q["question_id"] for qs, _ in todo for q in qs if q["question_id"] not in outs]
        if missing:
            raise SystemExit(
                f"questions {missing} are not in the recording {args.drafts}: record with a larger --per-task"
            )
        torch.set_num_threads(args.threads)
        bench = Bench(args)
        pool = hf_spin.AssistantPool(list(bench.entries.values()), tokenizer=bench.tok)
        for qs, _ in tqdm(todo, desc=f"recording batch {bs} costs"):
            c = record_batch(
                bench,
                pool,
                qs,
                [outs[q["question_id"]] for q in qs],
                rec["env"]["draft_length"],
                rec["env"]["max_new_tokens"],
            )
            stored.append(c)
            have[tuple(c["question_ids"])] = c
        args.drafts.write_text(json.dumps(rec))
    return [{**have[tuple(q["question_id"] for q in qs)], "held_out": held_out} for qs, held_out in wanted]


# --- cost fits -------------------------------------------------------------------------------------


def fit_verify(points: list[tuple[int, float]]) -> SimVerify:
    """base + per_token x n^power over (tokens verified, seconds) points, least squares (power on a grid)."""
    best = None
    for power in POWERS:
        xs = [n**power for n, _ in points]
        mx, my = statistics.mean(xs), statistics.mean(s for _, s in points)
        slope = sum((x - mx) * (s - my) for x, (_, s) in zip(xs, points)) / sum((x - mx) ** 2 for x in xs)
        base = my - slope * mx
        err = sum((base + slope * x - s) ** 2 for x, (_, s) in zip(xs, points))
        if best is None or err < best[0]:
            best = (err, SimVerify(base, slope, power))
    return best[1]


def sustain(verify: SimVerify, plain_steps: list[tuple[float, int]]) -> SimVerify:
    """`verify` with its `sustained` factor: what a step of plain `generate` took (plain_steps: its
    seconds per step and the tokens each step verified, B) over the fit's forward of those tokens
    (at least 1). The fit's points are forwards timed right after the prefill; the engine's steps
    without a draft model (plain, prompt lookup) are target forwards back to back, as plain
    `generate`'s are, and cost what its steps do. On six set-A requests run alone through the
    engine, twice each, lookup's verify forwards took 1.19x the fit's seconds and SmolLM2's,
    between its drafts, 1.08x (tokens and steps as replayed, exactly); with the fit at 1x for both
    the replay put lookup at 0.93-0.95 of SmolLM2 on those requests, the real runs at 0.86, and
    with this factor at 0.855 (RESULTS.md at 1f8575a, nineteenth measurement)."""
    ratio = sum(s for s, _ in plain_steps) / sum(verify.seconds(n) for _, n in plain_steps)
    return replace(verify, sustained=max(1.0, ratio))


def fit_drafter(info: dict, requests: list[dict]) -> SimDrafter:
    """Seconds per forward: the median over draft calls after the first of seconds / forwards (one
    per token drafted, at least one); seconds per token caught up: what each request's first call
    (the prompt fed) took beyond its forwards, over the tokens fed."""
    name = info["name"]
    per_forward = statistics.median(
        s / max(1, len(d)) for r in requests for d, s in zip(r["drafts"][name][2:], r["draft_seconds"][name][1:])
    )
    extra = sum(
        max(0.0, r["draft_seconds"][name][0] - per_forward * max(1, len(r["drafts"][name][1]))) for r in requests
    )
    fed = sum(r["prompt_length"] + 1 for r in requests)
    return SimDrafter(
        name,
        {},
        forward_seconds=per_forward,
        catch_up_seconds=extra / fed,
        kind=info["kind"],
        num_parameters=info["num_parameters"],
    )


def batch_drafter(d: SimDrafter, forward_seconds: float, rows: int) -> SimDrafter:
    """d's per-forward seconds split into a part paid once per forward and a part per row served,
    from its forward on one row (d.forward_seconds) and on `rows` rows (forward_seconds)."""
    per_row = max(0.0, (forward_seconds - d.forward_seconds) / (rows - 1))
    return SimDrafter(
        d.name,
        {},
        token_seconds=per_row,
        forward_seconds=max(0.0, d.forward_seconds - per_row),
        catch_up_seconds=d.catch_up_seconds,
        kind=d.kind,
        num_parameters=d.num_parameters,
    )


def plain_step(request: dict) -> float:
    """Seconds per step of the request's recorded plain `generate` (its prefill left out)."""
    return (request["plain_seconds"] - request["prefill_seconds"]) / max(1, len(request["out"]) - 1)


def plain_seconds(request: dict) -> float:
    """Plain `generate` on the request's positions, at the rate its recording measured (back-to-back
    forwards and HF's decoding loop: above the paired forwards that `fit_verify` times, see `sustain`)."""
    return request["prefill_seconds"] + (request["positions"] - 1) * plain_step(request)


# --- replay ----------------------------------------------------------------------------------------


class Replay(Simulator):
    """The simulated engine on recorded requests, one row each: a row's truth is the target's greedy
    tokens, a drafter's proposal at a position its recorded draft there."""

    def __init__(self, run: "Run", names: list[str], noise: float, seed: int, first_id: int):
        requests = run.requests
        super().__init__(
            [run.drafters[n] for n in names],
            [r["task"] for r in requests],
            run.verify,
            prompt_lengths=[r["prompt_length"] + 1 for r in requests],  # the prefill's forward commits the first token
            noise=noise,
            seed=seed,
            max_new_tokens=[p - 1 for p in run.positions],
            padded=len(requests) > 1,
        )
        self.row_ids = list(range(first_id, first_id + len(requests)))
        self.next_id, self.requests = self.row_ids[-1] + 1, dict(zip(self.row_ids, requests))

    def _truth(self, b: int, position: int) -> int:
        request = self.requests[self.row_ids[b]]
        i = position - request["prompt_length"]
        return request["out"][i] if i < len(request["out"]) else -1

    def _propose(self, b: int, d: int, k: int) -> tuple[list[int], int | None]:
        request = self.requests[self.row_ids[b]]
        name = self.drafters[d].name
        drafts = request["drafts"][name]
        matches = request.get("match_lengths", {}).get(name)  # recordings before 2026-11-25 have none
        g = self.lengths[b] - request["prompt_length"]
        if g >= len(drafts):
            return [], None
        return drafts[g][:k], matches[g] if matches else None


@dataclass
class Run:
    """One `generate` call of the bench: its rows and what they cost."""

    requests: list[dict]
    positions: list[int]  # tokens each row generates
    kept: bool  # measured (False: the warm-up or a held-out batch)
    verify: SimVerify
    drafters: dict[str, SimDrafter]  # name -> costs at this batch
    prefill_seconds: float
    plain_seconds: float


def runs(rec: dict, verify: SimVerify, drafters: list[SimDrafter], bs: int, batches: list[dict]) -> list[Run]:
    """The bench's calls in its order: the warm-up (the first measured question, WARM_UP_TOKENS
    tokens, batch 1), then the held-out batches, then the measured ones (batches: their costs at bs;
    at batch 1 every request alone)."""
    by_id = {r["question_id"]: r for r in rec["requests"]}
    alone = {d.name: d for d in drafters}
    if bs == 1:
        batches = [{"question_ids": [r["question_id"]], "held_out": r["held_out"]} for r in rec["requests"]]
        batches.sort(key=lambda c: not c["held_out"])
    out = []
    first = next(by_id[c["question_ids"][0]] for c in batches if not c["held_out"])
    out.append(Run([first], [WARM_UP_TOKENS], False, verify, alone, first["prefill_seconds"], 0.0))
    for c in batches:
        requests = [by_id[i] for i in c["question_ids"]]
        positions = [r["positions"] for r in requests]
        if len(requests) == 1:
            out.append(
                Run(
                    requests,
                    positions,
                    not c["held_out"],
                    verify,
                    alone,
                    requests[0]["prefill_seconds"],
                    plain_seconds(requests[0]),
                )
            )
            continue
        B = len(requests)
        fitted = {d.name: batch_drafter(d, c["draft_forward_seconds"][d.name], B) for d in drafters}
        steps = max(max(positions) - 1, 1)  # plain batched `generate`'s steps after its prefill
        padded = sustain(
            fit_verify([(B * n, s) for n, s in c["verify"]]), [((c["plain_seconds"] - c["prefill_seconds"]) / steps, B)]
        )
        out.append(
            Run(requests, positions, not c["held_out"], padded, fitted, c["prefill_seconds"], c["plain_seconds"])
        )
    return out


def replay(calls: list[Run], names: list[str], policy, noise: float, seed: int) -> list[dict]:
    """One method (the drafters `names`, `policy`) over the bench's calls: a record per measured row."""
    policy.bind([calls[0].drafters[n].info() for n in names])
    records, first_id = [], 0
    for i, run in enumerate(calls):
        sim = Replay(run, names, noise, seed * 10_000 + i, first_id)
        rows = sim.row_ids
        first_id += len(rows)
        policy.start_rows(sim.view(), list(range(len(rows))))
        sim.run(policy, 10 * max(run.positions))
        if run.kept:
            records += row_records(sim.trace.feedback, rows, names, run.prefill_seconds)
    return records


def row_records(steps, rows: list[int], names: list[str], prefill: float) -> list[dict]:
    """Per row of a replayed call: the call's seconds, the row's own (to its last token), its choices and counts."""
    ends = [
        prefill + sum(fb.verify_seconds + sum(fb.draft_seconds) for fb in steps[: i + 1]) for i in range(len(steps))
    ]
    records = []
    for rid in rows:
        mine = [(i, fb, fb.row_ids.index(rid)) for i, fb in enumerate(steps) if rid in fb.row_ids]
        chosen: dict[str, int] = {}
        for _, fb, b in mine:
            for d in fb.plan.drafters[b]:
                chosen[names[d]] = chosen.get(names[d], 0) + 1
        records.append(
            {
                "seconds": ends[-1] if ends else prefill,
                "row_seconds": ends[mine[-1][0]] if mine else prefill,
                "identical": True,
                "chosen": chosen,
                "target_forwards": len(mine) + 1,
                "drafted": sum(fb.drafted[b] for _, fb, b in mine),
                "accepted": sum(fb.accepted[b] for _, fb, b in mine),
            }
        )
    return records


def lbss_config(spec: str, seed: int) -> LBSSConfig:
    """ "optimism=0.5,settle=2" -> LBSSConfig(optimism=0.5, settle=2, seed=seed) ("": the defaults)."""
    pairs = [kv.split("=", 1) for kv in spec.split(",") if kv.strip()]
    return LBSSConfig(**{"seed": seed, **{k.strip(): ast.literal_eval(v.strip()) for k, v in pairs}})


def methods(drafters: list[SimDrafter], k: int, args) -> dict:
    """label -> (drafter names, seed -> policy), labelled as pool_bench.py labels them."""
    names = [d.name for d in drafters]
    out = {f"spin:{n}": ([n], lambda seed: make_policy("fixed", k)) for n in names}
    for name in args.policies:
        out[f"policy:{name}"] = (names, lambda seed, name=name: make_policy(name, k))
    for spec in args.lbss:
        out[f"policy:lbss[{spec}]" if spec else "policy:lbss"] = (
            names,
            lambda seed, spec=spec: make_policy(lbss_config(spec, seed), make_draft_length(k)),
        )
    return out


def spread(per_seed: dict[int, dict[int, dict[str, float]]], labels: list[str]) -> str:
    """Each method's Spec-Bench speed-up (ALL) per seed, with their mean and sd, per batch size."""
    seeds = list(per_seed)
    lines = []
    for bs in per_seed[seeds[0]]:
        lines += [
            "",
            f"### batch {bs}: ALL speed-up per seed",
            "",
            "| method | mean | sd | " + " | ".join(map(str, seeds)) + " |",
            "|---" * (len(seeds) + 3) + "|",
        ]
        for m in labels:
            xs = [per_seed[s][bs][m] for s in seeds]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            lines.append(f"| {m} | {statistics.mean(xs):.3f} | {sd:.3f} | " + " | ".join(f"{x:.3f}" for x in xs) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument(
        "--drafts",
        type=Path,
        default=None,
        help="a recording (drafts.json) to replay; without it the models record one into --out",
    )
    ap.add_argument(
        "--lbss",
        nargs="*",
        default=[""],
        help='LBSSConfig settings per LBSS variant, e.g. "" "optimism=0.5,settle=2" ("": the defaults)',
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="cost-noise (and policy) seeds; records of every seed are pooled",
    )
    ap.add_argument("--noise", type=float, default=0.05, help="sd of the log-normal noise on every replayed cost")
    ap.set_defaults(batch_sizes=[1])
    args = ap.parse_args()
    args.policies = [
        p for p in (args.policies or ["epsilon_greedy", "round_robin"]) if p != "lbss"
    ]  # LBSS runs as --lbss variants
    if args.drafts is None:
        rec = record(args)
        args.out.mkdir(parents=True, exist_ok=True)
        args.drafts = args.out / "drafts.json"
        args.drafts.write_text(json.dumps(rec))
        print(f"recorded: {args.drafts}")
    rec = json.loads(args.drafts.read_text())
    verify = sustain(
        fit_verify([(n, s) for r in rec["requests"] for n, s in r["verify"]]),
        [(plain_step(r), 1) for r in rec["requests"]],
    )
    drafters = [fit_drafter(info, rec["requests"]) for info in rec["drafters"]]
    calls = {
        bs: runs(rec, verify, drafters, bs, record_batches(args, rec, bs) if bs > 1 else []) for bs in args.batch_sizes
    }
    table = methods(drafters, rec["env"]["draft_length"], args)
    records, per_seed = [], {}
    for seed in args.seeds:
        seed_records = []
        for bs, bench_calls in calls.items():
            measured = [
                {
                    "question_id": r["question_id"],
                    "task": r["task"],
                    "batch_size": len(run.requests),
                    "requested_batch_size": bs,
                    "new_tokens": p,
                    "methods": {"plain": {"seconds": run.plain_seconds, "identical": True}},
                }
                for run in bench_calls
                if run.kept
                for r, p in zip(run.requests, run.positions)
            ]
            for label, (names, make) in tqdm(table.items(), desc=f"seed {seed}, batch {bs}"):
                for r, m in zip(measured, replay(bench_calls, names, make(seed), args.noise, seed)):
                    r["methods"][label] = m
            seed_records += measured
        per_seed[seed] = {
            bs: {m: v["speedup"] for m, v in t["ALL"].items() if isinstance(v, dict) and "speedup" in v}
            for bs, t in summarize(seed_records).items()
        }
        records += seed_records
    tasks = {r["task"] for r in rec["requests"]}
    env = {
        **rec["env"],
        "cache": "rectangular",
        "policy_warmup": sum(r["held_out"] for r in rec["requests"]) // len(tasks),
    }
    costs = (
        f"verify ({verify.base:.4f} + {verify.per_token:.4f} n^{verify.power:.2f}) s, "
        f"x {verify.sustained:.3f} without a draft model; "
        + "; ".join(
            f"{d.name} {d.forward_seconds * 1e3:.1f} ms/forward, {d.catch_up_seconds * 1e3:.2f} ms/token caught up"
            for d in drafters
        )
    )
    header = (
        f"Replay of {args.drafts} (batch sizes {args.batch_sizes}, seeds {args.seeds}, cost noise {args.noise}); "
        f"batch-1 costs: {costs}.\n\n"
    )
    md = header + markdown(summarize(records), env) + spread(per_seed, list(table))
    path = write_results(
        args.out, "policy_replay", {"env": env, "seeds": args.seeds, "per_seed": per_seed, "records": records}, md
    )
    print(md)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
