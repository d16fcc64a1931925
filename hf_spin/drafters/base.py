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

# Scores logits the way the target's are scored, one position of several rows at once:
# (rows [n], each row's committed + drafted ids [n], logits [n, V]) -> scores [n, V].
ScoreFn = Callable[[list[int], list[list[int]], torch.Tensor], torch.Tensor]


@dataclass
class DraftRequest:
    """What the engine asks of a drafter for one step.

    rows: [b] positions of the served rows in the drafter's batch (0..B-1 of the active batch).
    sequences: B lists of committed token ids (prompt without padding + generated), all rows.
    k: [b] draft length per served row.
    do_sample: draw from q (and return it) instead of taking its argmax.
    score: the target's logits processors, applied to draft logits too; None when there are none.
    min_confidence: stop a row's draft after a token whose draft probability is below this (the
        token itself is kept, as in `transformers`' assistant_confidence_threshold); 0 never stops.
    """

    rows: list[int]
    sequences: list[list[int]]
    k: list[int]
    do_sample: bool
    score: ScoreFn | None
    min_confidence: float = 0.0
    sample: list[bool] | None = None  # [b] per served row when rows differ (do_sample is then True: some row samples)
    trees: bool = False  # the step verifies token trees: a drafter that can may also propose one per row (Draft.trees)


@dataclass
class Draft:
    """Proposed tokens for the served rows, in the target vocabulary."""

    tokens: list[list[int]]  # b lists, row i has at most k[i] tokens
    q: list[torch.Tensor | None]  # per row [len(tokens[i]), V_target] draft probabilities, or None (one-hot)
    # per row, how many trailing tokens of the sequence the draft's source matched (prompt lookup: the
    # n-gram found earlier; a longer match is a more reliable draft); None: no such notion (model drafters)
    match_lengths: list[int | None] | None = None
    # per row, a token tree of several candidates per position (hf_spin.verify.token_tree) whose first path is
    # `tokens`; None: the chain only. Asked for by DraftRequest.trees.
    trees: list | None = None


class Drafter(ABC):
    """Base class of every drafter kind."""

    name: str = "drafter"
    kind: str = "drafter"  # short kind name shown to policies (DrafterInfo.kind)
    gives_q: bool = False  # returns draft probabilities when sampling (else a one-hot proposal)
    num_parameters: int = 0  # size, for policies that order drafters by it

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        """Begin a `generate` call over B rows with these prompts (the rows' initial sequences).

        target_cache: the target's cache right after its prefill (every committed token but the last): a
        `RectangularCache`, or the layout's `PackedCache` or `StaticRowCache`. A drafter that runs the
        target's own weights may copy from it (streaming.py does), never change it. For an encoder-decoder
        target its `encoder` holds each row's encoder input and output, and rows joining later are appended
        to it before `add_rows` (encoder_decoder.py reads them there).
        """

    @abstractmethod
    def draft(self, request: DraftRequest) -> Draft:
        """Propose tokens for `request.rows`."""

    def synced(self, row: int) -> int | None:
        """How many of the row's committed tokens this drafter's state covers (it catches up on the
        rest before drafting); None for a drafter without per-row state (nothing to catch up)."""
        return None

    def unencoded(self, row: int) -> bool:
        """Whether this drafter's own encoder has yet to read the row's encoder input (it runs before the
        drafter's first catch-up of the row: encoder_decoder.py); the planner prices it."""
        return False

    def catch_up(self, rows: list[int], sequences: list[list[int]]) -> None:
        """Feed `rows`' committed tokens this drafter has not seen, without drafting (fast switching);
        no-op by default."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (others finished); indices into the current batch, a CPU tensor."""

    def add_rows(self, sequences: list[list[int]]) -> None:
        """Rows join the running batch after the current ones, with these committed sequences
        (continuous batching). A drafter with per-row state grows it here, as `select_rows` shrinks it."""

    def end_rows(self, rows: list[int], outputs: list[list[int]]) -> None:
        """Rows at these positions of the current batch ended (before `select_rows` or `finish` drops
        them) having generated `outputs` (rows that failed are left out). A drafter that learns
        across requests (suffix.py) learns here; no-op by default."""

    def reset(self) -> None:
        """Forget what was learned across calls (`AssistantPool.reset`); no-op by default."""

    def finish(self) -> None:
        """Free per-call state."""
