"""What a row's token is worth in a closed batch: one that ends with its slowest row (docs/planning.md, "Closed
batches").

A `generate` call's batch takes no new rows: it ends when its last row does. A token of the row that ends last
saves a step at the batch's end, where that row alone remains: plain_seconds(1). A token of any other row only
brings its retirement forward, so the steps until the batch ends run one row narrower: plain_seconds(B) -
plain_seconds(B - 1), next to nothing where a step costs about the same at any batch (a GPU, an AMX CPU). Which
row ends last is uncertain (`last_row_odds`: the acceptances to come, and where a row stops, which before any row
of the pool ended is anywhere), so each row's token is worth the two mixed by its odds. The planner,
valuing every row's token at an equal share of a step, drafted for rows that then waited for a row whose drafts
all failed (batch 4, bf16, an AMX Xeon: 0.93x plain `generate`). Each row's weight is its token's worth over the
mean, so a plain step keeps its value (B), and on costs proportional to the rows every weight is 1. A server's
batch is open: a retired row's slot takes the next request, so there every token is worth the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def row_weights(
    left: list[int | None], spreads: list[float | None], rates: list[float], plain_seconds: Callable[[int], float]
) -> list[float]:
    """[B] the worth of a token of each row of a closed batch over the mean (they sum to B).
    left: [B] tokens each row is expected to generate still, spreads: [B] their standard deviations (None: unknown,
    every weight 1); rates: [B] tokens each commits a step; plain_seconds: rows -> seconds of a plain step."""
    B = len(left)
    if B < 2 or any(n is None for n in left):
        return [1.0] * B
    rates = [max(r, 1.0) for r in rates]
    steps = [n / r for n, r in zip(left, rates)]  # [B] steps each row is expected to run
    # [B] their uncertainty: the acceptances a step are draws (a count's square root), and the length itself
    sds = [math.sqrt(max(s, 1.0) + (d / r) ** 2) for s, d, r in zip(steps, spreads, rates)]
    last = last_row_odds(steps, sds)  # [B]
    end = plain_seconds(1)  # the batch's last row's token: a step fewer at its end
    slot = max(plain_seconds(B) - plain_seconds(B - 1), 0.0)  # another row's: its slot retired a step sooner
    worth = [p * end + (1.0 - p) * slot for p in last]
    return [B * w / sum(worth) for w in worth]


def last_row_odds(steps: list[float], sds: list[float]) -> list[float]:
    """[B] the chance that each row is the batch's last to end, its steps left `steps` ([B]) expected with standard
    deviations `sds` ([B]): P(b outlasts j) over every other row j, a normal approximation, multiplied and
    normalised. Rows alike share it; a row many sds ahead of another has none."""
    odds = [
        math.prod(
            0.5 * math.erfc((sj - sb) / math.sqrt(2.0 * (db * db + dj * dj)))
            for j, (sj, dj) in enumerate(zip(steps, sds))
            if j != b
        )
        for b, (sb, db) in enumerate(zip(steps, sds))
    ]
    total = sum(odds)
    return [o / total for o in odds] if total > 0 else [1.0 / len(steps)] * len(steps)
