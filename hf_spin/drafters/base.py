"""The drafter interface: mechanism only, no heuristics (the policy chooses who drafts and how much).

A drafter proposes up to k tokens per row, in the target's vocabulary, for the rows the engine
hands it. It keeps whatever state it needs per row (a KV cache, a translated prefix); every request carries
the rows' committed sequences, from which it finds what to roll back and what to catch up on.
A drafter never mutates a model it was given: one drafter object may serve many `generate` calls
and several pools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

# Scores logits the way the target's are scored: (row, committed prefix ids, scores [V]) -> [V].
ScoreFn = Callable[[int, list[int], torch.Tensor], torch.Tensor]


@dataclass
class DraftRequest:
    """What the engine asks of a drafter for one step.

    rows: [b] positions of the served rows in the drafter's batch (0..B-1 of the active batch).
    sequences: B lists of committed token ids (prompt without padding + generated), all rows.
    k: [b] draft length per served row.
    do_sample: draw from q (and return it) instead of taking its argmax.
    score: the target's logits processors, applied to draft logits too; None when there are none.
    """

    rows: list[int]
    sequences: list[list[int]]
    k: list[int]
    do_sample: bool
    score: ScoreFn | None


@dataclass
class Draft:
    """Proposed tokens for the served rows, in the target vocabulary."""

    tokens: list[list[int]]  # b lists, row i has at most k[i] tokens
    q: list[torch.Tensor | None]  # per row [len(tokens[i]), V_target] draft probabilities, or None (one-hot)


class Drafter(ABC):
    """Base class of every drafter kind."""

    name: str = "drafter"

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        """Begin a `generate` call over B rows with these prompts (the rows' initial sequences).

        target_cache: the target's `RaggedCache` right after its prefill (every committed token but the
        last). A drafter that runs the target's own weights may copy from it (streaming.py does), never
        change it.
        """

    @abstractmethod
    def draft(self, request: DraftRequest) -> Draft:
        """Propose tokens for `request.rows`."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (others finished); indices into the current batch."""

    def finish(self) -> None:
        """Free per-call state."""
