"""Selection policies replayed on recorded drafts: the pool benchmark's batch-1 comparison with no
models and no timing noise, in seconds instead of the 20 minutes of a `pool_bench.py` run whose
policy ratios move by +-5% from run to run.

    python benchmarks/policy_replay.py --per-task 3 --max-new-tokens 32 --out benchmarks/results/replay   # records (models), then replays
    python benchmarks/policy_replay.py --drafts benchmarks/results/replay/drafts.json --lbss "" "optimism=0.5" --seeds 0 1 2

Greedy decoding commits the target's greedy tokens whatever it verifies, so what a drafter proposes
at a position depends only on the committed prefix there. Recorded once per drafter and position
(the drafter's own `draft` on that prefix with k = --draft-length and the default confidence stop),
it answers every policy's "what would d have proposed here"; a shorter k takes a prefix of it.
The seconds come from fits measured in the same recording: target forwards verifying 1..k+1 tokens
after each prompt, each drafter's draft calls (seconds per forward, per token caught up).
The replay drives the simulated engine of the policy tests (tests/sim.py: plan -> proposals ->
verify -> commit -> pre-fill -> feedback), with seeded log-normal noise on the costs, over the
questions in the benchmark's order (its warm-up question first, then `--policy-warmup` held-out
ones, unrecorded), and reports them with the benchmark's own tables (`pool_bench.summarize`).

Left out: bf16 rounding (a real verify can commit another token; every replayed output is
identical), the engine's own per-step seconds, the cap of a draft by the row's room, and batches
(drafters' costs are measured on one row, so the replay is batch 1 only).
"""

from __future__ import annotations

import ast
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import hf_spin
from hf_spin.cache import CACHE_ARG
from hf_spin.drafters.base import DraftRequest
from hf_spin.policies import LBSSConfig, make_draft_length, make_policy
from hf_spin.policies.base import DEFAULT_MIN_CONFIDENCE

from common import encode, machine, timed, write_results
from pool_bench import WARM_UP_TOKENS, Bench, markdown, parser, summarize, workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.sim import SimDrafter, Simulator, SimVerify  # noqa: E402  (the policy tests' engine)

POWERS = [p / 20 for p in range(4, 21)]  # exponents tried in the verify fit, 0.2..1.0


# --- recording (models) ----------------------------------------------------------------------------


@torch.no_grad()
def verify_seconds(target, batch: dict, continuation: list[int], most: int) -> tuple[float, list[list[float]]]:
    """Seconds of the prompt's forward, and of forwards verifying 1..most tokens after it: [[n, s], ...]."""
    (out, prefill) = timed(lambda: target(**batch, use_cache=True))
    cache, points = getattr(out, CACHE_ARG), []
    for n in range(1, most + 1):
        ids = torch.tensor([continuation[:n]])
        times = []
        for _ in range(2):
            times.append(timed(lambda: target(input_ids=ids, use_cache=True, **{CACHE_ARG: cache}))[1])
            cache.crop(-n)
        points.append([n, min(times)])
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
        gen, plain = timed(lambda: bench.target.generate(**batch, max_new_tokens=args.max_new_tokens + K, do_sample=False, pad_token_id=bench.tok.pad_token_id))
        out = gen[0, len(ids):].tolist()
        prefill, verify = verify_seconds(bench.target, batch, out, K + 1)
        positions = min(args.max_new_tokens, len(out))
        drafts, calls = {}, {}
        for name, drafter in zip(pool.names, pool.drafters):
            drafter.start(bench.target, [ids])
            drafts[name], calls[name] = [[]], []
            for g in range(1, positions):
                request = DraftRequest([0], [ids + out[:g]], [K], False, None, DEFAULT_MIN_CONFIDENCE)
                draft, seconds = timed(lambda: drafter.draft(request))
                drafts[name].append(draft.tokens[0])
                calls[name].append(seconds)
        requests.append({
            "question_id": q["question_id"], "task": q["group"], "held_out": q in held_out, "prompt_length": len(ids),
            "plain_seconds": plain, "prefill_seconds": prefill, "verify": verify, "out": out, "positions": positions,
            "drafts": drafts, "draft_seconds": calls,
        })
    infos = [{"name": i.name, "kind": i.kind, "num_parameters": i.num_parameters} for i in pool.infos]
    return {"env": {**machine(), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "draft_length": K}, "drafters": infos, "requests": requests}


# --- cost fits -------------------------------------------------------------------------------------


def fit_verify(requests: list[dict]) -> SimVerify:
    """base + per_token x n^power, least squares over every request's verify points (power on a grid)."""
    points = [(n, s) for r in requests for n, s in r["verify"]]
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


def fit_drafter(info: dict, requests: list[dict]) -> SimDrafter:
    """Seconds per forward: the median over draft calls after the first of seconds / forwards (one
    per token drafted, at least one); seconds per token caught up: what each request's first call
    (the prompt fed) took beyond its forwards, over the tokens fed."""
    name = info["name"]
    per_forward = statistics.median(
        s / max(1, len(d)) for r in requests for d, s in zip(r["drafts"][name][2:], r["draft_seconds"][name][1:])
    )
    extra = sum(max(0.0, r["draft_seconds"][name][0] - per_forward * max(1, len(r["drafts"][name][1]))) for r in requests)
    fed = sum(r["prompt_length"] + 1 for r in requests)
    return SimDrafter(name, {}, forward_seconds=per_forward, catch_up_seconds=extra / fed, kind=info["kind"], num_parameters=info["num_parameters"])


def plain_seconds(request: dict) -> float:
    """Plain `generate` on the request's positions, at the rate its recording measured (HF's decoding
    loop: ~5% above the bare forwards that `fit_verify` times)."""
    per_step = (request["plain_seconds"] - request["prefill_seconds"]) / max(1, len(request["out"]) - 1)
    return request["prefill_seconds"] + (request["positions"] - 1) * per_step


# --- replay ----------------------------------------------------------------------------------------


class Replay(Simulator):
    """The simulated engine on one recorded request (batch 1): the truth is the target's greedy
    tokens, a drafter's proposal at a position its recorded draft there."""

    def __init__(self, drafters: list[SimDrafter], request: dict, verify: SimVerify, noise: float, seed: int, row_id: int, positions: int):
        # the prefill's forward commits the first token: the engine's steps start one token in
        super().__init__(drafters, [request["task"]], verify, prompt_lengths=[request["prompt_length"] + 1], noise=noise, seed=seed, max_new_tokens=[positions - 1])
        self.row_ids, self.next_id, self.request = [row_id], row_id + 1, request

    def _truth(self, b: int, position: int) -> int:
        i = position - self.request["prompt_length"]
        return self.request["out"][i] if i < len(self.request["out"]) else -1

    def _propose(self, b: int, d: int, k: int) -> list[int]:
        drafts = self.request["drafts"][self.drafters[d].name]
        g = self.lengths[b] - self.request["prompt_length"]
        return drafts[g][:k] if g < len(drafts) else []


def replay(rec: dict, drafters: list[SimDrafter], policy, verify: SimVerify, noise: float, seed: int) -> list[dict]:
    """One method over the recorded requests in the benchmark's order: its warm-up (the first
    measured question, WARM_UP_TOKENS tokens), the held-out questions, then the measured ones (a record each)."""
    policy.bind([d.info() for d in drafters])
    measured = [r for r in rec["requests"] if not r["held_out"]]
    held_out = [r for r in rec["requests"] if r["held_out"]]
    runs = [(measured[0], WARM_UP_TOKENS, False)] + [(r, r["positions"], False) for r in held_out] + [(r, r["positions"], True) for r in measured]
    records = []
    for i, (request, positions, kept) in enumerate(runs):
        sim = Replay(drafters, request, verify, noise, seed * 10_000 + i, row_id=i, positions=positions)
        policy.start_rows(sim.view(), [0])
        sim.run(policy, 10 * positions)
        if not kept:
            continue
        steps = sim.trace.feedback
        chosen: dict[str, int] = {}
        for fb in steps:
            for d in fb.plan.drafters[0]:
                chosen[drafters[d].name] = chosen.get(drafters[d].name, 0) + 1
        seconds = request["prefill_seconds"] + sum(fb.verify_seconds + sum(fb.draft_seconds) for fb in steps)
        records.append({
            "seconds": seconds, "row_seconds": seconds, "identical": True, "chosen": chosen, "target_forwards": len(steps) + 1,
            "drafted": sum(fb.drafted[0] for fb in steps), "accepted": sum(fb.accepted[0] for fb in steps),
        })
    return records


def lbss_config(spec: str, seed: int) -> LBSSConfig:
    """"optimism=0.5,settle=2" -> LBSSConfig(optimism=0.5, settle=2, seed=seed) ("": the defaults)."""
    pairs = [kv.split("=", 1) for kv in spec.split(",") if kv.strip()]
    return LBSSConfig(**{"seed": seed, **{k.strip(): ast.literal_eval(v.strip()) for k, v in pairs}})


def methods(drafters: list[SimDrafter], k: int, args) -> dict:
    """label -> (drafters, seed -> policy), labelled as pool_bench.py labels them."""
    out = {f"spin:{d.name}": ([d], lambda seed: make_policy("fixed", k)) for d in drafters}
    for name in args.policies:
        out[f"policy:{name}"] = (drafters, lambda seed, name=name: make_policy(name, k))
    for spec in args.lbss:
        out[f"policy:lbss[{spec}]" if spec else "policy:lbss"] = (drafters, lambda seed, spec=spec: make_policy(lbss_config(spec, seed), make_draft_length(k)))
    return out


def spread(per_seed: dict[int, dict[str, float]], labels: list[str]) -> str:
    """Each method's Spec-Bench speed-up (ALL) per seed, with their mean and sd."""
    seeds = list(per_seed)
    lines = ["", "### ALL speed-up per seed", "", "| method | mean | sd | " + " | ".join(map(str, seeds)) + " |", "|---" * (len(seeds) + 3) + "|"]
    for m in labels:
        xs = [per_seed[s][m] for s in seeds]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        lines.append(f"| {m} | {statistics.mean(xs):.3f} | {sd:.3f} | " + " | ".join(f"{x:.3f}" for x in xs) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", type=Path, default=None, help="a recording (drafts.json) to replay; without it the models record one into --out")
    ap.add_argument("--lbss", nargs="*", default=[""], help='LBSSConfig settings per LBSS variant, e.g. "" "optimism=0.5,settle=2" ("": the defaults)')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="cost-noise (and policy) seeds; records of every seed are pooled")
    ap.add_argument("--noise", type=float, default=0.05, help="sd of the log-normal noise on every replayed cost")
    args = ap.parse_args()
    args.policies = [p for p in (args.policies or ["epsilon_greedy", "round_robin"]) if p != "lbss"]  # LBSS runs as --lbss variants
    if args.drafts is None:
        rec = record(args)
        args.out.mkdir(parents=True, exist_ok=True)
        args.drafts = args.out / "drafts.json"
        args.drafts.write_text(json.dumps(rec))
        print(f"recorded: {args.drafts}")
    rec = json.loads(args.drafts.read_text())
    verify = fit_verify(rec["requests"])
    drafters = [fit_drafter(info, rec["requests"]) for info in rec["drafters"]]
    measured = [r for r in rec["requests"] if not r["held_out"]]
    records, per_seed = [], {}
    table = methods(drafters, rec["env"]["draft_length"], args)
    for seed in args.seeds:
        seed_records = [
            {"question_id": r["question_id"], "task": r["task"], "batch_size": 1, "new_tokens": r["positions"],
             "methods": {"plain": {"seconds": plain_seconds(r), "identical": True}}}
            for r in measured
        ]
        for label, (pool, make) in tqdm(table.items(), desc=f"seed {seed}"):
            for r, m in zip(seed_records, replay(rec, pool, make(seed), verify, args.noise, seed)):
                r["methods"][label] = m
        per_seed[seed] = {m: v["speedup"] for m, v in summarize(seed_records)[1]["ALL"].items() if isinstance(v, dict) and "speedup" in v}
        records += seed_records
    tasks = {r["task"] for r in rec["requests"]}
    env = {**rec["env"], "ragged_attention": False, "policy_warmup": sum(r["held_out"] for r in rec["requests"]) // len(tasks)}
    costs = f"verify {verify.base:.4f} + {verify.per_token:.4f} n^{verify.power:.2f} s; " + "; ".join(
        f"{d.name} {d.forward_seconds * 1e3:.1f} ms/forward, {d.catch_up_seconds * 1e3:.2f} ms/token caught up" for d in drafters
    )
    header = f"Replay of {args.drafts} ({len(measured)} questions, seeds {args.seeds}, cost noise {args.noise}); costs: {costs}.\n\n"
    md = header + markdown(summarize(records), env) + spread(per_seed, list(table))
    path = write_results(args.out, "policy_replay", {"env": env, "seeds": args.seeds, "per_seed": per_seed, "records": records}, md)
    print(md)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
