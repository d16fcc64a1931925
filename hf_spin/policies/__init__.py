"""Policies decide; they never touch a model or a cache (see base.py for the interface).

Users name them in `AssistantPool(drafters, policy=..., draft_length=...)`; `make_policy` turns
those names into objects:

    policy:        "lbss" | "vote" | "epsilon_greedy" | "by_prompt_length" | "round_robin" | "fixed",
                   a config (LBSSConfig(alpha=16, seed=1), VoteConfig(...), EpsilonGreedyConfig(...)),
                   or a Policy object (which brings its own draft length rule)
    draft_length:  an int (fixed k) | "heuristic" | "minions" | "goodput",
                   a config (GoodputLengthConfig(max_k=8), ...), or a DraftLength object
"""

from __future__ import annotations

from ..planning.plan import BatchView, DrafterInfo, Plan, Preempt, StepFeedback  # what a policy reads and returns
from .base import DEFAULT_DRAFT_LENGTH, DEFAULT_MIN_CONFIDENCE, DraftLength, FixedLength, Policy
from .epsilon_greedy import EpsilonGreedyConfig, EpsilonGreedyPolicy
from .lbss import LBSSConfig, LBSSPolicy
from .lengths import (
    GoodputLength,
    GoodputLengthConfig,
    HeuristicLength,
    HeuristicLengthConfig,
    MinionsLength,
    MinionsLengthConfig,
)
from .oracle import OracleReport, best_in_hindsight
from .simple import ByPromptLengthPolicy, FixedPolicy, RoundRobinPolicy
from .vote import VoteConfig, VotePolicy

POLICIES: dict[str, type[Policy]] = {
    "by_prompt_length": ByPromptLengthPolicy,
    "epsilon_greedy": EpsilonGreedyPolicy,
    "fixed": FixedPolicy,
    "lbss": LBSSPolicy,
    "round_robin": RoundRobinPolicy,
    "vote": VotePolicy,
}
DRAFT_LENGTHS: dict[str, type[DraftLength]] = {
    "goodput": GoodputLength,
    "heuristic": HeuristicLength,
    "minions": MinionsLength,
}
# A config object names its class: policy=LBSSConfig(alpha=16) builds LBSSPolicy(config=...).
POLICY_CONFIGS: dict[type, type[Policy]] = {
    EpsilonGreedyConfig: EpsilonGreedyPolicy,
    LBSSConfig: LBSSPolicy,
    VoteConfig: VotePolicy,
}
DRAFT_LENGTH_CONFIGS: dict[type, type[DraftLength]] = {
    GoodputLengthConfig: GoodputLength,
    HeuristicLengthConfig: HeuristicLength,
    MinionsLengthConfig: MinionsLength,
}


def make_draft_length(draft_length: int | str | DraftLength) -> DraftLength:
    if isinstance(draft_length, DraftLength):
        return draft_length
    if type(draft_length) in DRAFT_LENGTH_CONFIGS:
        return DRAFT_LENGTH_CONFIGS[type(draft_length)](draft_length)
    if isinstance(draft_length, str):
        if draft_length not in DRAFT_LENGTHS:
            raise ValueError(
                f"draft_length={draft_length!r} is not supported; give a positive int, one of {sorted(DRAFT_LENGTHS)}, "
                "or a DraftLength object"
            )
        return DRAFT_LENGTHS[draft_length]()
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
        raise ValueError(
            f"draft_length must be a positive int, one of {sorted(DRAFT_LENGTHS)} or a DraftLength, "
            f"got {draft_length!r}"
        )
    return FixedLength(draft_length)


def make_policy(policy: str | Policy, draft_length: int | str | DraftLength = DEFAULT_DRAFT_LENGTH) -> Policy:
    if isinstance(policy, Policy):
        if not (isinstance(draft_length, int) and draft_length == DEFAULT_DRAFT_LENGTH):
            raise ValueError(
                f"draft_length={draft_length!r} cannot be applied to a Policy object (it has its own rule, "
                f"{type(policy.draft_length).__name__}); pass draft_length to the policy's constructor, "
                "or name the policy (policy='lbss' or a config such as LBSSConfig(...))"
            )
        return policy
    if type(policy) in POLICY_CONFIGS:
        return POLICY_CONFIGS[type(policy)](draft_length=make_draft_length(draft_length), config=policy)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(
            f"policy={policy!r} is not supported; choose one of {sorted(POLICIES)}, a config "
            f"({', '.join(sorted(c.__name__ for c in POLICY_CONFIGS))}) or pass a Policy object"
        )
    return POLICIES[policy](draft_length=make_draft_length(draft_length))


__all__ = [
    "DEFAULT_DRAFT_LENGTH",
    "DEFAULT_MIN_CONFIDENCE",
    "DRAFT_LENGTHS",
    "DRAFT_LENGTH_CONFIGS",
    "POLICIES",
    "POLICY_CONFIGS",
    "BatchView",
    "ByPromptLengthPolicy",
    "DraftLength",
    "DrafterInfo",
    "EpsilonGreedyConfig",
    "EpsilonGreedyPolicy",
    "FixedLength",
    "FixedPolicy",
    "GoodputLength",
    "GoodputLengthConfig",
    "HeuristicLength",
    "HeuristicLengthConfig",
    "LBSSConfig",
    "LBSSPolicy",
    "MinionsLength",
    "MinionsLengthConfig",
    "OracleReport",
    "Plan",
    "Policy",
    "Preempt",
    "RoundRobinPolicy",
    "StepFeedback",
    "VoteConfig",
    "VotePolicy",
    "best_in_hindsight",
    "make_draft_length",
    "make_policy",
]
