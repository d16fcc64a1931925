"""What a step's deciders and the engine exchange: the batch as a policy sees it (`BatchView`), the
decision (`Plan`), and what the step did (`StepFeedback`). Plain records: no models, no caches.

The engine builds a `BatchView`, a policy returns a `Plan` (which drafters and the most tokens per
row), the planner sizes it (planner.py), and after the step the policy and the planner hear the
`StepFeedback`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class DrafterInfo:
    """What a policy may know about a drafter without touching it."""

    name: str  # unique within the pool (the key of the statistics)
    kind: str  # "model", "translation", "prompt_lookup", ... (the drafter class's `kind`)
    num_parameters: int  # 0 for model-free drafters; orders drafters by size
    gives_q: bool  # True when it returns draft probabilities when sampling (else a one-hot proposal)


@dataclass(frozen=True)
class BatchView:
    """The active batch as a policy sees it at the start of a step."""

    row_ids: list[int]  # [B] request ids of the active rows, in batch order (unique within a call)
    prompt_lengths: list[int]  # [B] prompt tokens per row (without padding)
    generated: list[int]  # [B] tokens generated so far per row
    usable: list[bool]  # [num_drafters] False for a drafter dropped after a failure in this call
    step: int  # verification steps done so far in this call
    room: list[int] | None = (
        None  # [B] tokens each row may still generate (its length limit; it may stop earlier); None: unknown
    )

    @property
    def batch_size(self) -> int:
        return len(self.row_ids)


class Preempt(NamedTuple):
    """A drafter drafting for a row before the row's planned drafters (`Plan.preempt`): where it
    proposes at least `min_tokens` continuing a match of at least `min_match` tokens
    (`Draft.match_lengths`; a drafter that reports none: any match) the row verifies that draft and
    its planned drafters skip it this step; else the draft counts as a shadow draft (a cheap
    drafter's match, used when it has one)."""

    k: int  # tokens to draft
    min_tokens: int
    min_match: int


@dataclass(frozen=True)
class Plan:
    """What to do this step.

    Example, B = 3 with drafters [model, prompt_lookup]: drafters [(0,), (), (0, 1)], k [4, 0, 6]
    means row 0 takes 4 tokens from the model, row 1 decodes plainly, and row 2 verifies the
    heaviest path of the vote tree built from both drafters' 6-token drafts.
    """

    drafters: list[tuple[int, ...]]  # [B] drafter indices per row: () plain, (d,) one, several: vote
    k: list[int]  # [B] the most draft tokens per row: a cap (`planner.plan_k` sizes within it)
    min_confidence: float = 0.0  # a model drafter stops a row once q(proposed token) < this
    vote_weights: list[float] | None = None  # [num_drafters] weights of the vote tree, when voting
    catch_up: dict[int, list[int]] = field(default_factory=dict)  # idle drafter -> batch rows to catch up
    shadow: dict[int, dict[int, int]] = field(
        default_factory=dict
    )  # drafter -> {batch row: k}: draft, not verified (see StepFeedback)
    preempt: dict[int, dict[int, Preempt]] = field(default_factory=dict)  # drafter -> {batch row: Preempt}


def shadow_lengths(plan: Plan, shadows: list[dict[int, list[int]]]) -> dict[int, dict[int, int]]:
    """drafter -> {batch row: k} of the shadow drafts a step made (`shadows`: [B] drafter -> draft):
    the plan's `shadow` ones and a preempting drafter's drafts too short to serve."""
    out: dict[int, dict[int, int]] = {}
    for b, drafts in enumerate(shadows):
        for d in drafts:
            k = plan.shadow.get(d, {}).get(b)
            out.setdefault(d, {})[b] = k if k is not None else plan.preempt[d][b].k
    return out


@dataclass(frozen=True)
class StepFeedback:
    """What one step did, row by row (batch order as in the plan's view)."""

    row_ids: list[int]  # [B]
    plan: Plan  # as executed: k capped by the room left before max_length, failed drafters removed
    drafted: list[int]  # [B] draft tokens verified per row (the vote's path when voting)
    accepted: list[int]  # [B] draft tokens accepted per row
    proposed: list[dict[int, int]]  # [B] drafter -> tokens it proposed for the row
    matched: list[dict[int, int]]  # [B] drafter -> how many of its tokens match the committed tokens
    draft_seconds: list[float]  # [num_drafters] wall time each drafter spent this step
    verify_seconds: float  # wall time of the target forward and verification
    # Shadow drafts (Plan.shadow): proposed for a row they did not serve, never verified, only compared
    # with the tokens the step committed: a measurement of what that drafter would have got, free for
    # a cheap drafter. Matched == committed tokens < proposed means the rest is unknown (censored).
    shadow_proposed: list[dict[int, int]] = field(default_factory=list)  # [B] drafter -> tokens it shadow-proposed
    shadow_matched: list[dict[int, int]] = field(
        default_factory=list
    )  # [B] drafter -> how many match the committed tokens
    # [B] drafter -> (positions observed before, proposed, matched, committed, match): what this step's tokens revealed
    # of a model-free draft of an earlier step followed past it (step/continuations.py)
    continued: list[dict[int, tuple]] = field(default_factory=list)
    padded: bool = False  # the verify forward pads every row to the longest draft (rectangular cache), else packs them
    positions: int | None = None  # positions the chain verify forward ran over, fillers included (step/widths.py)
    match_lengths: list[dict[int, int]] = field(
        default_factory=list
    )  # [B] drafter -> the match its draft (served or shadow) continued, where it reports one (`Draft.match_lengths`)
    alternatives: list[bool | None] = field(
        default_factory=list
    )  # [B] a token tree's siblings of its heaviest path where that path failed: accepted or not, None if none
    # [B] drafter -> the committed tokens its state lacked before it drafted (its first forward reads them: a catch-up
    # inside its draft), for the drafters the planner sized, their own encoder run before (`Drafter.unencoded`) left out
    lags: list[dict[int, int]] = field(default_factory=list)
    idle_seconds: float = 0.0  # the idle catch-ups' seconds (`Plan.catch_up`) inside `draft_seconds`
    # the step compiled or captured a graph (a first run at a shape: cache/static_forward.py, `FirstRuns`): its seconds
    # are set-up, not what its forwards cost
    cold: bool = False
    filler_rows: int = 0  # rows of filler tokens a plain step's forward ran beside the batch's (`plain_rows`)

    @property
    def batch_size(self) -> int:
        return len(self.row_ids)

    def verified_tokens(self, drafted: list[int] | None = None) -> int:
        """Token positions the verify forward ran over with these draft lengths ([B], default: the
        step's): B x (1 + longest draft) when rows are padded to the longest, else B + the drafts; the step's
        own: `positions` where the engine says (a verification filled out to a cheaper width)."""
        if drafted is None and self.positions is not None:
            return self.positions
        drafted = self.drafted if drafted is None else drafted
        B = len(drafted)
        return B * (1 + max(drafted, default=0)) if self.padded else B + sum(drafted)

    def draft_share(self, b: int) -> float:
        """Row b's share of the drafting: each of its drafters' time split over the rows it served."""
        share = 0.0
        for d in self.plan.drafters[b]:
            served = sum(1 for ds in self.plan.drafters if d in ds)
            share += self.draft_seconds[d] / max(served, 1)
        return share

    def measured_row_seconds(self, b: int) -> float:
        """Row b's share of the step: its share of drafting, plus 1/B of verification."""
        return self.verify_seconds / max(self.batch_size, 1) + self.draft_share(b)
