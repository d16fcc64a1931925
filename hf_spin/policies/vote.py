"""Minions' majority vote: every usable drafter drafts for every row; the engine verifies the
heaviest path of their vote tree (`hf_spin.verify.vote_tree.heaviest_path`) under weights learned here.

Weight update, a two-sided weighted-majority (multiplicative weights) rule. After each step, per
drafter d that proposed tokens:

    rate_d = sum_b matched[b][d] / sum_b proposed[b][d]   (its own agreement with the target)
    w_d <- w_d (1 + eta)   if rate_d >= reward_threshold   (reward)
    w_d <- w_d (1 - eta)   if rate_d <= punish_threshold   (punish)
    w_d <- clip(w_d, min_weight, max_weight)

Only ratios of weights matter to the vote; the bounds keep a drafter that was bad for a while
able to win back within log(max/min) / log(1 + eta) good steps, and keep the numbers finite.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BatchView, DrafterInfo, DraftLength, Plan, Policy, StepFeedback
from .checks import check_float, check_per_drafter


@dataclass
class VoteConfig:
    learning_rate: float = 0.2  # eta: a drafter right for ~12 steps gains 10x over one wrong for as long
    reward_threshold: float = 0.6  # match rate at or above which a drafter's weight grows
    punish_threshold: float = 0.3  # match rate at or below which it shrinks (in between: unchanged)
    min_weight: float = 0.1  # bounds: a ratio of 100 already lets one drafter outvote any few others
    max_weight: float = 10.0
    initial_weights: tuple[float, ...] | None = None  # one per drafter; None: all 1.0

    def __post_init__(self):
        owner = "VoteConfig"
        check_float(owner, "learning_rate", self.learning_rate, 0.0, 1.0, open_low=True, open_high=True)
        check_float(owner, "reward_threshold", self.reward_threshold, 0.0, 1.0)
        check_float(owner, "punish_threshold", self.punish_threshold, 0.0, 1.0)
        if self.punish_threshold >= self.reward_threshold:
            raise ValueError(
                f"VoteConfig.punish_threshold ({self.punish_threshold}) must be below "
                f"reward_threshold ({self.reward_threshold})"
            )
        check_float(owner, "min_weight", self.min_weight, 0.0, float("inf"), open_low=True, open_high=True)
        check_float(owner, "max_weight", self.max_weight, self.min_weight, float("inf"), open_high=True)
        if self.initial_weights is not None:
            self.initial_weights = tuple(self.initial_weights)
            for w in self.initial_weights:
                check_float(owner, "initial_weights", w, self.min_weight, self.max_weight)


class VotePolicy(Policy):
    """All usable drafters draft for every row; weights follow each drafter's agreement."""

    def __init__(self, draft_length: DraftLength | None = None, config: VoteConfig | None = None):
        super().__init__(draft_length)
        self.config = config or VoteConfig()
        self.weights: list[float] = []  # [num_drafters]

    def bind(self, drafters: list[DrafterInfo]) -> None:
        super().bind(drafters)
        check_per_drafter("VoteConfig", "initial_weights", self.config.initial_weights, len(drafters))
        self.weights = list(self.config.initial_weights or [1.0] * len(drafters))

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        voters = tuple(d for d in range(len(view.usable)) if view.usable[d])
        return [voters] * view.batch_size

    def plan(self, view: BatchView) -> Plan:
        plan = super().plan(view)
        return Plan(plan.drafters, plan.k, plan.min_confidence, vote_weights=list(self.weights))

    def update(self, feedback: StepFeedback) -> None:
        super().update(feedback)
        c = self.config
        for d in range(len(self.weights)):
            proposed = sum(p.get(d, 0) for p in feedback.proposed)
            if not proposed:
                continue  # no draft this step (e.g. prompt lookup found no match): no evidence
            rate = sum(min(m.get(d, 0), p.get(d, 0)) for m, p in zip(feedback.matched, feedback.proposed)) / proposed
            if rate >= c.reward_threshold:
                self.weights[d] *= 1.0 + c.learning_rate
            elif rate <= c.punish_threshold:
                self.weights[d] *= 1.0 - c.learning_rate
            self.weights[d] = min(max(self.weights[d], c.min_weight), c.max_weight)
