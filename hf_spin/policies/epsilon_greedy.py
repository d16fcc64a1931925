"""Epsilon-greedy drafter selection: the textbook bandit, a baseline for LBSS.

Per row and step: with probability epsilon a uniformly random usable drafter (exploration), else
the drafter with the highest running-mean goodput for this row, (accepted + 1) / measured_row_seconds(b);
drafters the row has not tried yet come first. With `never_slower`, plain decoding competes in the
greedy choice with its estimated goodput B / t_verify(N = B) (exploration steps are its probes).
No batch capacities, no switching cost: that is what LBSS adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planning.estimates import RunningMean
from .base import BatchView, DraftLength, Policy, StepFeedback
from .checks import check_float, check_int


@dataclass
class EpsilonGreedyConfig:
    epsilon: float = 0.2  # probability that a row explores a random drafter in a step
    never_slower: bool = True  # greedy choice may be plain decoding when its estimate beats every drafter's
    seed: int = 0  # exploration draws

    def __post_init__(self):
        check_float("EpsilonGreedyConfig", "epsilon", self.epsilon, 0.0, 1.0)
        if not isinstance(self.never_slower, bool):
            raise ValueError(f"EpsilonGreedyConfig.never_slower must be True or False, got {self.never_slower!r}")
        check_int("EpsilonGreedyConfig", "seed", self.seed)


class EpsilonGreedyPolicy(Policy):
    def __init__(self, draft_length: DraftLength | None = None, config: EpsilonGreedyConfig | None = None):
        super().__init__(draft_length)
        self.config = config or EpsilonGreedyConfig()
        self.rng = np.random.default_rng(self.config.seed)
        self.means: dict[int, list[RunningMean]] = {}  # row id -> [num_drafters] goodput means
        self.explored: list[bool] = []  # [B] rows that explored in the latest step (for inspection)

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        for b in rows:
            self.means[view.row_ids[b]] = [RunningMean() for _ in self.drafters]

    def end_rows(self, row_ids: list[int]) -> None:
        for rid in row_ids:
            self.means.pop(rid, None)

    def goodput_estimate(self, row_id: int, drafter: int) -> float | None:
        """Running-mean goodput of `drafter` on request `row_id`, None if untried."""
        m = self.means.get(row_id)
        return m[drafter].mean if m is not None and m[drafter].n else None

    def greedy(self, row_id: int, usable: list[bool], batch_size: int) -> int | None:
        """The exploiting choice: an untried drafter, else the best estimate (None: plain decoding)."""
        means = self.means.setdefault(row_id, [RunningMean() for _ in self.drafters])
        candidates = [d for d in range(len(usable)) if usable[d]]
        untried = [d for d in candidates if not means[d].n]
        if untried:
            return untried[0]
        if not candidates:
            return None
        best = max(candidates, key=lambda d: means[d].mean)
        plain = self.costs.plain_goodput(batch_size) if self.config.never_slower else None
        return None if plain is not None and plain > means[best].mean else best

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        candidates = [d for d in range(len(view.usable)) if view.usable[d]]
        out, self.explored = [], []
        for rid in view.row_ids:
            explore = bool(candidates) and self.rng.random() < self.config.epsilon
            d = (
                candidates[int(self.rng.integers(len(candidates)))]
                if explore
                else self.greedy(rid, view.usable, view.batch_size)
            )
            self.explored.append(explore)
            out.append(() if d is None else (d,))
        return out

    def update(self, feedback: StepFeedback) -> None:
        super().update(feedback)
        for b, rid in enumerate(feedback.row_ids):
            ds = feedback.plan.drafters[b]
            t = feedback.measured_row_seconds(b)
            if len(ds) == 1 and feedback.plan.k[b] > 0 and t > 0 and rid in self.means:
                self.means[rid][ds[0]].add((feedback.accepted[b] + 1) / t)
