"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the row's last n-gram.

No model, no state: a deterministic proposal (q is one-hot at the draft, see verification.py).
Example: sequence [a b c d a b] with max_ngram 2 finds "a b" at 0 and proposes [c d a b][:k].
"""

from __future__ import annotations

import torch

from .base import Draft, Drafter, DraftRequest


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"
    kind = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram  # longer matches are rarer but more reliable; tried first
        self.min_ngram = min_ngram

    def draft(self, request: DraftRequest) -> Draft:
        found = [self.find(request.sequences[row], k) for row, k in zip(request.rows, request.k)]
        return Draft(tokens=[t for t, _ in found], q=[None] * len(found), match_lengths=[n for _, n in found])

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest trailing n-gram."""
        return self.find(sequence, k)[0]

    def find(self, sequence: list[int], k: int) -> tuple[list[int], int]:
        """(`lookup`'s draft, the length n of the n-gram it continues; 0 without a match)."""
        if k <= 0:
            return [], 0
        seq = torch.tensor(sequence)  # [L]
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [L - n, n] every n-gram that has a successor
            hits = (windows == seq[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n  # latest match, first token after it
                return sequence[start : start + k], n
        return [], 0
