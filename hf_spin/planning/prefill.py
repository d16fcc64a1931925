"""Prefill groups: which of the rows joining at once the target prefills in one forward.

`generate` prefills a batch in one forward over its prompts left-padded to the longest, so one long
prompt among short ones makes every row a long one: on a CPU, whose forward costs grow with its
positions, four Spec-Bench prompts padded to a 709-token summarization prompt spent most of a 32-token
batch there (docs/planning.md, "Prefill groups"). A forward over n rows padded to P tokens is priced
t(n P, n) by the target's cost profile, read past its knots at the last knot's slope, the cheapest reading
(`ForwardCost.predict`): the rows, sorted by length, split into the consecutive groups of least total price,
so a split is taken only where it pays even if long forwards cost that little; else the rows prefill as
`generate` does, in one block. A prefill forward far past the knots becomes a knot of its own
(`CostProfile.observe_prefill`): later calls price from what long forwards took here.
"""

from __future__ import annotations

from .cost_profile import ForwardCost


def prefill_groups(cost: ForwardCost, lengths: list[int]) -> list[list[int]]:
    """Indices into `lengths` (the rows' prompt lengths) of the rows to prefill together, each group in
    row order and the groups by length; one group where splitting saves nothing."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: least price of the j shortest rows
    start = [0] * (n + 1)  # start[j]: where the last group of that best split starts
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):  # the rows i..j-1 (sorted) as one group, padded to the longest of them
            rows = j - i
            price = best[i] + cost.predict(rows * longest, rows)
            if price < best[j]:  # strictly: the fewest groups among equal prices
                best[j], start[j] = price, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[start[j] : j]))
        j = start[j]
    return groups[::-1]
