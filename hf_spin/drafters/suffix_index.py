"""A suffix index: every substring of up to `max_depth` tokens of the sequences it holds, with counts,
so the continuations of any context are read off by frequency (docs/design.md, "suffix index").

The structure is a depth-bounded suffix trie, the one SuffixDecoding (arXiv 2411.04975) uses: a node
is a substring, its count how many times it occurs in the held sequences, its children the tokens
that followed it. Chosen over the alternatives on purpose:

- a suffix automaton has O(1) amortised states per token but no cheap removal (evicting a request
  means rebuilding) and its counts need a separate pass;
- a suffix array needs a rebuild (or a dynamic structure) per committed token;
- the bounded trie costs `max_depth` node updates per token (constant in the sequence's length),
  removes a sequence by undoing exactly what adding it did, and answers "what followed this context,
  how often" by walking at most `max_depth` nodes. Memory is at most `max_depth` nodes per token held
  (shared where text repeats; about 1.5 KB a token of text that does not repeat at max_depth 24),
  which is why an index holds a bounded number of tokens. (A path-compressed suffix tree would hold
  O(1) nodes a token, at the price of splitting and merging edges on every update and removal.)

Example, one sequence [a b a c] and max_depth 2: nodes a (2), a.b (1), a.c (1), b (1), b.a (1),
c (1); after the context [.. a] the index proposes b and c, each with probability 1/2.

A row's own prompt and output is one sequence read while it grows: `SequenceIndex` answers the same two
queries over it by scanning the tokens in C (as prompt lookup does) and building a trie only of the matched
context's continuations, so admitting a 600-token prompt costs a copy, not the ~14k node updates (~40 ms of
Python) a trie of depth 24 takes: on a GPU whose step takes 5 ms that was eight steps a request.

Every public method of `SuffixIndex` holds the index's lock: one index may be read and written from several threads
(a server's requests, several pools sharing a drafter).
"""

from __future__ import annotations

import collections
import heapq
import threading
from array import array
from dataclasses import dataclass

from .prompt_lookup import WORD


class _Node:
    """A substring: its last token, its count, and the tokens that followed it. Most nodes have one
    child (text that occurred once below some point), so children are None, the one child itself,
    or a dict token -> child only where the text went two ways: a third of a dict's memory."""

    __slots__ = ("token", "count", "children")

    def __init__(self, token: int | None = None):
        self.token = token
        self.count = 0  # occurrences of the substring this node spells
        self.children: _Node | dict[int, _Node] | None = None

    def child(self, token: int) -> _Node | None:
        kids = self.children
        if kids is None or type(kids) is _Node:
            return kids if kids is not None and kids.token == token else None
        return kids.get(token)

    def kids(self) -> list[_Node]:
        kids = self.children
        return [] if kids is None else [kids] if type(kids) is _Node else list(kids.values())

    def add(self, token: int) -> _Node:
        """A new child for `token` (which the node does not have yet)."""
        new, kids = _Node(token), self.children
        if kids is None:
            self.children = new
        elif type(kids) is _Node:
            self.children = {kids.token: kids, token: new}
        else:
            kids[token] = new
        return new

    def drop(self, token: int) -> None:
        kids = self.children
        if type(kids) is _Node:
            self.children = None
        else:
            del kids[token]
            if len(kids) == 1:
                self.children = next(iter(kids.values()))


@dataclass
class Match:
    """The longest suffix of a context found in an index with a continuation: its node and length."""

    node: _Node
    length: int


class SuffixIndex:
    """Sequences under keys, indexed for continuation lookup. Sequences grow (`extend`) and leave whole
    (`remove`); `keys()` lists them oldest first, for eviction."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2 (a match and one token after it), got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 0  # nodes besides the root: the index's memory, about 60 bytes each
        self.tokens = 0  # tokens held over all sequences
        self._sequences: collections.OrderedDict[object, list[int]] = collections.OrderedDict()
        self._open: dict[object, list[_Node]] = {}  # key -> the nodes of its suffixes shorter than max_depth, by length
        self._lock = threading.RLock()

    def keys(self) -> list:
        with self._lock:
            return list(self._sequences)

    def __len__(self) -> int:
        return len(self._sequences)

    def length(self, key) -> int:
        """Tokens held under `key` (0 if none)."""
        with self._lock:
            return len(self._sequences.get(key, ()))

    def extend(self, key, tokens: list[int]) -> None:
        """Append tokens to the sequence under `key` (a new key starts one): each token adds one
        occurrence to the node of every suffix of up to max_depth tokens ending at it."""
        with self._lock:
            sequence = self._sequences.setdefault(key, [])
            suffixes = self._open.get(key, [])  # [i]: the node of the suffix of length i + 1
            for token in tokens:
                suffixes = [self._grow(node, token) for node in [self.root] + suffixes[: self.max_depth - 1]]
                sequence.append(token)
            self._open[key] = suffixes
            self.tokens += len(tokens)

    def _grow(self, node: _Node, token: int) -> _Node:
        child = node.child(token)
        if child is None:
            child = node.add(token)
            self.nodes += 1
        child.count += 1
        return child

    def remove(self, key) -> None:
        """Forget the sequence under `key`: every occurrence it added is taken back, and nodes left
        with none are deleted (with their subtrees, whose only occurrences were this sequence's)."""
        with self._lock:
            sequence = self._sequences.pop(key, None)
            self._open.pop(key, None)
            if sequence is None:
                return
            for start in range(len(sequence)):
                node = self.root
                for token in sequence[start : start + self.max_depth]:
                    child = node.child(token)
                    child.count -= 1
                    if child.count == 0:
                        node.drop(token)
                        self.nodes -= _size(child)
                        break
                    node = child
            self.tokens -= len(sequence)

    def evict(self, max_keys: int, max_tokens: int) -> None:
        """Remove the oldest sequences until at most `max_keys` sequences and `max_tokens` tokens remain."""
        with self._lock:
            while self._sequences and (len(self._sequences) > max_keys or self.tokens > max_tokens):
                self.remove(next(iter(self._sequences)))

    def clear(self) -> None:
        with self._lock:
            self.root, self.nodes, self.tokens = _Node(), 0, 0
            self._sequences.clear()
            self._open.clear()

    def longest_match(self, context: list[int], max_length: int, min_length: int = 1) -> Match | None:
        """The longest suffix of `context`, of min_length..max_length tokens, that occurs in the index
        followed by some token; None if there is none."""
        with self._lock:
            for length in range(min(max_length, len(context), self.max_depth - 1), min_length - 1, -1):
                node = self.root
                for token in context[len(context) - length :]:
                    node = node.child(token)
                    if node is None:
                        break
                else:
                    if node.children:
                        return Match(node, length)
            return None

    def continuations(
        self, match: Match, max_nodes: int, max_depth: int, min_probability: float, branching: bool = True
    ) -> list[tuple[int, int, float]]:
        """The likeliest continuations of a match as tree nodes (token, parent index or -1, probability
        of the path from the match through the node), parents first: nodes taken best-first by path
        probability, at most `max_nodes`, `max_depth` deep, none below `min_probability`. A child's
        probability given its parent is its count over its siblings' (the occurrences that continued).
        branching=False: the single likeliest chain (the most frequent child each time)."""
        with self._lock:
            return _best_first(match.node, max_nodes, max_depth, min_probability, branching)

    def check(self) -> None:
        """Raise if the counts differ from an index rebuilt from the held sequences (tests)."""
        with self._lock:
            fresh = SuffixIndex(self.max_depth)
            for key, sequence in self._sequences.items():
                fresh.extend(key, sequence)
            assert _counts(self.root) == _counts(fresh.root), "suffix index counts differ from a rebuild"
            assert (self.nodes, self.tokens) == (fresh.nodes, fresh.tokens), (
                (self.nodes, self.tokens),
                (fresh.nodes, fresh.tokens),
            )


class SequenceIndex:
    """One growing sequence (a suffix drafter's row: its prompt and committed tokens) answering `SuffixIndex`'s
    queries with the same answers, built in a copy a token (module docstring): `longest_match` searches the tokens,
    as 4-byte words, for the context's suffixes (a suffix that occurs followed by a token implies every shorter one
    does, so the longest is found by bisection), and `continuations` counts what followed each occurrence of the
    match in a small trie, read best-first as the index's own. `key` is accepted and ignored (one sequence).
    A query costs a scan and the match's occurrences times the draft's depth: on 4,000 tokens repeating one 20-token
    phrase, 0.43 ms where the trie answers in 0.02 ms after a 24 ms build (AMD EPYC, Python 3.11), so it stays the
    cheaper for requests of under ~50 steps on the most repetitive text and for any length on ordinary text."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2 (a match and one token after it), got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.words = bytearray()  # [4 L] the tokens as 4-byte words

    def length(self, key=None) -> int:
        return len(self.tokens)

    def extend(self, key, tokens: list[int]) -> None:
        self.tokens += tokens
        self.words += array(WORD, tokens).tobytes()

    def longest_match(self, context: list[int], max_length: int, min_length: int = 1) -> SequenceMatch | None:
        """The longest suffix of `context`, of min_length..max_length tokens (and under max_depth), that occurs
        in the sequence followed by some token; None if there is none."""
        words = array(WORD, context[-max_length:] if max_length > 0 else []).tobytes()  # [4 max_length]
        lo, hi, found = min_length, min(max_length, len(context), self.max_depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            starts = self._starts(words[len(words) - 4 * mid :], first=True)
            if starts:
                lo, found = mid + 1, mid
            else:
                hi = mid - 1
        return SequenceMatch(found, words[len(words) - 4 * found :]) if found else None

    def continuations(
        self, match: SequenceMatch, max_nodes: int, max_depth: int, min_probability: float, branching: bool = True
    ) -> list[tuple[int, int, float]]:
        """`SuffixIndex.continuations` of the same match over this sequence: the tokens after every occurrence
        of the match (in order, so children are met in the index's order), counted in a trie below it."""
        depth = min(max_depth, self.max_depth - match.length)
        root = _Node()
        for start in self._starts(match.words):
            node = root
            for token in self.tokens[start + match.length : start + match.length + depth]:
                node = node.child(token) or node.add(token)
                node.count += 1
        return _best_first(root, max_nodes, depth, min_probability, branching)

    def _starts(self, pattern: bytes, first: bool = False) -> list[int]:
        """Token positions where `pattern` (whole tokens) occurs followed by a token, in order (first: the
        first alone)."""
        starts, at, end = [], 0, 4 * len(self.tokens) - 4  # an occurrence with a successor ends by the last token
        while (at := self.words.find(pattern, at, end)) >= 0:
            if at % 4 == 0:  # a hit off a word boundary straddles two tokens
                starts.append(at // 4)
                if first:
                    break
            at += 1
        return starts


@dataclass
class SequenceMatch:
    """`SequenceIndex`'s longest match: its length and its tokens as 4-byte words."""

    length: int
    words: bytes


def _best_first(
    match: _Node, max_nodes: int, max_depth: int, min_probability: float, branching: bool
) -> list[tuple[int, int, float]]:
    """`SuffixIndex.continuations` below the node `match` (its children and their counts)."""
    out: list[tuple[int, int, float]] = []
    tick = 0  # ties broken by discovery order: deterministic
    frontier: list[tuple[float, int, _Node, int, int]] = []  # (-probability, tick, node, parent, depth)

    def expand(node: _Node, parent: int, probability: float, depth: int) -> None:
        nonlocal tick
        if depth >= max_depth or not node.children:
            return
        kids = node.kids()
        total = sum(c.count for c in kids)
        for child in kids if branching else [max(kids, key=lambda c: c.count)]:
            p = probability * child.count / total
            if p >= min_probability:
                heapq.heappush(frontier, (-p, tick, child, parent, depth + 1))
                tick += 1

    expand(match, -1, 1.0, 0)
    while frontier and len(out) < max_nodes:
        neg_p, _, node, parent, depth = heapq.heappop(frontier)
        out.append((node.token, parent, -neg_p))
        expand(node, len(out) - 1, -neg_p, depth)
    return out


def _size(node: _Node) -> int:
    """Nodes in the subtree under and including `node`."""
    return 1 + sum(_size(c) for c in node.kids())


def _counts(node: _Node, path: tuple = ()) -> dict[tuple, int]:
    out = {path: node.count} if path else {}
    for child in node.kids():
        out.update(_counts(child, path + (child.token,)))
    return out
