"""Suffix drafting: propose the most frequent continuations of the row's longest suffix match, in its
own prompt and output so far and in the outputs of earlier requests (SuffixDecoding, arXiv 2411.04975).

No model: a deterministic proposal (q one-hot, see verification.py), free to draft, so it pays where
model drafting cannot (CPUs, large batches, a busy server) and wherever text repeats: multi-turn
rewrites, agent loops with the same schemas, code edits, answers quoting their context.

Two suffix indexes (hf_spin/drafters/suffix_index.py) serve each row: its own (prompt + committed tokens,
extended as tokens commit, dropped when the row ends; a `SequenceIndex`, scanned, so admitting a long prompt costs
a copy) and the drafter's global one (the outputs of
the rows that ended, kept across `generate` calls and server requests, the oldest evicted past
`max_requests` or `max_tokens`; `reset()` empties it). For a row the drafter finds each index's
longest suffix match (at most max_depth - k tokens, so k tokens fit below it), takes its likeliest
continuations best-first by estimated path probability (counts over the sibling counts), at most k
nodes, none below `min_probability`, at most `spec_factor` x the match length deep (a short match is
a weak signal), and proposes the index's whose expected accepted tokens (the sum of its path
probabilities) is larger. As a chain: the most frequent child at each depth; as a token tree
(`DraftRequest.trees`): the k likeliest nodes, node weight = path probability.

Example: earlier outputs [.. { " name " : " A " } ..] and [.. { " name " : " B " } ..]; a row ending
in `{ " name` drafts `" : "` then branches to A and B, each at probability 1/2.
"""

from __future__ import annotations

import itertools
import math

from ..verify.token_tree import TokenTree
from .base import Draft, Drafter, DraftRequest
from .suffix_index import SequenceIndex, SuffixIndex


class SuffixDrafter(Drafter):
    name = "suffix"
    kind = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        max_requests: int = 1000,
        max_tokens: int = 200_000,
        min_probability: float = 0.1,
        spec_factor: float = 1.0,
    ):
        if max_requests < 0 or max_tokens < 0:
            raise ValueError(f"max_requests and max_tokens must be >= 0, got {max_requests} and {max_tokens}")
        if not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"min_probability must be in [0, 1], got {min_probability}")
        if spec_factor <= 0:
            raise ValueError(f"spec_factor must be positive, got {spec_factor}")
        self.max_depth = max_depth  # substring length indexed: a match plus the draft below it
        self.max_requests = max_requests  # earlier requests held in the global index
        self.max_tokens = max_tokens  # tokens held in the global index (memory: up to max_depth nodes each)
        self.min_probability = min_probability
        self.spec_factor = spec_factor
        self.index = SuffixIndex(max_depth)  # earlier requests' outputs, across calls
        self._keys = itertools.count()
        self._rows: list[SequenceIndex] = []  # per row of the running batch: its own prompt + output

    def draft(self, request: DraftRequest) -> Draft:
        tokens, trees, matches = [], [], []
        for row, k in zip(request.rows, request.k):
            sequence, own = request.sequences[row], self._rows[row]
            own.extend(0, sequence[own.length(0) :])  # catch up on the committed tokens
            found = [self.propose(index, sequence, k, request.trees) for index in (own, self.index)]
            chain, tree, match = max(found, key=lambda f: sum(f[1].weights))
            tokens.append(chain)
            trees.append(tree if any(len(tree.children(n)) > 1 for n in range(-1, len(tree))) else None)
            matches.append(match)
        return Draft(
            tokens=tokens, q=[None] * len(tokens), match_lengths=matches, trees=trees if request.trees else None
        )

    def propose(
        self, index: SuffixIndex | SequenceIndex, sequence: list[int], k: int, branching: bool
    ) -> tuple[list[int], TokenTree, int]:
        """(the likeliest chain, the proposal as a tree: the chain again unless `branching`, the length
        of the match it continues, 0 without one) for a row's sequence from one index, k nodes at most."""
        empty = ([], TokenTree(), 0)
        if k <= 0:
            return empty
        match = index.longest_match(sequence, max_length=max(1, self.max_depth - k))
        if match is None:
            return empty
        depth = min(k, max(1, math.floor(self.spec_factor * match.length)), self.max_depth - match.length)
        chain = index.continuations(match, k, depth, self.min_probability, branching=False)
        nodes = index.continuations(match, k, depth, self.min_probability) if branching else chain
        tree = TokenTree()
        for token, parent, probability in nodes:
            tree.add(parent, token, weight=probability)
        return [t for t, _, _ in chain], tree, match.length

    # -- per-row state and learning ------------------------------------------------------------------

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        self._rows = [self._own(s) for s in sequences]

    def add_rows(self, sequences: list[list[int]]) -> None:
        self._rows = self._rows + [self._own(s) for s in sequences]  # rebound, not grown: pipeline lanes copy drafters

    def select_rows(self, rows) -> None:
        self._rows = [self._rows[i] for i in rows.tolist()]

    def end_rows(self, rows: list[int], outputs: list[list[int]]) -> None:
        for tokens in outputs:
            self.learn(tokens)

    def finish(self) -> None:
        self._rows = []

    def _own(self, sequence: list[int]) -> SequenceIndex:
        index = SequenceIndex(self.max_depth)
        index.extend(0, sequence)
        return index

    def learn(self, tokens: list[int]) -> None:
        """Add one request's output to the global index, then evict the oldest requests until at most
        max_requests and max_tokens are held (an output longer than max_tokens keeps its end)."""
        if not tokens or not self.max_requests or not self.max_tokens:
            return
        self.index.extend(next(self._keys), list(tokens[-self.max_tokens :]))
        self.index.evict(self.max_requests, self.max_tokens)

    def reset(self) -> None:
        """Forget every earlier request (the global index); running rows keep their own."""
        self.index.clear()
