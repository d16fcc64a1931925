r"""Several `pool_bench.py` runs of the same workload read together: how noisy one run is, how much
of the oracle is noise, and where a policy gains or loses against a reference method per task.

    python -m benchmarks.research.pool_runs \
        benchmarks/results/b1_cold13 benchmarks/results/b1_cold14 benchmarks/results/b1_cold15 \
        --policy policy:lbss --reference spin:smollm2-135m

One run's per-request times move with the machine (this CPU's speed drifts by +-30% over minutes),
so a policy's ratio to the best single drafter, and its fraction of the per-request oracle (the best
of the single drafters and plain decoding in hindsight, `pool_bench.summarize`), are read off
noisy numbers. With several runs of the same questions:

- spread: per method, the sd of log goodput of a request between two runs, over sqrt(2) (one run's
  sd), pooled over requests and pairs of runs;
- oracle: each run's oracle in hindsight against an oracle whose choice per request was made in
  the other runs (its goodput read in this run): the part of the oracle that is a maximum over
  noise, not a better choice;
- per task: every method's summed speed over all runs (tokens over the whole call's seconds, as
  the bench's speed-ups: the ratio to plain is its Spec-Bench speed-up pooled over the runs), as a
  ratio to the reference method's, and the policy's fraction of the oracle (row goodput, as the
  bench's oracle fraction);
- `--skip N`: the policy's ratio again without each run's first N requests (in the bench's order),
  where a cold pool pays for what it learns;
- `--plot PATH`: per run, the policy's speed over the reference's on each request in the bench's
  order, and that ratio summed so far (what the run's overall ratio would be, had it stopped
  there): where a cold pool's learning cost sits and how far it is repaid.

Reads each directory's newest `pool_bench-*.json` (or the files named), at one batch size (the
first requested in the first run, or --batch-size); only the requests every run has.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.pool_bench import oracle_pick, row_goodput, speed


def load(path: Path, batch_size: int | None) -> tuple[int, dict[int, dict]]:
    """(batch size, {question_id: record}) of one run: a pool_bench JSON or the newest in a directory."""
    if path.is_dir():
        files = sorted(path.glob("pool_bench-*.json"))
        if not files:
            raise SystemExit(f"no pool_bench-*.json in {path}")
        path = files[-1]
    records = json.loads(path.read_text())["records"]
    sizes = [r.get("requested_batch_size", r["batch_size"]) for r in records]
    bs = batch_size if batch_size is not None else sizes[0]
    if bs not in sizes:
        raise SystemExit(f"{path} has batch sizes {sorted(set(sizes))}, not {bs}")
    return bs, {r["question_id"]: r for r, s in zip(records, sizes) if s == bs}


def oracle_goodput(record: dict, singles: list[str], chosen_in: dict | None = None) -> float:
    """The request's row goodput under the oracle's method (the best of `singles` and plain decoding),
    chosen on `chosen_in` (the same request in another run; default: this record, the oracle in hindsight)."""
    pick = chosen_in or record
    return row_goodput(record, oracle_pick(pick, singles))


def shared_methods(runs: list[dict[int, dict]], qids: list[int]) -> list[str]:
    """The methods timed on every request of every run (the first run's order): runs of one workload
    may differ in what else they ran (assisted generation, other policies) or where a baseline crashed."""
    first = runs[0][qids[0]]["methods"]
    return [m for m in first if all("seconds" in run[q]["methods"].get(m, {}) for run in runs for q in qids)]


def single_drafters(methods: list[str]) -> list[str]:
    """The oracle's candidates among `methods` (`shared_methods`: timed on every request of every run)."""
    return [m for m in methods if m.startswith("spin:")]


def spreads(runs: list[dict[int, dict]], qids: list[int], methods: list[str]) -> dict[str, float]:
    """Per method, one run's sd of log goodput of a request (pairwise differences / sqrt(2))."""
    out = {}
    for m in methods:
        diffs = [
            math.log(row_goodput(a[q], m) / row_goodput(b[q], m))
            for a, b in itertools.combinations(runs, 2)
            for q in qids
        ]
        out[m] = statistics.pstdev(diffs) / math.sqrt(2) if diffs else float("nan")
    return out


def oracle_noise(runs: list[dict[int, dict]], qids: list[int]) -> list[float]:
    """Per run: its oracle in hindsight over the mean (over the other runs) of an oracle that chose
    each request's method in another run and is read in this one."""
    singles = single_drafters(shared_methods(runs, qids))
    out = []
    for i, run in enumerate(runs):
        hindsight = sum(oracle_goodput(run[q], singles) for q in qids)
        crossed = [
            sum(oracle_goodput(run[q], singles, other[q]) for q in qids) for j, other in enumerate(runs) if j != i
        ]
        out.append(hindsight / statistics.mean(crossed))
    return out


def per_task(runs: list[dict[int, dict]], qids: list[int], policy: str, reference: str) -> dict[str, dict[str, float]]:
    """Per task and ALL, over every run: each method's summed speed over the reference's, and the
    policy's summed row goodput over the oracle's (`oracle fraction`)."""
    speeds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    goodputs: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    methods = shared_methods(runs, qids)
    singles = single_drafters(methods)
    for run in runs:
        for q in qids:
            r = run[q]
            for task in (r["task"], "ALL"):
                for m in methods:
                    speeds[task][m] += speed(r, m)
                goodputs[task][policy] += row_goodput(r, policy)
                goodputs[task]["oracle"] += oracle_goodput(r, singles)
    table = {}
    for task, s in speeds.items():
        table[task] = {m: v / s[reference] for m, v in s.items()}
        table[task]["oracle fraction"] = goodputs[task][policy] / goodputs[task]["oracle"]
    return table


def after_first(run: dict[int, dict], qids: list[int], skip: int) -> list[int]:
    """The shared requests in the run's own order (the bench's), less its first `skip`: a cold pool
    pays for what it learns on its first requests, and the rest shows what it does once it has."""
    shared = set(qids)
    return [q for q in run if q in shared][skip:]


def learning_curve(
    run: dict[int, dict], qids: list[int], policy: str, reference: str
) -> tuple[list[float], list[float]]:
    """([R] the policy's speed over the reference's per request, [R] the same of their speeds summed
    over the requests so far), the shared requests in the run's (the bench's) order. At batch > 1
    the rows of a batch share its time: each of them repeats the batch's ratio."""
    ratios, cumulative, total_p, total_r = [], [], 0.0, 0.0
    for q in after_first(run, qids, 0):
        p, r = speed(run[q], policy), speed(run[q], reference)
        total_p, total_r = total_p + p, total_r + r
        ratios.append(p / r)
        cumulative.append(total_p / total_r)
    return ratios, cumulative


def plot(
    out: Path, paths: list[Path], runs: list[dict[int, dict]], qids: list[int], policy: str, reference: str
) -> None:
    """`learning_curve` of every run, one colour each: points per request, a line for the running sum."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on the benchmark machines
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError as err:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from err
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (path, run) in enumerate(zip(paths, runs)):
        ratios, cumulative = learning_curve(run, qids, policy, reference)
        x = range(1, len(ratios) + 1)
        ax.scatter(x, ratios, s=14, color=f"C{i}", alpha=0.6)
        ax.plot(x, cumulative, color=f"C{i}", label=f"{path.name} (summed so far)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_yticks(
        [t for t in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0) if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    )
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.9, not 9 x 10^-1
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request, in the bench's order")
    ax.set_ylabel(f"{policy} / {reference}, speed")
    ax.set_title(f"{policy} against {reference}, per request (points) and summed so far (lines)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def markdown(
    paths: list[Path], bs: int, qids: list[int], runs: list[dict[int, dict]], policy: str, reference: str, skip: int = 0
) -> str:
    methods = shared_methods(runs, qids)
    lines = [f"{len(runs)} runs at batch {bs}, {len(qids)} requests each: " + ", ".join(str(p) for p in paths), ""]
    lines += ["| method | one run's sd of a request's log goodput |", "|---|---|"]
    lines += [f"| {m} | {s:.3f} |" for m, s in spreads(runs, qids, methods).items()]
    noise = oracle_noise(runs, qids) if len(runs) > 1 else []
    later_qids = after_first(runs[0], qids, skip)  # the runs share the bench's order (`main` checks)
    warm = f" | {policy} / {reference} after the first {skip}" if skip else ""
    lines += [
        "",
        "| run | oracle in hindsight / oracle chosen in the other runs | "
        + f"{policy} / {reference} | {policy} oracle fraction{warm} |",
        "|---|---|---|---|" + ("---|" if skip else ""),
    ]
    for i, (path, run) in enumerate(zip(paths, runs)):
        table = per_task([run], qids, policy, reference)["ALL"]
        crossed = f"{noise[i]:.3f}" if noise else "-"
        later = f" | {per_task([run], later_qids, policy, reference)['ALL'][policy]:.3f}" if skip else ""
        lines.append(f"| {path} | {crossed} | {table[policy]:.3f} | {table['oracle fraction']:.3f}{later} |")
    table = per_task(runs, qids, policy, reference)
    tasks = sorted(t for t in table if t != "ALL") + ["ALL"]
    lines += [
        "",
        f"Summed speed over all runs, / {reference} (oracle fraction: row goodput):",
        "",
        "| method | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for m in methods + ["oracle fraction"]:
        label = f"{policy} oracle fraction" if m == "oracle fraction" else m
        lines.append(f"| {label} | " + " | ".join(f"{table[t][m]:.3f}" for t in tasks) + " |")
    if skip:
        later = per_task(runs, later_qids, policy, reference)["ALL"]
        lines += [
            "",
            f"After the first {skip} requests of each run, over all runs: {policy} / {reference} {later[policy]:.3f}, "
            f"oracle fraction {later['oracle fraction']:.3f}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "runs",
        type=Path,
        nargs="+",
        help="pool_bench result directories (their newest pool_bench-*.json) or JSON files",
    )
    ap.add_argument("--policy", default="policy:lbss", help="the method read against the reference and the oracle")
    ap.add_argument(
        "--reference",
        default="spin:smollm2-135m",
        help="the method the per-task ratios divide by (e.g. the best single drafter)",
    )
    ap.add_argument(
        "--batch-size", type=int, default=None, help="the batch size read (default: the first in the first run)"
    )
    ap.add_argument(
        "--skip",
        type=int,
        default=0,
        help="also read each run without its first N requests (a cold pool's learning cost)",
    )
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write the policy's per-request ratio to the reference, in the bench's order, to this image "
        "(needs matplotlib)",
    )
    args = ap.parse_args()
    bs, first = load(args.runs[0], args.batch_size)
    runs = [first] + [load(p, bs)[1] for p in args.runs[1:]]
    qids = sorted(set.intersection(*(set(r) for r in runs)))
    if not qids:
        raise SystemExit("the runs share no request")
    shared = shared_methods(runs, qids)
    for name in (args.policy, args.reference):
        if name not in shared:
            raise SystemExit(f"{name!r} is not timed on every request of every run; the methods that are: {shared}")
    if not 0 <= args.skip < len(qids):
        raise SystemExit(f"--skip {args.skip} leaves no request of the {len(qids)} the runs share")
    if args.skip and any(after_first(run, qids, 0) != after_first(runs[0], qids, 0) for run in runs):
        raise SystemExit(
            f"--skip {args.skip}: the runs ran their shared requests in different orders, "
            "so their first requests differ"
        )
    print(markdown(args.runs, bs, qids, runs, args.policy, args.reference, args.skip))
    if args.plot:
        plot(args.plot, args.runs, runs, qids, args.policy, args.reference)
        print(f"written: {args.plot}")


if __name__ == "__main__":
    main()
