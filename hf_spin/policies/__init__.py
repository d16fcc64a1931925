"""Policies decide; they never touch a model or a cache (see base.py for the interface).

Users name them in `AssistantPool(drafters, policy=..., draft_length=...)`; `make_policy` turns
those names into objects.
"""

from __future__ import annotations

from .base import (
    DEFAULT_DRAFT_LENGTH,
    BatchView,
    DrafterInfo,
    DraftLength,
    FixedLength,
    Plan,
    Policy,
    StepFeedback,
)
from .simple import FixedPolicy, RoundRobinPolicy

POLICIES = {"fixed": FixedPolicy, "round_robin": RoundRobinPolicy}
DRAFT_LENGTHS: dict[str, type[DraftLength]] = {}


def make_draft_length(draft_length: int | str | DraftLength) -> DraftLength:
    if isinstance(draft_length, DraftLength):
        return draft_length
    if isinstance(draft_length, str):
        if draft_length not in DRAFT_LENGTHS:
            raise ValueError(
                f"draft_length={draft_length!r} is not supported; give a positive int, one of {sorted(DRAFT_LENGTHS)}, "
                "or a DraftLength object"
            )
        return DRAFT_LENGTHS[draft_length]()
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
        raise ValueError(f"draft_length must be a positive int, one of {sorted(DRAFT_LENGTHS)} or a DraftLength, got {draft_length!r}")
    return FixedLength(draft_length)


def make_policy(policy: str | Policy, draft_length: int | str | DraftLength = DEFAULT_DRAFT_LENGTH) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not supported; choose one of {sorted(POLICIES)} or pass a Policy object")
    return POLICIES[policy](draft_length=make_draft_length(draft_length))


__all__ = [
    "DEFAULT_DRAFT_LENGTH",
    "DRAFT_LENGTHS",
    "POLICIES",
    "BatchView",
    "DraftLength",
    "DrafterInfo",
    "FixedLength",
    "FixedPolicy",
    "Plan",
    "Policy",
    "RoundRobinPolicy",
    "StepFeedback",
    "make_draft_length",
    "make_policy",
]
