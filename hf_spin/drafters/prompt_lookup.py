"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the row's last n-gram.

No model, no state: a deterministic proposal (q is one-hot at the draft, see verification.py).
Example: sequence [a b c d a b] with max_ngram 2 finds "a b" at 0 and proposes [c d a b][:k].

When the step verifies token trees (`DraftRequest.trees`), distinct continuations of the matches
become branches (at most `max_branches`: the longest n-gram's matches, latest first, then shorter
n-grams'), each node weighing the n-gram lengths of the matches through it: [a b x a b y a b] with
max_ngram 2 proposes [y a b] and [x a b ...] as two branches of one tree.
"""

from __future__ import annotations

from array import array

from ..verify.token_tree import TokenTree
from .base import Draft, Drafter, DraftRequest

WORD = next(t for t in "il" if array(t).itemsize == 4)  # a signed 4-byte word: any vocabulary's ids


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"
    kind = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_branches: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_branches < 1:
            raise ValueError(f"max_branches must be at least 1, got {max_branches}")
        self.max_ngram = max_ngram  # longer matches are rarer but more reliable; tried first
        self.min_ngram = min_ngram
        self.max_branches = max_branches  # distinct continuations in a tree (the latest matches)

    def draft(self, request: DraftRequest) -> Draft:
        found = [
            self.find_all(request.sequences[row], k, self.max_branches if request.trees else 1)
            for row, k in zip(request.rows, request.k)
        ]
        return Draft(
            tokens=[branches[0][0] if branches else [] for branches, _ in found],
            q=[None] * len(found),
            match_lengths=[n for _, n in found],
            trees=[_tree(branches) if len(branches) > 1 else None for branches, _ in found] if request.trees else None,
        )

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest trailing n-gram."""
        return self.find(sequence, k)[0]

    def find(self, sequence: list[int], k: int) -> tuple[list[int], int]:
        """(`lookup`'s draft, the length n of the n-gram it continues; 0 without a match)."""
        branches, n = self.find_all(sequence, k, 1)
        return (branches[0][0] if branches else []), n

    def find_all(self, sequence: list[int], k: int, branches: int) -> tuple[list[tuple[list[int], int]], int]:
        """(up to `branches` distinct continuations of k tokens, each with the length of the n-gram it
        continues: the longest trailing n-gram's matches first, latest match first, then shorter
        n-grams'; the longest n matched, 0 without a match)."""
        found: list[tuple[list[int], int]] = []
        if k <= 0:
            return found, 0
        # the tokens as 4-byte words: bytes.rfind scans for an n-gram in C, latest first; a hit off a word boundary
        # straddles two tokens and is skipped (a tensor of the list cost ~0.2 us a token, every row every step)
        words = array(WORD, sequence).tobytes()  # [4 L]
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            ngram = words[-4 * n :]
            end = len(words) - 4  # an n-gram with a successor lies in the first L - 1 tokens
            while (at := words.rfind(ngram, 0, end)) >= 0:
                end = at + 4 * n - 1  # the next search: hits starting before this one
                if at % 4:
                    continue
                hit = at // 4
                continuation = sequence[hit + n : hit + n + k]
                if all(continuation != c for c, _ in found):
                    found.append((continuation, n))
                    if len(found) == branches:
                        return found, found[0][1]
        return found, found[0][1] if found else 0


def _tree(branches: list[tuple[list[int], int]]) -> TokenTree:
    """The continuations as one tree, shared prefixes merged; a node weighs the n-gram lengths of the
    matches through it (longer matches are the more reliable drafts, kept first when a tree is cut)."""
    return TokenTree.merge([TokenTree.chain(tokens, weight=n) for tokens, n in branches])
