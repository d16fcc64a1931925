"""Policies that do not learn: the baselines."""

from __future__ import annotations

from .base import BatchView, DraftLength, Policy, first_usable


class FixedPolicy(Policy):
    """Every row uses one drafter (falls over to the next usable one if it fails)."""

    def __init__(self, draft_length: DraftLength | None = None, drafter: int = 0):
        super().__init__(draft_length)
        self.drafter = drafter

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        d = first_usable(view.usable, self.drafter)
        return [(d,) if d is not None else ()] * view.batch_size


class RoundRobinPolicy(Policy):
    """All rows use drafter (step mod n) at each step: every drafter gets its turn."""

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        d = first_usable(view.usable, view.step % max(len(view.usable), 1))
        return [(d,) if d is not None else ()] * view.batch_size
