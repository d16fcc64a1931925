"""What a plain step costs by its rows: the target's one-token forwards over B rows, beside the profile's reading.

    python -m benchmarks.research.row_costs --dtype float32 --repeats 12

A `generate` batch ends with its slowest row; hf_spin retires a row when it ends, so the steps after run one
row narrower, which pays where a step's cost grows with its rows (docs/planning.md, "Closed batches"). The
cost profile prices a step over B rows of one token at t(B positions) (its grid measures one row's positions:
on a slow machine 1, 2 and 8), so a batch width that costs more than a wider one (a CPU's small-GEMM paths)
is invisible to its grid (the steps read it: `CostProfile.plain_rows`, filler rows). This times one-token
forwards over B = 1..8 rows of `--context` positions of KV (a `DynamicCache`, a 2D mask, as `generate` steps),
the widths in turns, their median; and the profile's price for each (`ForwardCost.predict(B, B)`, read from the
cache or measured).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.common import machine, write_results
from hf_spin import models
from hf_spin.planning.profiling import cached_cost

TARGET = "qwen2.5-coder-1.5b-instruct"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--context", type=int, default=100, help="positions of KV each row holds")
    ap.add_argument("--repeats", type=int, default=12, help="forwards of every width, in turns")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


@torch.no_grad()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, _ = models.load(TARGET, dtype=getattr(torch, args.dtype))
    profile, _ = cached_cost(target)
    S, g = args.context, torch.Generator().manual_seed(0)
    caches = {}
    for B in args.rows:  # each width's context, prefilled once; every timed step is cropped back to it
        caches[B] = DynamicCache()
        target(input_ids=torch.randint(100, 1000, (B, S), generator=g), cache=caches[B])
    seconds = {B: [] for B in args.rows}
    for rep in tqdm(range(args.repeats), desc="repeats"):
        for B in args.rows[:: 1 if rep % 2 == 0 else -1]:
            cache = caches[B]
            if cache.get_seq_length() > S:
                cache.crop(S - cache.get_seq_length())
            inputs = dict(
                input_ids=torch.randint(100, 1000, (B, 1), generator=g),  # [B, 1]
                attention_mask=torch.ones(B, S + 1, dtype=torch.long),  # [B, S + 1]
                position_ids=torch.full((B, 1), S),  # [B, 1]
            )
            start = time.perf_counter()
            target(**inputs, cache=cache, logits_to_keep=1)
            seconds[B].append(time.perf_counter() - start)
    median = {B: statistics.median(v) for B, v in seconds.items()}
    lines = [
        f"One-token forwards of {TARGET} over B rows of {S} positions, {args.repeats} each in turns, the median; "
        f"{args.dtype}; {machine()['machine']}.",
        "",
        "| rows | ms (median) | ms (min-max) | vs the line above | profile's price, ms |",
        "|---|---|---|---|---|",
    ]
    for i, B in enumerate(args.rows):
        narrower = f"{median[B] / median[args.rows[i - 1]]:.2f}x" if i else "-"
        lines.append(
            f"| {B} | {median[B] * 1e3:.0f} | {min(seconds[B]) * 1e3:.0f}-{max(seconds[B]) * 1e3:.0f} | {narrower} | "
            f"{profile.predict(B, B) * 1e3:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "seconds": seconds}
    print(write_results(args.out, "row_costs", payload, table))


if __name__ == "__main__":
    main()
