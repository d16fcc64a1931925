"""The policy interface: a policy decides, the engine acts.

Every step the engine shows the policy a `BatchView` and gets back a `Plan`: per row, which
drafters draft (none: plain decoding; one; several: their drafts are merged by vote), how many
tokens (k), and a few knobs of the mechanism (confidence stop, vote weights, which idle drafters
catch up, which drafters draft unverified for measurement (shadow) or draft first and
take the row when their draft is long enough (preempt)). After the step the policy is told what
happened (`StepFeedback`). A policy never touches a model or a cache, so policies are tested on simulated drafters (tests/sim.py).

A policy is two decisions composed: *selection* (`Policy.select`: who drafts for which row) and
*draft length* (a `DraftLength` rule: how many tokens that drafter proposes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..planning.estimates import CostModel
from ..planning.plan import BatchView, DrafterInfo, Plan, Preempt, StepFeedback, shadow_lengths

# Draft length (k, docs/design.md#glossary) when none is given: with a cost profile (the default) the
# most a row drafts in a step, the planner choosing 0..8 from measured costs (docs/planning.md);
# without one, every step's k. With the confidence stop below, k = 8 beat k = 5 and k = 20 on
# Spec-Bench prompts with the 0.5B drafter on a CPU where verification is cheap (AVX-512 bf16).
DEFAULT_DRAFT_LENGTH = 8
# A model drafter stops a row's draft after a token it gives less than this probability:
# transformers' assistant_confidence_threshold default, which saves draft forwards on hard text.
DEFAULT_MIN_CONFIDENCE = 0.4


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
