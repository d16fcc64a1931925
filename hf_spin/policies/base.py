"""The policy interface: a policy decides, the engine acts.

Every step the engine shows the policy a `BatchView` and gets back a `Plan`: per row, which
drafters draft (none: plain decoding; one; several: their drafts are merged by vote), how many
tokens (k), and a few knobs of the mechanism (confidence stop, vote weights, which idle drafters
catch up, which drafters draft unverified for measurement (shadow) or draft first and
take the row when their draft is long enough (preempt)). After the step the policy is told what
happened (`StepFeedback`). A policy never touches a model or a cache, so policies are tested on simulated
drafters (tests/sim.py).

A policy is two decisions composed: *selection* (`Policy.select`: who drafts for which row) and
*draft length* (a `DraftLength` rule: the most tokens that drafter proposes). A plan's k is a cap:
`planning.planner.plan_k` decides each row's k within it and the row's room (the planner sizing it
from measured costs where a profile exists).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..planning.cost_profile import CostProfile
from ..planning.estimates import CostModel
from ..planning.plan import BatchView, DrafterInfo, Plan, StepFeedback

# Draft length (k, docs/design.md#glossary) when none is given: with a cost profile (the default) the
# most a row drafts in a step, the planner choosing 0..8 from measured costs (docs/planning.md);
# without one, every step's k. With the confidence stop below, k = 8 beat k = 5 and k = 20 on
# Spec-Bench prompts with the 0.5B drafter on a CPU where verification is cheap (AVX-512 bf16).
DEFAULT_DRAFT_LENGTH = 8
# A model drafter stops a row's draft after a token it gives less than this probability:
# transformers' assistant_confidence_threshold default, which saves draft forwards on hard text.
DEFAULT_MIN_CONFIDENCE = 0.4


class DraftLength(ABC):
    """The most tokens a drafter proposes for a row (the cap `plan_k` sizes within), and how
    confident each must be."""

    min_confidence: float = 0.0  # see Plan.min_confidence

    def bind(self, drafters: list[DrafterInfo]) -> None:
        """Called once by the pool with its drafters."""

    def use_costs(self, costs: CostModel) -> None:
        """The step costs to read: the policy's `CostModel` (called by `Policy.bind`). Rules that
        read no costs ignore it."""

    @abstractmethod
    def k(self, drafter: int, row: int, view: BatchView) -> int:
        """Draft length cap for `drafter` serving batch row `row`."""

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
    """Selection (subclasses) plus a `DraftLength` rule; `plan` composes them.

    `costs`: the one `CostModel` the policy and its draft length rule read (what a step, a draft, a
    catch-up costs), learned from every step by `update`; it answers from the pool's `CostProfile`
    once `attach_profile` gives it one, so no policy asks whether a profile exists."""

    def __init__(self, draft_length: DraftLength | None = None):
        self.draft_length = draft_length or FixedLength()
        self.drafters: list[DrafterInfo] = []
        self.costs = CostModel(0)

    def bind(self, drafters: list[DrafterInfo]) -> None:
        """Called once by the pool with its drafters, before any call."""
        self.drafters = list(drafters)
        self.costs = CostModel(len(self.drafters))
        self.draft_length.bind(self.drafters)
        self.draft_length.use_costs(self.costs)

    def attach_profile(self, profile: CostProfile) -> None:
        """Step costs from the pool's `CostProfile` (measured, refined online) from now on
        (`CostModel.attach`); without this call (profile "off") they come from online fits."""
        self.costs.attach(profile)

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

    def catch_up_tokens(self, feedback: StepFeedback) -> list[float] | None:
        """[num_drafters] tokens each drafter caught up on in the step (a switch, an idle catch-up), for
        `costs` to price a catch-up; None: not tracked (called once a step, by `update`)."""
        return None

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step: the step costs, the draft length rule. Subclasses that learn call
        super().update(feedback) too."""
        self.costs.update(feedback, self.catch_up_tokens(feedback))
        self.draft_length.update(feedback)


def first_usable(usable: list[bool], start: int) -> int | None:
    """The first usable drafter at or after `start` (cyclically), or None."""
    n = len(usable)
    return next(((start + i) % n for i in range(n) if usable[(start + i) % n]), None)
