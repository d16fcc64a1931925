"""What LBSS remembers: per request a `RowState` with one `Arm` per drafter, and the policy-wide
state (`LBSSState`) that the parts of `LBSSPolicy` (pricing, schedule, matching, lookup) share."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...planning.estimates import CostModel, DecayedMean, RunningMean
from ..base import DrafterInfo, DraftLength
from ..tokens_model import TokensModel
from .config import LBSSConfig

PLAIN = -1  # a row's choice: plain decoding


@dataclass
class Arm:
    """What one row has seen of one drafter."""

    tries: int = 0  # exploration chunks drawn
    synced: int = 0  # committed tokens whose KV the drafter holds for the row (0: none yet)
    hits: int = 0  # draft tokens that matched the committed ones (served or shadow)
    misses: int = 0  # drafts that stopped matching within the committed tokens
    by_match: dict[int, list[int]] = field(
        default_factory=dict
    )  # the drafter's match length -> [hits, misses] of its drafts

    def count(self, matched: int, proposed: int, committed: int, match: int | None = None) -> None:
        """Per-token acceptance evidence of one draft: its matched tokens are hits; it missed when it
        stopped matching before its own end and before the committed tokens ran out (else censored).
        `match`: the length of the match the draft continued (`StepFeedback.match_lengths`), if any."""
        missed = matched < min(proposed, committed)
        self.hits += matched
        self.misses += missed
        if match is not None and proposed > 0:
            counts = self.by_match.setdefault(match, [0, 0])
            counts[0] += matched
            counts[1] += missed


@dataclass
class RowState:
    """Per-request state, keyed by row id."""

    row_id: int
    length: int  # committed tokens (prompt + generated) at the latest plan
    arms: list[Arm]  # [num_drafters]
    room: int | None = None  # tokens it may still generate at the latest plan (None: unknown)
    ks: list[int] = field(
        default_factory=list
    )  # [num_drafters] draft length of each drafter for the row at the latest plan
    usable: list[bool] = field(default_factory=list)  # [num_drafters] drafters usable at the latest plan
    tokens: RunningMean = field(default_factory=RunningMean)  # tokens committed per step, any drafter
    age: int = 0  # steps planned for this row
    chunk_drafter: int | None = None  # drafter of the exploration chunk in progress
    chunk_end: int = 0  # age at which that chunk ends
    pending: int | None = None  # drafter drawn for the next exploration chunk (caught up meanwhile)
    runner_up: int | None = None  # exploiting: a drafter within prefill_margin of the chosen one


class LBSSState:
    """The attributes `LBSSPolicy` sets (`__init__`, `bind`, `update`) and its parts read; declared
    here so each part's module says what it works on."""

    config: LBSSConfig
    drafters: list[DrafterInfo]
    draft_length: DraftLength
    rng: np.random.Generator
    rows: dict[int, RowState]  # row id -> its state
    tokens_model: TokensModel  # tokens a step commits, per request and drafter (the learned part of goodput)
    costs: CostModel  # step costs (the seconds of goodput): `Policy.costs`, the profile where attached, else fits
    shadowed: list[bool]  # [num_drafters] measured by shadow drafts, never explored
    tokens_per_step: DecayedMean  # over all rows: a new row's steps_left until it has its own
    fill: list[
        DecayedMean
    ]  # [num_drafters] tokens drafted / k (a confidence stop, a prompt lookup without a match end drafts early)
    served: list[DecayedMean]  # [num_drafters] rows each drafter served per step it drafted
    by_match: list[Arm]  # [num_drafters] every row's drafts, pooled: acceptance per match length
    padded: bool  # the verify pads rows to the longest draft (from the latest feedback)
    alpha: int  # exploration steps per epoch
    batch_size: int  # of the step being planned
