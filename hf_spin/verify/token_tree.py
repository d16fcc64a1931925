"""Token trees: a row's draft as a tree of candidate tokens, verified in one target forward.

A row's draft is a tree rooted at the row's last committed token (the root is not a node). Node i
holds a token, its parent (-1: the root), the drafter that proposed it and a weight (the sum of the
weights of the drafters whose drafts pass through it, docs/design.md "vote"). Nodes are stored
parent before child, so node order is a valid order to feed the target; a chain is a tree whose
node i has parent i - 1.

Each node also says how its token was proposed, which is what sampled verification needs
(tree_verification.py):

- `q[i]` None: a deterministic proposal given the path to the node (prompt lookup, token translation,
  a vote, a model drafter's top-k children): verification reads it as one-hot at the token.
- `q[i]` a `[V]` tensor: the token was drawn from that distribution, a fresh draw given the path
  (a model drafter sampling several children of a node draws them independently, with replacement).
  A token drawn twice is one node (the target scores it once) but two candidates: `order` lists the
  nodes in the order they were proposed, a sampled node once per draw, and sampled verification
  tries them in that order (reordering draws by what they drew would bias it).

Nodes with the same token under the same parent merge when both are deterministic (a second
deterministic proposal of a token the target already rejected there changes nothing) or both were
drawn by the same drafter; otherwise they stay apart, each with its own proposal.

Example, two drafters' chains [a, b] and [a, c], merged with weights 1 and 1:

    tokens  [a, b, c]        root -> a (2) -> b (1)
    parents [-1, 0, 0]                     -> c (1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)  # [N] candidate token per node
    parents: list[int] = field(default_factory=list)  # [N] parent node, -1: the root (last committed token)
    drafters: list[int] = field(default_factory=list)  # [N] index of the (first) drafter that proposed the node
    weights: list[float] = field(default_factory=list)  # [N] summed weight of the drafters through the node
    q: list[torch.Tensor | None] = field(
        default_factory=list
    )  # [N] the [V] distribution the token was drawn from, or None
    order: list[int] = field(default_factory=list)  # node indices in proposal order, a sampled node once per draw

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(
        cls, tokens: list[int], q: torch.Tensor | None = None, drafter: int = 0, weight: float = 1.0
    ) -> TokenTree:
        """A chain draft: node i follows node i - 1. q: `[len(tokens), V]` draft distributions, or None."""
        n = len(tokens)
        return cls(
            tokens=list(tokens),
            parents=list(range(-1, n - 1)),
            drafters=[drafter] * n,
            weights=[weight] * n,
            q=[q[i] for i in range(n)] if q is not None else [None] * n,
            order=list(range(n)),
        )

    def add(self, parent: int, token: int, drafter: int = 0, weight: float = 1.0, q: torch.Tensor | None = None) -> int:
        """Propose `token` as a child of `parent` (-1: the root); returns its node. A token the parent
        already has from a proposal it merges with (module docstring) adds its weight there, and a
        sampled one counts as another draw in `order`."""
        node, new = self._node(parent, token, drafter, weight, q)
        if new or q is not None:
            self.order.append(node)
        return node

    def _node(self, parent: int, token: int, drafter: int, weight: float, q: torch.Tensor | None) -> tuple[int, bool]:
        """The node for this proposal, made if the parent has none it merges with: (index, made)."""
        if not -1 <= parent < len(self):
            raise ValueError(f"parent {parent} is not a node of a tree of {len(self)} nodes (-1 is the root)")
        for i in self.children(parent):
            same = self.q[i] is None if q is None else (self.q[i] is not None and self.drafters[i] == drafter)
            if self.tokens[i] == token and same:
                self.weights[i] += weight
                return i, False
        self.tokens.append(token)
        self.parents.append(parent)
        self.drafters.append(drafter)
        self.weights.append(weight)
        self.q.append(q)
        return len(self) - 1, True

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is `node` (-1: the root's), in the order they were added."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def candidates(self, node: int) -> list[int]:
        """The children of `node` as sampled verification tries them: proposal order, a sampled node
        once per draw."""
        return [i for i in self.order if self.parents[i] == node]

    def heaviest_child(self, node: int) -> int | None:
        """The child of `node` (-1: the root) a chain draft would hold: the heaviest, the earlier of equals (a
        drafter's own chain, `Draft.tokens`, is its tree's heaviest path); None for a leaf."""
        kids = self.children(node)
        return max(kids, key=lambda c: (self.weights[c], -c)) if kids else None

    def beside_the_heaviest(self, path: list[int]) -> bool | None:
        """Where the accepted `path` (nodes from the root's child down) first leaves the heaviest path, or stops
        short of its leaf: whether a sibling of the heaviest child there was accepted (True: the path goes on
        through one; False: it stops), or None where that node had no other child to offer, or the heaviest
        path was accepted whole. What a tree's alternatives earn beside its chain (`Acceptance`)."""
        node = -1
        for step in path + [None]:
            top = self.heaviest_child(node)
            if top is None:
                return None
            if step != top:
                return None if len(self.children(node)) < 2 else step is not None
            node = step
        return None

    def depths(self) -> list[int]:
        """[N] 1 for the root's children, 2 below them, ...: the node's position after the last committed token."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """`[N + 1, N + 1]` bool: entry [i, j] is True iff slot j is slot i or one of its ancestors, where
        slot 0 is the root (the last committed token, fed with the nodes) and slot i + 1 is node i: the
        attention mask among a row's new tokens in one verification forward (each sees its own path)."""
        n = len(self)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] |= mask[p + 1]
        return mask

    def pruned(self, n: int, by: list[float] | None = None) -> TokenTree:
        """The n heaviest nodes (ties: the earlier node), with their proposal order; `by`: [N] another
        score per node to rank by (the planner's estimated acceptance). A node weighs at least as much
        as each of its children in a merged tree (every drafter through a child passes its parent), so
        the kept nodes hold every kept node's parent; `by` must not grow from parent to child either."""
        if n >= len(self):
            return self
        score = self.weights if by is None else by
        keep = sorted(sorted(range(len(self)), key=lambda i: (-score[i], i))[:n])
        new = {old: i for i, old in enumerate(keep)}
        if any(self.parents[i] >= 0 and self.parents[i] not in new for i in keep):
            raise ValueError("pruned() needs node scores that do not grow from parent to child")
        return TokenTree(
            tokens=[self.tokens[i] for i in keep],
            parents=[new.get(self.parents[i], -1) for i in keep],
            drafters=[self.drafters[i] for i in keep],
            weights=[self.weights[i] for i in keep],
            q=[self.q[i] for i in keep],
            order=[new[i] for i in self.order if i in new],
        )

    @classmethod
    def merge(cls, trees: list[TokenTree], weights: list[float] | None = None) -> TokenTree:
        """One tree holding every tree's nodes; nodes with the same token under the same parent (and the
        same kind of proposal) become one, weighing the sum of the trees' weights through it.
        weights: per tree (default 1 each), multiplying that tree's node weights. Each tree's proposal
        order is kept, the trees' one after another."""
        weights = weights if weights is not None else [1.0] * len(trees)
        out = cls()
        for tree, w in zip(trees, weights):
            where: list[int] = []  # this tree's node -> node of the merged tree
            for i in range(len(tree)):
                parent = where[tree.parents[i]] if tree.parents[i] >= 0 else -1
                where.append(out._node(parent, tree.tokens[i], tree.drafters[i], w * tree.weights[i], tree.q[i])[0])
            for i in tree.order:  # a sampled node once per draw, a deterministic one once
                if tree.q[i] is not None or where[i] not in out.order:
                    out.order.append(where[i])
        return out
