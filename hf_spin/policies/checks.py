"""Argument checks for the policy configs: each error says which field, what was given, what is supported."""

from __future__ import annotations

import math


def check_int(owner: str, name: str, value, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"{owner}.{name} must be an int{bound}, got {value!r}")


def check_float(
    owner: str, name: str, value, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        lo, hi = "(" if open_low else "[", ")" if open_high else "]"
        raise ValueError(f"{owner}.{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")


def check_per_drafter(owner: str, name: str, value, num_drafters: int) -> None:
    """A per-drafter tuple must have one entry per drafter of the pool."""
    if isinstance(value, tuple) and len(value) != num_drafters:
        raise ValueError(
            f"{owner}.{name} has {len(value)} entries but the pool has {num_drafters} drafters; "
            "give one entry per drafter, in pool order"
        )
