"""`python -m benchmarks.replay record|run|costs`: the command line of record.py, run.py and costs.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import DEFAULT_QUESTIONS
from benchmarks.injected_costs import STRUCTURES
from benchmarks.workloads import WORKLOADS
from hf_spin.cache.static_forward import CUDA_GRAPHS, INDUCTOR_GRAPHS

from .checks import DEFAULT_CHECKS
from .costs import FLOOR
from .run import CACHES, READS, TARGET_SHAPES, TREE_VARIANTS


def _reads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--read-each-draft-token",
        choices=sorted(READS),
        default="auto",
        help="the model drafters' `read_each_draft_token` on the static layout: yes reads each token (trees grow "
        "there, a read a depth), no keeps a chain on the device (one read); auto: each token on a CPU, once on a GPU",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record a trace on CPU with real models (float32)")
    rec.add_argument("--workloads", nargs="*", default=["spec_bench"], choices=WORKLOADS)
    rec.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench's question.jsonl")
    rec.add_argument("--per-group", type=int, default=1, help="questions per Spec-Bench task group / MT-Bench category")
    rec.add_argument("--schema-requests", type=int, default=6, help="requests of the schema workload")
    rec.add_argument("--prompts", type=Path, help='more requests: a jsonl file, one {"prompt": ...} a line')
    rec.add_argument("--limit", type=int, help="at most this many requests")
    rec.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a packaged model (hf_spin.models)")
    rec.add_argument(
        "--drafters",
        nargs="+",
        default=["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "prompt_lookup", "suffix"],
        help="packaged models, prompt_lookup, suffix; the first is the default pool, all of them the LBSS pool",
    )
    rec.add_argument("--max-new-tokens", type=int, default=32)
    rec.add_argument("--k", type=int, default=8, help="k_max: the longest draft recorded")
    rec.add_argument(
        "--checks",
        nargs="+",
        default=[c.name for c in DEFAULT_CHECKS],
        help="check runs, POLICY-chain|tree-bN[-packed] (policies fixed, round_robin, vote), or 'none'",
    )
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, default=Path("benchmarks/results/replay/trace.npz"))
    run = sub.add_parser("run", help="replay a trace with forced models of the recorded shapes")
    run.add_argument("trace", type=Path, nargs="+", help="one trace, or several recorded alike, replayed as one")
    run.add_argument("--check", action="store_true", help="replay the recorded check runs; exit 1 unless exact")
    run.add_argument(
        "--target-shape",
        choices=sorted(TARGET_SHAPES),
        help="a larger target's shape in place of the recorded one's, the recorded acceptance standing in",
    )
    run.add_argument(
        "--trees", choices=sorted(TREE_VARIANTS), default="auto", help="the pools with token trees, chains, or both"
    )
    run.add_argument("--device", help="default: cuda when there is one, else cpu")
    run.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    run.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    run.add_argument(
        "--compile-backend",
        help="the static-cache generate's torch.compile backend (e.g. eager: dynamo alone, so it runs on CPU too); "
        "default: transformers' own, on CUDA only",
    )
    run.add_argument(
        "--cache", choices=CACHES, default="auto", help="the pools' KV cache layout; auto: static (compiled) on CUDA"
    )
    run.add_argument(
        "--static-backend",
        choices=("inductor", CUDA_GRAPHS, INDUCTOR_GRAPHS),
        default=INDUCTOR_GRAPHS,
        help="the static layout's forwards on CUDA: torch.compile with inductor (torch's CUDA graph trees), the eager "
        "forwards captured as CUDA graphs without torch.compile (seconds of warm-up, not minutes), or inductor's "
        "forwards captured as hf_spin's CUDA graphs (default, as StaticOptions)",
    )
    run.add_argument(
        "--draft-backend",
        choices=("inductor", CUDA_GRAPHS, INDUCTOR_GRAPHS),
        help="the model drafters' backend where it differs from --static-backend",
    )
    _reads_argument(run)
    run.add_argument(
        "--methods",
        nargs="+",
        type=str,
        help="only these methods besides plain generate (always run: the ratios' base), e.g. generate_static "
        "hf_spin_lbss_static: a time budget then reaches the pools that matter (default: all)",
    )
    run.add_argument(
        "--budget-s", type=float, help="seconds; a method is skipped when less is left than the longest one so far took"
    )
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--out", type=Path, default=Path("benchmarks/results/replay"))
    costs = sub.add_parser(
        "costs", help="replay a trace on injected cost structures: the default path's decisions on other machines"
    )
    costs.add_argument("trace", type=Path, nargs="+", help="one trace, or several recorded alike, replayed as one")
    costs.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    costs.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    costs.add_argument("--floor", type=float, default=FLOOR, help="exit 1 if a pool runs below this x plain")
    costs.add_argument("--threads", type=int, default=2)
    costs.add_argument("--out", type=Path, default=Path("benchmarks/results/replay"))
    host = sub.add_parser(
        "host", help="the engine's own work a step (Python), by the wall clock, on the stand-ins of `costs`"
    )
    host.add_argument("trace", type=Path, nargs="+", help="one trace, or several recorded alike, replayed as one")
    host.add_argument("--structure", default="flat", choices=STRUCTURES, help="the costs the pools decide on")
    host.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    host.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="each workload's requests this many times over, one pool learning from them all: a server's steady "
        "state (the policies' history full past 64 requests) rather than a fresh pool's",
    )
    host.add_argument(
        "--step-ms",
        type=float,
        help="every forward lasts its cost on --structure at a plain step of this many ms, the host's work beside it "
        "(a GPU's step with this machine's host: the never-slower rule where the host's work counts); default: "
        "the stand-ins' own forwards",
    )
    _reads_argument(host)
    host.add_argument(
        "--cache", choices=("rectangular", "packed", "static"), default="rectangular", help="the pools' KV cache layout"
    )
    host.add_argument("--threads", type=int, default=2)
    host.add_argument("--out", type=Path, default=Path("benchmarks/results/replay"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "record":
        from .record import main as record

        record(args)
        return 0
    if args.command == "costs":
        from .costs import main as costs

        return costs(args)
    if args.command == "host":
        from .costs import host_main

        return host_main(args)
    from .run import main as run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
