"""The policy interface: a policy decides, the engine acts.

Every step the engine shows the policy a `BatchView` and gets back a `Plan`: per row, which
drafters draft (none: plain decoding; one; several: their drafts are merged by vote), how many
tokens (k), and a few knobs of the mechanism (confidence stop, vote weights, which idle drafter
caches to pre-fill, which drafters draft unverified for measurement (shadow) or draft first and
take the row when their draft is long enough (preempt)). After the step the policy is told what
happened (`StepFeedback`). A policy never touches a model or a cache, so policies are tested on simulated drafters (tests/sim.py).

A policy is two decisions composed: *selection* (`Policy.select`: who drafts for which row) and
*draft length* (a `DraftLength` rule: how many tokens that drafter proposes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

# Draft length (k, docs/design.md#glossary) when none is given: with a cost profile (the default) the
# most a row drafts in a step, the planner choosing 0..8 from measured costs (docs/planning.md);
# without one, every step's k. With the confidence stop below, k = 8 beat k = 5 and k = 20 on
# Spec-Bench prompts with the 0.5B drafter on a CPU where verification is cheap (AVX-512 bf16).
DEFAULT_DRAFT_LENGTH = 8
# A model drafter stops a row's draft after a token it gives less than this probability:
# transformers' assistant_confidence_threshold default, which saves draft forwards on hard text.
DEFAULT_MIN_CONFIDENCE = 0.4


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
    room: list[int] | None = None  # [B] tokens each row may still generate (its length limit; it may stop earlier); None: unknown

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
    k: list[int]  # [B] draft length per row (an upper bound: a drafter may propose fewer)
    min_confidence: float = 0.0  # a model drafter stops a row once q(proposed token) < this
    vote_weights: list[float] | None = None  # [num_drafters] weights of the vote tree, when voting
    prefill: dict[int, list[int]] = field(default_factory=dict)  # idle drafter -> batch rows to catch up
    shadow: dict[int, dict[int, int]] = field(default_factory=dict)  # drafter -> {batch row: k}: draft, not verified (see StepFeedback)
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
    shadow_matched: list[dict[int, int]] = field(default_factory=list)  # [B] drafter -> how many match the committed tokens
    padded: bool = False  # the verify forward pads every row to the longest draft (rectangular cache), else packs them
    match_lengths: list[dict[int, int]] = field(default_factory=list)  # [B] drafter -> the match its draft (served or shadow) continued, where it reports one (`Draft.match_lengths`)

    @property
    def batch_size(self) -> int:
        return len(self.row_ids)

    def verified_tokens(self, drafted: list[int] | None = None) -> int:
        """Token positions the verify forward ran over with these draft lengths ([B], default: the
        step's): B x (1 + longest draft) when rows are padded to the longest, else B + the drafts."""
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


class DraftLength(ABC):
    """How many tokens a drafter proposes for a row (and how confident each must be)."""

    min_confidence: float = 0.0  # see Plan.min_confidence

    def bind(self, drafters: list[DrafterInfo]) -> None:
        """Called once by the pool with its drafters."""

    @abstractmethod
    def k(self, drafter: int, row: int, view: BatchView) -> int:
        """Draft length for `drafter` serving batch row `row`."""

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step; fixed lengths do not."""


class FixedLength(DraftLength):
    """Always k tokens (the baseline; `draft_length=5`)."""

    def __init__(self, k: int = DEFAULT_DRAFT_LENGTH, min_confidence: float = DEFAULT_MIN_CONFIDENCE):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"draft_length must be a positive int, got {k!r}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence!r}")
        self.value, self.min_confidence = k, min_confidence

    def k(self, drafter: int, row: int, view: BatchView) -> int:
        return self.value


class Policy(ABC):
    """Selection (subclasses) plus a `DraftLength` rule; `plan` composes them."""

    def __init__(self, draft_length: DraftLength | None = None):
        self.draft_length = draft_length or FixedLength()
        self.drafters: list[DrafterInfo] = []

    def bind(self, drafters: list[DrafterInfo]) -> None:
        """Called once by the pool with its drafters, before any call."""
        self.drafters = list(drafters)
        self.draft_length.bind(self.drafters)

    def attach_profile(self, profile) -> None:
        """Read step costs from the pool's `CostProfile` (measured, refined online) instead of fits
        of the policy's own: every `CostModel` it or its draft length rule keeps."""
        from .estimates import CostModel

        for costs in (getattr(self, "costs", None), getattr(self.draft_length, "costs", None)):
            if isinstance(costs, CostModel):
                costs.profile = profile

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        """Batch rows `rows` of `view` are new requests (the start of a call, or rows joining)."""

    def end_rows(self, row_ids: list[int]) -> None:
        """These requests left the batch; forget their per-request state."""

    @abstractmethod
    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        """[B] drafters per row: () plain decoding, (d,) one drafter, several to vote."""

    def plan(self, view: BatchView) -> Plan:
        chosen = self.select(view)
        k = [max((self.draft_length.k(d, b, view) for d in ds), default=0) for b, ds in enumerate(chosen)]
        return Plan(drafters=chosen, k=k, min_confidence=self.draft_length.min_confidence)

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step. Subclasses that learn call super().update(feedback) too."""
        self.draft_length.update(feedback)


def first_usable(usable: list[bool], start: int) -> int | None:
    """The first usable drafter at or after `start` (cyclically), or None."""
    n = len(usable)
    return next(((start + i) % n for i in range(n) if usable[(start + i) % n]), None)
