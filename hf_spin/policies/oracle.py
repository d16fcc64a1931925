"""The best single drafter in hindsight, per request: the yardstick for drafter-selection policies.

Measure each request once with every single drafter alone (and with plain decoding), then call
`best_in_hindsight(single, policies)`:

    single   = [{"plain": 20.0, "small": 31.0, "large": 27.0},    # request 0: goodput per run
                {"plain": 20.0, "small": 22.0, "large": 35.0}]    # request 1
    policies = {"lbss": [30.0, 33.0]}
    report = best_in_hindsight(single, policies)
    report.best            -> ["small", "large"]
    report.best_goodput    -> [31.0, 35.0]
    report.fraction        -> {"lbss": [0.968, 0.943]}   # policy goodput / best in hindsight
    report.mean_fraction   -> {"lbss": 0.955}
    report.best_fixed      -> "large"   # the one drafter best for all requests together (highest mean goodput)

Plain decoding counts as a choice ("plain" by default): a drafter that is slower than plain
decoding on a request is not the best in hindsight there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OracleReport:
    best: list[str]  # [R] per request: the choice with the highest goodput
    best_goodput: list[float]  # [R] its goodput
    fraction: dict[str, list[float]]  # policy -> [R] its goodput / best_goodput
    mean_fraction: dict[str, float]  # policy -> mean of fraction over requests
    best_fixed: str  # the single choice with the highest mean goodput over all requests
    best_fixed_fraction: float  # mean over requests of its goodput / best_goodput


def _check_goodput(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a finite goodput >= 0 (tokens/s), got {value!r}")
    return float(value)


def best_in_hindsight(
    single: Sequence[Mapping[str, float]], policies: Mapping[str, Sequence[float]] | None = None
) -> OracleReport:
    """single: [R] per request, choice name -> measured goodput (each single drafter, and plain);
    policies: policy name -> [R] measured goodput per request."""
    if not single:
        raise ValueError("best_in_hindsight needs at least one request in `single`")
    names = list(single[0])
    if not names:
        raise ValueError(
            "single[0] is empty: give the goodput of every single drafter (and plain decoding) per request"
        )
    for i, g in enumerate(single):
        if set(g) != set(names):
            raise ValueError(
                f"single[{i}] has choices {sorted(g)} but single[0] has {sorted(names)}; "
                "measure every choice on every request"
            )
        for name, value in g.items():
            _check_goodput(f"single[{i}][{name!r}]", value)
    best = [max(names, key=lambda n: (g[n], -names.index(n))) for g in single]
    best_goodput = [float(g[n]) for g, n in zip(single, best)]

    def fractions(goodputs: Sequence[float], who: str) -> list[float]:
        if len(goodputs) != len(single):
            raise ValueError(f"{who} has {len(goodputs)} goodputs but there are {len(single)} requests")
        vals = [_check_goodput(f"{who}[{i}]", v) for i, v in enumerate(goodputs)]
        return [v / b if b > 0 else (1.0 if v == 0 else math.inf) for v, b in zip(vals, best_goodput)]

    fraction = {name: fractions(gs, f"policies[{name!r}]") for name, gs in (policies or {}).items()}
    mean_fraction = {name: sum(f) / len(f) for name, f in fraction.items()}
    best_fixed = max(names, key=lambda n: (sum(g[n] for g in single), -names.index(n)))
    fixed = fractions([g[best_fixed] for g in single], f"single[*][{best_fixed!r}]")
    return OracleReport(best, best_goodput, fraction, mean_fraction, best_fixed, sum(fixed) / len(fixed))
