"""A model drafter's token tree, grown one depth at a time (EAGLE-2's dynamic draft tree).

    draft = grow_trees(drafter, request, logits, draft_seqs)   # after the drafter's catch-up

At each depth, the drafter's distribution at every frontier node gives that node its `width`
likeliest children. A child weighs its path probability: the product of the draft probabilities
along its path. The depth's `width` heaviest children are the next frontier, counting only those
whose own probability is at least `min_confidence` (with width 1 this is the chain's confidence
stop). The frontier of every row is fed in one forward: a node sees the row's committed tokens and its
ancestors, at position L - 1 + depth (L committed tokens, the last of them the root). A row stops at its
k levels. On the drafter's `RectangularCache` each node's KV keeps a column of its own and the frontier is
fed alone, with a 4D mask (`forward_masked`, `_ColumnFeed`); on its `StaticRowCache` (the static layout,
where forwards have fixed shapes and may be CUDA graphs) new slots see only the KV before a row's length,
so each forward feeds the frontier with its ancestors again, as a tree layout (`_StaticFeed`).

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
from ..cache.static import StaticRowCache
from ..host_syncs import to_device
from ..verify.token_tree import TokenTree
from .base import Draft, DraftRequest


def grow_trees(drafter, request: DraftRequest, logits: torch.Tensor, draft_seqs: dict[int, list[int]]) -> Draft:
    """Token trees for `request.rows` (module docstring). logits: `[B, 1, V_draft]` the drafter's logits
    after each row's last committed token; draft_seqs: row -> its committed ids (the drafter holds
    their KV). Returns the heaviest paths as chains, and the trees."""
    width = drafter.tree_width
    feed = _StaticFeed(drafter) if isinstance(drafter.cache, StaticRowCache) else _ColumnFeed(drafter)
    limit = dict(zip(request.rows, request.k))
    trees = {row: TokenTree() for row in request.rows}
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
        nodes_of: dict[int, list[int]] = {}
        for row, kids in children.items():
            if depth >= limit[row]:
                continue
            confident = [c for c, lp in kids if math.exp(lp) >= request.min_confidence]
            if confident:
                nodes_of[row] = sorted(confident, key=lambda c: (-trees[row].weights[c], c))[:width]
        if not nodes_of:
            break
        # 3. Feed it: one forward for every row, each node seeing the committed tokens and its ancestors.
        logits, slots = feed(trees, nodes_of, depth)  # [B, T, V_draft]; row -> each node's slot in it
        frontier = {row: list(zip(nodes, slots[row])) for row, nodes in nodes_of.items()}
        depth += 1
    # 4. Keep the heaviest path's KV; hand back the pruned trees and their heaviest paths.
    chains, kept = [], {}
    for row, k in zip(request.rows, request.k):
        kept[row] = feed.held(row, _heaviest_path(trees[row]))  # a prefix of the path: only fed nodes have children
        drafter.cached[row] = draft_seqs[row] + [trees[row].tokens[n] for n in kept[row]]
        trees[row] = trees[row].pruned(width * k)
        chains.append([trees[row].tokens[n] for n in _heaviest_path(trees[row])])
    feed.keep(kept)
    return Draft(
        tokens=chains, q=[None] * len(chains), trees=[trees[row] if len(trees[row]) else None for row in request.rows]
    )


class _ColumnFeed:
    """Feeds a depth's frontier alone over the drafter's `RectangularCache`: each node's KV stays in a column of
    its own, its ancestors' columns visible to it through a 4D mask (`forward_masked`)."""

    def __init__(self, drafter):
        self.drafter, self.cache = drafter, drafter.cache
        self.start = self.cache.num_slots
        self.committed = self.cache.host_mask.clone()  # [B, S0] each row's committed slots
        self.lengths = self.committed.sum(dim=1).tolist()  # [B]; the root (last committed token) at length - 1
        self.column: dict[int, dict[int, int]] = {}  # row -> node -> cache column of its KV

    def __call__(self, trees: dict, nodes_of: dict[int, list[int]], depth: int):
        """Feed each row's `nodes_of` (nodes at `depth`). Returns logits `[B, T, V_draft]` and row -> each node's
        slot in them."""
        chunks = [[trees[row].tokens[n] for n in nodes_of.get(row, [])] for row in range(len(self.lengths))]
        S, T = self.cache.num_slots, max(len(c) for c in chunks)
        positions = torch.tensor(self.lengths)[:, None].repeat(1, T) - 1 + depth  # [B, T]
        allowed = torch.zeros(len(self.lengths), T, S + T, dtype=torch.bool)  # [B, T, S + T]
        allowed[:, :, : self.committed.shape[1]] = self.committed[:, None, :]
        for row, nodes in nodes_of.items():
            column = self.column.setdefault(row, {})
            for t, node in enumerate(nodes):
                allowed[row, t, torch.tensor([column[a] for a in trees[row].path(node)[:-1]], dtype=torch.long)] = True
                column[node] = S + t
        logits = forward_masked(self.drafter.model, self.cache, chunks, positions, allowed)  # [B, T, V_draft]
        return logits, {row: list(range(len(nodes))) for row, nodes in nodes_of.items()}

    def held(self, row: int, path: list[int]) -> list[int]:
        """The nodes of `path` whose KV the cache holds: every fed one."""
        return [n for n in path if n in self.column.get(row, {})]

    def keep(self, kept: dict[int, list[int]]) -> None:
        columns = [[self.column[row][n] for n in kept.get(row, [])] for row in range(len(self.lengths))]
        self.cache.keep_columns(self.start, columns)


class _StaticFeed:
    """Feeds a depth's frontier over the drafter's `StaticRowCache`, whose new slots see only the KV before a
    row's length and the forward's own: each forward feeds the frontier with its ancestors again, and the
    heaviest path as far as it was fed (the KV the cache keeps at the end, `keep`), as a tree layout after
    the committed tokens (`forward_static` with trees), and is rolled back before the next: at most
    width x depth + depth positions a row. On a GPU a forward of a few dozen positions costs what one does;
    on a CPU the planner learns what the drafter's steps cost."""

    def __init__(self, drafter):
        self.drafter, self.cache = drafter, drafter.cache
        self.lengths = self.cache.lengths  # [B]; the root (last committed token) at length - 1
        self.ever: dict[int, set[int]] = {}  # row -> every node fed so far
        self.fed: dict[int, list[int]] = {}  # row -> the nodes of the last forward, in its slot order

    def __call__(self, trees: dict, nodes_of: dict[int, list[int]], depth: int):
        """As `_ColumnFeed`'s (the slots returned are the frontier's, among the nodes fed beside them)."""
        self.cache.rollback(self.lengths)
        chunks: list[list[int]] = [[] for _ in self.lengths]
        layouts: list = [None] * len(self.lengths)
        for row, nodes in nodes_of.items():
            self.ever.setdefault(row, set()).update(nodes)
        self.fed = {}
        for row in self.ever:  # a row whose tree stopped growing still feeds its heaviest path, to keep its KV
            tree, wanted = trees[row], nodes_of.get(row, []) + _prefix_in(_heaviest_path(trees[row]), self.ever[row])
            fed = sorted({a for n in wanted for a in tree.path(n)})  # ancestors first: node ids grow by depth
            paths = [set(tree.path(n)) for n in fed]
            visible = torch.tensor([[m in path for m in fed] for path in paths], dtype=torch.bool)  # [n, n]
            layouts[row] = ([len(p) - 1 for p in paths], visible)  # a depth-d node at position length - 1 + d
            chunks[row] = [tree.tokens[n] for n in fed]
            self.fed[row] = fed
        logits = self.drafter._forward_static(chunks, layouts)  # [B, T, V_draft]
        return logits, {row: [self.fed[row].index(n) for n in nodes] for row, nodes in nodes_of.items()}

    def held(self, row: int, path: list[int]) -> list[int]:
        """The longest prefix of `path` the last forward fed."""
        return _prefix_in(path, set(self.fed.get(row, ())))

    def keep(self, kept: dict[int, list[int]]) -> None:
        if not self.fed:  # nothing fed: the cache holds the committed tokens alone
            return
        paths = [[self.fed[row].index(n) for n in kept.get(row, [])] for row in range(len(self.lengths))]
        self.cache.keep_paths([n - 1 for n in self.lengths], paths)


def _prefix_in(path: list[int], nodes: set[int]) -> list[int]:
    """The longest prefix of `path` within `nodes` (a set closed under ancestors holds a prefix of each path)."""
    prefix = []
    for n in path:
        if n not in nodes:
            break
        prefix.append(n)
    return prefix


def _heaviest_path(tree: TokenTree) -> list[int]:
    """The nodes from the root down, taking the heaviest child (ties: the earlier) at each node."""
    path, node = [], -1
    while (node := tree.heaviest_child(node)) is not None:
        path.append(node)
    return path
