"""Vote tree (Minions' majority-voted speculation): merge several drafters' drafts into one path.

Each drafter's draft for a row is a path from the root (the row's last committed token). Merged,
they form a token tree in which every node weighs the sum of the weights of the drafters whose
draft passes through it. The path verified is the heaviest one, built greedily from the root:
at each node take the heaviest child, stop at a leaf. Ties go to the child proposed by the
drafter listed first.

Example, weights {0: 0.5, 1: 0.3, 2: 0.4}:
    drafter 0: [a, b, c]
    drafter 1: [a, d]         root -> a (1.2) -> b (0.9) -> c (0.5)
    drafter 2: [a, b, e, f]                   -> d (0.3)    -> e (0.4) -> f (0.4)
heaviest path: a, b, c (0.5 beats e's 0.4). A drafter's proposal can therefore be cut (drafter 2
loses e, f) or extended by another's (b comes from drafters 0 and 2).

The merged path is a deterministic function of the drafts; verification reads it as a one-hot
proposal, which keeps the target's distribution exactly (verification.py), whatever the drafts.
"""

from __future__ import annotations


def heaviest_path(drafts: dict[int, list[int]], weights: dict[int, float] | list[float]) -> list[int]:
    """drafts: drafter index -> its draft tokens; weights: drafter index -> weight (>= 0)."""
    alive = [d for d in drafts if drafts[d]]  # drafters whose draft follows the path so far
    path: list[int] = []
    while alive:
        depth = len(path)
        votes: dict[int, float] = {}  # child token -> weight, in order of first proposer
        for d in alive:
            if len(drafts[d]) > depth:
                token = drafts[d][depth]
                votes[token] = votes.get(token, 0.0) + weights[d]
        if not votes:
            break
        best = max(votes, key=votes.__getitem__)  # max keeps the first of equal weights
        path.append(best)
        alive = [d for d in alive if len(drafts[d]) > depth and drafts[d][depth] == best]
    return path
