"""Verification of token trees (token_tree.py): the path the target accepts, and the one token it adds.

Per row the target scored slot 0 (the last committed token) and slot i + 1 (node i) in one forward,
each slot seeing its own path (`TokenTree.ancestor_mask`): `p[s]` is the target's distribution of the
token after slot s. Verification walks down from the root and returns the accepted nodes (a path)
and the next token: the recovered token where the walk stops at a rejection, the bonus token where it
stops at a leaf.

Greedy: move to the child whose token is argmax p at the current slot; stop where no child is.

Sampling (multi-candidate speculative sampling: SpecInfer's multi-step speculative sampling, i.e.
recursive rejection sampling). At a slot with target distribution r_1 = p[s] and candidates
c_1..c_m (`TokenTree.candidates`: proposal order, a sampled node once per draw), candidate j with
token x_j proposed from q_j (one-hot at x_j for a deterministic proposal) is accepted with probability
min(1, r_j(x_j) / q_j(x_j)); if it is rejected, r_{j+1} = norm(max(0, r_j - q_j)) and candidate j + 1
is tried. An accepted candidate moves the walk to its slot (r_1 := p of that node); when all are
rejected the next token is drawn from r_{m+1}; at a leaf (no candidates) from p there.

Why it is lossless. Lemma (Leviathan et al. 2023): for any r, q, drawing x ~ q, accepting it with
probability min(1, r(x)/q(x)) and otherwise drawing from norm(max(0, r - q)) emits y with probability
min(q(y), r(y)) + (1 - sum_x min(q(x), r(x))) max(0, r(y) - q(y)) / sum_x max(0, r(x) - q(x))
= min(q(y), r(y)) + max(0, r(y) - q(y)) = r(y), because sum_x max(0, r - q) = 1 - sum_x min(q, r).
At a slot, "otherwise" for candidate j is the same procedure on r_{j+1} with candidates j + 1..m; each
of those is a fixed function of the path (deterministic) or a fresh draw from its q, independent of
candidate j's coin, so by induction from the last candidate (whose "otherwise" draws from r_{m+1}
itself) the token emitted at the slot follows r_1 = p[s], the target's distribution there. An accepted
candidate's slot then starts the same procedure with the target's distribution after it: the emitted
sequence follows the target token by token. For a deterministic candidate the test reads "accept with
probability r(x)" and the residual is r without x, renormalised. The order of the candidates may be
any order fixed before their coins are drawn; sorting sampled draws by what they drew would break the
independence the induction uses (token_tree.py keeps draws in order).

Both residual sequences and every coin depend only on how many candidates were rejected before, not
on which, so `decide` computes every slot's coins and fallback token at once on the device and the
host walks the tree after one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .token_tree import TokenTree


@dataclass
class TreeVerdict:
    path: list[int]  # accepted nodes, the root's child first
    next_token: int  # recovered token (the walk stopped at a rejection) or bonus token (at a leaf)

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(scores: torch.Tensor, tree: TokenTree) -> TreeVerdict:
    """scores: `[N + 1, V]` processed target scores per slot. Example: argmax per slot [7, 9, 4, 2] over
    the tree root -> 7 (node 0) -> {8 (node 1), 9 (node 2)} accepts [0, 2] and adds the token 2."""
    best = scores.argmax(dim=-1).tolist()  # [N + 1] one transfer
    return walk_greedy(best, tree)


def walk_greedy(best: list[int], tree: TokenTree) -> TreeVerdict:
    """The greedy walk over the target's argmax per slot (`best`, host list)."""
    path, node = [], -1
    while True:
        want = best[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return TreeVerdict(path, want)
        path.append(child)
        node = child


def decide(
    p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every coin and fallback draw of sampled verification, on p's device.

    p: `[N + 1, V]` target probabilities per slot. Returns coins `[len(tree.order)]` bool (coin j: the
    j-th entry of `tree.order` is accepted if the walk reaches it) and fallback `[N + 1]` long (the
    token drawn at each slot when the walk stops there)."""
    n = len(tree)
    coins = torch.zeros(len(tree.order), dtype=torch.bool, device=p.device)
    residual = p.clone()  # [N + 1, V] r at each slot, updated as its candidates are read as rejected
    position = {}  # node -> the indices of its draws in tree.order
    for j, c in enumerate(tree.order):
        position.setdefault(c, []).append(j)
    u = torch.rand(len(tree.order), device=p.device, generator=generator)  # [C] one uniform per candidate
    for slot in range(n + 1):
        r = residual[slot]
        for c in tree.candidates(slot - 1):
            j = position[c].pop(0)
            x = tree.tokens[c]
            q = tree.q[c]
            if q is None:  # deterministic: one-hot at x
                coins[j] = u[j] < r[x]
                r = r.clone()
                r[x] = 0.0
            else:
                q = q.to(p.device, p.dtype)
                coins[j] = u[j] * q[x] < r[x]  # r(x)/q(x) > u, without dividing
                r = (r - q).clamp(min=0.0)
            total = r.sum()
            r = torch.where(
                total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), residual[slot]
            )  # r == q exactly: never reached
        residual[slot] = r
    fallback = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [N + 1]
    return coins, fallback


def walk_sampling(coins: list[bool], fallback: list[int], tree: TokenTree) -> TreeVerdict:
    """The sampled walk over `decide`'s coins and fallback tokens (host lists)."""
    path, node = [], -1
    while True:
        accepted = next((c for j, c in enumerate(tree.order) if tree.parents[c] == node and coins[j]), None)
        if accepted is None:
            return TreeVerdict(path, fallback[node + 1])
        path.append(accepted)
        node = accepted


def verify_tree_sampling(p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None = None) -> TreeVerdict:
    """Sampled verification of one row's tree (module docstring). p: `[N + 1, V]` target probabilities."""
    coins, fallback = decide(p, tree, generator)
    both = torch.cat([coins.long(), fallback]).tolist()  # one transfer
    return walk_sampling([bool(b) for b in both[: len(coins)]], both[len(coins) :], tree)
