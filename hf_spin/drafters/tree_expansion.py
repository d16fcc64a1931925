"""A model drafter's token tree, grown one depth at a time (EAGLE-2's dynamic draft tree).

    draft = grow_trees(drafter, request, logits, draft_seqs)   # after the drafter's catch-up

At each depth, the drafter's distribution at every frontier node gives that node its `width`
likeliest children. A child weighs its path probability: the product of the draft probabilities
along its path. The depth's `width` heaviest children are the next frontier, counting only those
whose own probability is at least `min_confidence` (with width 1 this is the chain's confidence
stop). The frontier of every row is fed in one forward over the drafter's own `RectangularCache`, with a
4D mask (`forward_masked`): a node sees the row's committed tokens and its ancestors, at position
L - 1 + depth (L committed tokens, the last of them the root). A row stops at its k levels.

The tree then keeps its `width * k` heaviest nodes. A child never outweighs its parent, so the kept
nodes hold their parents. The cache keeps only the KV of the heaviest path's fed nodes, which is what
a chain draft would have left, so the next catch-up works as it does after a chain. `Draft.tokens` is
the kept tree's heaviest path (heaviest child at each node), down to its leaf.

Children are deterministic proposals given their path (q None). Sampled verification reads them as
one-hot (tree_verification.py): rejecting x_j zeroes it in the residual, so m distinct candidates at
a node are accepted with probability p(x_1) + ... + p(x_m). No m candidates can do better. i.i.d.
draws from q would repeat tokens and be accepted less often.
"""

from __future__ import annotations

import math

import torch

from ..cache import forward_masked
from ..host_syncs import to_device
from ..verify.token_tree import TokenTree
from .base import Draft, DraftRequest


def grow_trees(drafter, request: DraftRequest, logits: torch.Tensor, draft_seqs: dict[int, list[int]]) -> Draft:
    """Token trees for `request.rows` (module docstring). logits: `[B, 1, V_draft]` the drafter's logits
    after each row's last committed token; draft_seqs: row -> its committed ids (the drafter holds
    their KV). Returns the heaviest paths as chains, and the trees."""
    cache, width = drafter.cache, drafter.tree_width
    start = cache.num_slots
    committed = cache.host_mask.clone()  # [B, S0] each row's committed slots
    lengths = committed.sum(dim=1).tolist()  # [B]; the root (last committed token) is at position length - 1
    limit = dict(zip(request.rows, request.k))
    trees = {row: TokenTree() for row in request.rows}
    column = {row: {} for row in request.rows}  # row -> node -> cache column of its KV
    frontier = {
        row: [(-1, 0)] for row in request.rows if limit[row] > 0
    }  # row -> [(node, slot of its logits in `logits`)]
    depth = 1
    while frontier:
        # 1. The frontier's children: each node's `width` likeliest tokens, scored like the target's.
        at = [(row, node, slot) for row, nodes in frontier.items() for node, slot in nodes]  # [n]
        index = to_device([[row for row, _, _ in at], [slot for _, _, slot in at]], logits.device, torch.long)  # [2, n]
        prefixes = [
            request.sequences[row] + [trees[row].tokens[i] for i in trees[row].path(node)] for row, node, _ in at
        ]
        scores = drafter._scores(logits[index[0], index[1]], [row for row, _, _ in at], prefixes, request)  # [n, V]
        top = torch.log_softmax(scores, dim=-1).topk(min(width, scores.shape[-1]), dim=-1)  # [n, w]
        values, tokens = torch.stack([top.values.double(), top.indices.double()]).tolist()  # one transfer: [n, w] each
        children: dict[int, list[tuple[int, float]]] = {}  # row -> [(child, its own log-probability)]
        for (row, node, _), lps, ids in zip(at, values, tokens):
            before = trees[row].weights[node] if node >= 0 else 1.0  # the node's path probability
            for lp, token in zip(lps, ids):
                if not math.isfinite(lp):  # a token the processors forbid (NaN: every token forbidden)
                    continue
                child = trees[row].add(node, int(token), weight=before * math.exp(lp))
                children.setdefault(row, []).append((child, lp))
        # 2. The next frontier: the depth's heaviest confident children, for rows with depths left.
        chunks: list[list[int]] = [[] for _ in lengths]
        nodes_of: dict[int, list[int]] = {}
        for row, kids in children.items():
            if depth >= limit[row]:
                continue
            confident = [c for c, lp in kids if math.exp(lp) >= request.min_confidence]
            nodes_of[row] = sorted(confident, key=lambda c: (-trees[row].weights[c], c))[:width]
            chunks[row] = [trees[row].tokens[c] for c in nodes_of[row]]
        frontier = {}
        if not any(chunks):
            break
        # 3. Feed it: one forward for every row, each node seeing the committed tokens and its ancestors.
        S, T = cache.num_slots, max(len(c) for c in chunks)
        positions = torch.tensor(lengths)[:, None].repeat(1, T) - 1 + depth  # [B, T]
        allowed = torch.zeros(len(lengths), T, S + T, dtype=torch.bool)  # [B, T, S + T]
        allowed[:, :, : committed.shape[1]] = committed[:, None, :]
        for row, nodes in nodes_of.items():
            for t, node in enumerate(nodes):
                allowed[
                    row, t, torch.tensor([column[row][a] for a in trees[row].path(node)[:-1]], dtype=torch.long)
                ] = True
                column[row][node] = S + t
            frontier[row] = [(node, t) for t, node in enumerate(nodes)]
        logits = forward_masked(drafter.model, cache, chunks, positions, allowed)  # [B, T, V_draft]
        depth += 1
    # 4. Keep the heaviest path's KV; hand back the pruned trees and their heaviest paths.
    chains, kept = [], [[] for _ in lengths]
    for row, k in zip(request.rows, request.k):
        path = _heaviest_path(trees[row])
        fed = [n for n in path if n in column[row]]  # a prefix of the path: only fed nodes have children
        kept[row] = [column[row][n] for n in fed]
        drafter.cached[row] = draft_seqs[row] + [trees[row].tokens[n] for n in fed]
        trees[row] = trees[row].pruned(width * k)
        chains.append([trees[row].tokens[n] for n in _heaviest_path(trees[row])])
    cache.keep_columns(start, kept)
    return Draft(
        tokens=chains, q=[None] * len(chains), trees=[trees[row] if len(trees[row]) else None for row in request.rows]
    )


def _heaviest_path(tree: TokenTree) -> list[int]:
    """The nodes from the root down, taking the heaviest child (ties: the earlier) at each node."""
    path, node = [], -1
    while (node := tree.heaviest_child(node)) is not None:
        path.append(node)
    return path
