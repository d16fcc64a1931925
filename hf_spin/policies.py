"""Policies decide; they never touch a model or a cache.

A policy sees a `BatchView` (which rows are active, which drafters are usable) and returns a
`Plan`: per row, which drafter drafts and how many tokens (k). After each step it is told what
happened (`StepFeedback`) and may learn from it. The learning policies (bandit, vote, adaptive k)
build on this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

# Draft length when none is given: on the packaged models verifying 5-8 tokens costs about as much
# as verifying one (MODELS.md), and acceptance of 5 consecutive drafts is already rare on hard text.
DEFAULT_DRAFT_LENGTH = 5


@dataclass(frozen=True)
class BatchView:
    row_ids: list[int]  # [B] request ids of the active rows, in batch order
    usable: list[bool]  # [num_drafters] False for a drafter dropped after a failure in this call
    step: int  # verification steps done so far in this call


@dataclass(frozen=True)
class Plan:
    drafter: list[int | None]  # [B] drafter index per row, None = no speculation this step
    k: list[int]  # [B] draft length per row


@dataclass(frozen=True)
class StepFeedback:
    row_ids: list[int]  # [B]
    plan: Plan
    drafted: list[int]  # [B] tokens actually proposed
    accepted: list[int]  # [B]
    draft_seconds: list[float]  # [num_drafters] time each drafter spent this step
    verify_seconds: float


class Policy(ABC):
    @abstractmethod
    def plan(self, view: BatchView) -> Plan: ...

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step; the fixed policies do not."""


def _first_usable(usable: list[bool], start: int) -> int | None:
    n = len(usable)
    return next(((start + i) % n for i in range(n) if usable[(start + i) % n]), None)


class FixedPolicy(Policy):
    """Every row uses one drafter with a fixed k (falls over to the next usable one if it fails)."""

    def __init__(self, drafter: int = 0, k: int = DEFAULT_DRAFT_LENGTH):
        self.drafter, self.k = drafter, k

    def plan(self, view: BatchView) -> Plan:
        d = _first_usable(view.usable, self.drafter)
        return Plan(drafter=[d] * len(view.row_ids), k=[self.k] * len(view.row_ids))


class RoundRobinPolicy(Policy):
    """All rows use drafter (step mod n) at each step: every drafter gets its turn."""

    def __init__(self, k: int = DEFAULT_DRAFT_LENGTH):
        self.k = k

    def plan(self, view: BatchView) -> Plan:
        d = _first_usable(view.usable, view.step % max(len(view.usable), 1))
        return Plan(drafter=[d] * len(view.row_ids), k=[self.k] * len(view.row_ids))


POLICIES = {"fixed": FixedPolicy, "round_robin": RoundRobinPolicy}


def make_policy(policy: str | Policy, draft_length: int) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not supported; choose one of {sorted(POLICIES)} or pass a Policy object")
    return POLICIES[policy](k=draft_length)
