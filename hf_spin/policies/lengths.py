"""Adaptive draft length: `DraftLength` rules that learn k from feedback.

- `HeuristicLength` ("heuristic"): `transformers`' rule, per drafter and request: k += 2 after a
  step in which all k drafts were accepted, else k -= 1 (at least 1).
- `MinionsLength` ("minions"): Minions' online rule: fit the time per produced token against k
  over a window of recent steps (at the current k and probed neighbours k +- 1) and move k one
  step toward the fitted minimum (hill climbing), per (drafter, batch-size bucket).
- `GoodputLength` ("goodput"): k = argmax E(k) / cost(k) with E(k) = (1 - a^(k+1)) / (1 - a)
  the expected tokens per step and cost(k) = k c_draft + t_verify(B (k + 1)) / B one row's share of
  the step, from the measured per-token acceptance a per drafter, the measured draft cost per row and token per
  (drafter, bucket), and a linear fit of verify time vs tokens verified per bucket.

A row served by several drafters (vote) counts for each of them with that drafter's own proposal:
`matched` out of `proposed` tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..planning.estimates import CostModel, DecayedMean, acceptance_with_prior, bucket, geometric_tokens
from .base import DEFAULT_DRAFT_LENGTH, BatchView, DrafterInfo, DraftLength, StepFeedback
from .checks import check_float, check_int

# Forgetting factor of the acceptance counts, per step: acceptance drifts slowly with the text
# (a code block, a list), slower than costs do.
ACCEPTANCE_DECAY = 0.995


def rows_served(feedback: StepFeedback, drafter: int) -> list[int]:
    """Batch rows for which `drafter` drafted in this step (k > 0 after the engine's caps)."""
    return [b for b, (ds, k) in enumerate(zip(feedback.plan.drafters, feedback.plan.k)) if drafter in ds and k > 0]


def _check_range(owner: str, c) -> None:
    check_int(owner, "min_k", c.min_k, 1)
    check_int(owner, "max_k", c.max_k, c.min_k)
    check_int(owner, "initial", c.initial, c.min_k)
    if c.initial > c.max_k:
        raise ValueError(f"{owner}.initial must be in [min_k, max_k] = [{c.min_k}, {c.max_k}], got {c.initial}")
    check_float(owner, "min_confidence", c.min_confidence, 0.0, 1.0, open_high=True)


# --- heuristic -------------------------------------------------------------------------------


@dataclass
class HeuristicLengthConfig:
    initial: int = DEFAULT_DRAFT_LENGTH  # k before any feedback
    min_k: int = 1  # transformers' floor
    max_k: int = 32  # ceiling: +2 per perfect step would otherwise grow without bound on repetitive text
    min_confidence: float = 0.0  # see Plan.min_confidence

    def __post_init__(self):
        _check_range("HeuristicLengthConfig", self)


class HeuristicLength(DraftLength):
    """`transformers`' rule per drafter and request: k += 2 after a step in which the drafter's k
    drafts for the row were all accepted, else k -= 1 (within [min_k, max_k]).

    Per request, not per drafter alone: `transformers` runs one request at a time, and one k shared
    by a batch would need every row's drafts accepted at once, which collapses k to 1 as B grows.
    A request starts at `initial`; requests are told apart by row id within a call.
    """

    def __init__(self, config: HeuristicLengthConfig | None = None):
        self.config = config or HeuristicLengthConfig()
        self.min_confidence = self.config.min_confidence
        self.values: dict[tuple[int, int], int] = {}  # (drafter, row id) -> current k

    def bind(self, drafters: list[DrafterInfo]) -> None:
        self.values = {}

    def k(self, drafter: int, row: int, view: BatchView) -> int:
        return self.values.get((drafter, view.row_ids[row]), self.config.initial)

    def update(self, feedback: StepFeedback) -> None:
        c = self.config
        for b, (ds, k) in enumerate(zip(feedback.plan.drafters, feedback.plan.k)):
            for d in ds if k > 0 else ():
                key = (d, feedback.row_ids[b])
                current = self.values.get(key, c.initial)
                perfect = feedback.matched[b].get(d, 0) >= k
                self.values[key] = min(current + 2, c.max_k) if perfect else max(current - 1, c.min_k)


# --- Minions' hill climbing ----------------------------------------------------------------------


@dataclass
class MinionsLengthConfig:
    initial: int = DEFAULT_DRAFT_LENGTH  # k where the climb starts
    min_k: int = 1
    max_k: int = 16  # the climb never needs more on the packaged models; bounds a runaway
    dwell: int = 12  # steps measured at the current k between two probes of a neighbour
    probe: int = 4  # steps measured at the neighbour k +- 1, so the window always spans two k or more
    window: int = 48  # recent steps kept per (drafter, bucket); must cover dwell + probe so both sides are measured
    tolerance: float = (
        0.01  # the fit must find the neighbour this much cheaper per token to move: noise must not make k wander
    )
    min_confidence: float = 0.0  # see Plan.min_confidence

    def __post_init__(self):
        owner = "MinionsLengthConfig"
        _check_range(owner, self)
        check_int(owner, "dwell", self.dwell, 1)
        check_int(owner, "probe", self.probe, 1)
        check_int(owner, "window", self.window, 1)
        if self.window < self.dwell + self.probe:
            raise ValueError(f"{owner}.window must be >= dwell + probe = {self.dwell + self.probe}, got {self.window}")
        check_float(owner, "tolerance", self.tolerance, 0.0, 1.0, open_high=True)


@dataclass
class _Step:
    """One step of one (drafter, bucket), as the climb remembers it."""

    k: int  # draft length asked
    seconds: float  # sum of measured_row_seconds over the rows it served
    rows: int  # rows it served
    successes: int  # draft tokens matched
    failures: int  # proposals cut short by a rejection


@dataclass
class _Climb:
    """Hill-climbing state of one (drafter, bucket)."""

    home: int  # the k believed best
    trial: int | None = None  # the neighbour being measured, if any
    direction: int = 1  # +1: probe k + 1 next, -1: k - 1
    steps: int = 0  # steps measured since the last decision
    window: deque = field(default_factory=deque)  # recent _Step records

    def fitted_cost(self) -> Callable[[int], float] | None:
        """Seconds per produced token as a function of k, fitted on the window (None: < 2 distinct k).

        Row time per step is fitted linear in k (least squares over the window's steps, each row a
        point); tokens per step are E(a, k) with a the window's truncated-geometric MLE.
        """
        ks = [s.k for s in self.window for _ in range(s.rows)]
        if len(set(ks)) < 2:
            return None
        ys = [s.seconds / s.rows for s in self.window for _ in range(s.rows)]
        mk, my = sum(ks) / len(ks), sum(ys) / len(ys)
        slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
        slope = max(slope, 0.0)  # drafting more never takes less time
        intercept = my - slope * mk
        succ, fail = sum(s.successes for s in self.window), sum(s.failures for s in self.window)
        acceptance = succ / (succ + fail) if succ + fail else 0.5
        return lambda k: max(intercept + slope * k, 1e-12) / geometric_tokens(acceptance, k)


class MinionsLength(DraftLength):
    """Hill climbing on the fitted time per produced token (draft + verify share / (accepted + 1)).

    Per (drafter, bucket): stay `dwell` steps at `home`, then `probe` steps at a neighbour (toward
    the fitted minimum, else alternating), so the window spans several k. After each probe, fit
    the cost per token against k over the window (`_Climb.fitted_cost`) and move home one step
    toward the fitted minimum if that neighbour is cheaper by more than `tolerance`; a move is
    followed at once by the next probe the same way. One step per decision, over a window of recent
    steps: k follows drifts in cost and acceptance but never jumps on one noisy measurement.
    """

    def __init__(self, config: MinionsLengthConfig | None = None):
        self.config = config or MinionsLengthConfig()
        self.min_confidence = self.config.min_confidence
        self.climbs: dict[tuple[int, int], _Climb] = {}  # (drafter, bucket) -> state

    def _climb(self, drafter: int, batch_size: int) -> _Climb:
        key = (drafter, bucket(batch_size))
        if key not in self.climbs:
            self.climbs[key] = _Climb(home=self.config.initial, window=deque(maxlen=self.config.window))
        return self.climbs[key]

    def k(self, drafter: int, row: int, view: BatchView) -> int:
        climb = self._climb(drafter, view.batch_size)
        return climb.trial if climb.trial is not None else climb.home

    def update(self, feedback: StepFeedback) -> None:
        c = self.config
        for d in sorted({d for ds in feedback.plan.drafters for d in ds}):
            rows = rows_served(feedback, d)
            if not rows:
                continue
            climb = self._climb(d, feedback.batch_size)
            proposed = [feedback.proposed[b].get(d, 0) for b in rows]
            matched = [min(feedback.matched[b].get(d, 0), p) for b, p in zip(rows, proposed)]
            climb.window.append(
                _Step(
                    k=climb.trial if climb.trial is not None else climb.home,
                    seconds=sum(feedback.measured_row_seconds(b) for b in rows),
                    rows=len(rows),
                    successes=sum(matched),
                    failures=sum(m < p for m, p in zip(matched, proposed)),
                )
            )
            climb.steps += 1
            if climb.trial is None and climb.steps >= c.dwell:
                self._start_probe(climb)
            elif climb.trial is not None and climb.steps >= c.probe:
                self._decide(climb)

    def _decide(self, climb: _Climb) -> None:
        c, cost = self.config, climb.fitted_cost()
        climb.trial, climb.steps = None, 0
        if cost is None:
            return
        ks = range(c.min_k, c.max_k + 1)
        target = min(ks, key=cost)
        if target != climb.home:
            step = 1 if target > climb.home else -1
            if cost(climb.home + step) < cost(climb.home) * (1.0 - c.tolerance):
                climb.home, climb.direction = climb.home + step, step
                self._start_probe(climb)  # keep climbing without dwelling
                return
        climb.direction = -climb.direction

    def _start_probe(self, climb: _Climb) -> None:
        c = self.config
        for direction in (climb.direction, -climb.direction):
            if c.min_k <= climb.home + direction <= c.max_k:
                climb.trial, climb.direction, climb.steps = climb.home + direction, direction, 0
                return
        climb.steps = 0  # min_k == max_k: nothing to probe


# --- goodput-optimal k -------------------------------------------------------------------------


@dataclass
class GoodputLengthConfig:
    initial: int = DEFAULT_DRAFT_LENGTH  # k until a drafter's draft cost and the verify cost are measured (the prior)
    min_k: int = 1
    max_k: int = 16  # the verify fit is linear; far beyond the k it was measured at it extrapolates badly
    prior_acceptance: float = (
        0.6  # per-token acceptance assumed before measurements (typical of small same-family drafters)
    )
    prior_weight: float = 4.0  # pseudo draft tokens behind prior_acceptance: a few steps of evidence override it
    # every this many steps use k + 1, and k - 1 half-way, so N varies and the verify slope is measured (0: never)
    dither_every: int = 8
    min_confidence: float = 0.0  # see Plan.min_confidence

    def __post_init__(self):
        owner = "GoodputLengthConfig"
        _check_range(owner, self)
        check_float(owner, "prior_acceptance", self.prior_acceptance, 0.0, 1.0, open_low=True, open_high=True)
        check_float(owner, "prior_weight", self.prior_weight, 0.0, 1e9, open_low=True)
        check_int(owner, "dither_every", self.dither_every, 0)
        if self.dither_every == 1:
            raise ValueError(f"{owner}.dither_every must be 0 (never) or >= 2, got 1")


class GoodputLength(DraftLength):
    """k maximising expected tokens per second of one row's share of the step:

        k* = argmax_k  E(a_d, k) / (k c_d,bucket + t_verify,bucket(B (k + 1)) / B)

    a_d: per-token acceptance of drafter d, truncated-geometric MLE with a prior:
        (successes + prior_acceptance w) / (successes + failures + w), a failure being a proposal
        that was cut short by a rejection; c_d,bucket: draft seconds per row and draft token;
    t_verify: linear fit of verify seconds vs tokens verified (estimates.VerifyFit). The verify
    share assumes every row drafts k (the batch's rows mostly share one rule).
    """

    def __init__(self, config: GoodputLengthConfig | None = None):
        self.config = config or GoodputLengthConfig()
        self.min_confidence = self.config.min_confidence
        self.costs = CostModel(num_drafters=0)  # read for the verify cost: the policy's (`use_costs`), else its own
        self.own_costs = True  # it learns `costs` itself (a rule used without a policy)
        self.successes: list[float] = []  # [num_drafters] decayed accepted draft tokens
        self.failures: list[float] = []  # [num_drafters] decayed rejections
        self.draft_cost: dict[tuple[int, int], DecayedMean] = {}  # (drafter, bucket) -> seconds per row-token
        self.draft_cost_all: list[DecayedMean] = []  # [num_drafters] the same over all buckets
        self._cache: dict[tuple[int, int], int] = {}  # (drafter, batch size) -> k* for the view below
        self._cache_view: BatchView | None = None  # the step's view: k() is asked once per row and drafter

    def bind(self, drafters: list[DrafterInfo]) -> None:
        n = len(drafters)
        self.successes, self.failures = [0.0] * n, [0.0] * n
        self.draft_cost_all = [DecayedMean() for _ in range(n)]

    def use_costs(self, costs: CostModel) -> None:
        self.costs, self.own_costs = costs, False  # the policy learns them

    def acceptance(self, drafter: int) -> float:
        c = self.config
        s, f = self.successes[drafter], self.failures[drafter]
        return acceptance_with_prior(s, f, c.prior_acceptance, c.prior_weight)

    def best_k(self, drafter: int, batch_size: int) -> int | None:
        """k* from the current estimates, or None while a cost is unmeasured."""
        mean = self.draft_cost.get((drafter, bucket(batch_size)))
        c_draft = mean.mean if mean is not None else self.draft_cost_all[drafter].mean
        B = batch_size
        if c_draft is None or self.costs.verify_seconds(B, B) is None:
            return None
        acceptance = self.acceptance(drafter)

        def rate(k: int) -> float:
            return geometric_tokens(acceptance, k) / (k * c_draft + self.costs.verify_seconds(B, B * (k + 1)) / B)

        return max(range(self.config.min_k, self.config.max_k + 1), key=rate)

    def k(self, drafter: int, row: int, view: BatchView) -> int:
        c = self.config
        if view is not self._cache_view:
            self._cache, self._cache_view = {}, view
        key = (drafter, view.batch_size)
        if key not in self._cache:
            best = self.best_k(drafter, view.batch_size)
            self._cache[key] = c.initial if best is None else best
        k = self._cache[key]
        if c.dither_every and view.step % c.dither_every == 0:
            k += 1
        elif c.dither_every and view.step % c.dither_every == c.dither_every // 2:
            k -= 1
        return min(max(k, c.min_k), c.max_k)

    def update(self, feedback: StepFeedback) -> None:
        if self.own_costs:
            self.costs.update(feedback)
        b_key = bucket(feedback.batch_size)
        for d in range(len(self.successes)):
            self.successes[d] *= ACCEPTANCE_DECAY
            self.failures[d] *= ACCEPTANCE_DECAY
            rows = rows_served(feedback, d)
            for b in rows:
                proposed = feedback.proposed[b].get(d, 0)
                matched = min(feedback.matched[b].get(d, 0), proposed)
                self.successes[d] += matched
                self.failures[d] += 1.0 if matched < proposed else 0.0
            row_tokens = sum(feedback.plan.k[b] for b in rows)
            if row_tokens:
                per_token = feedback.draft_seconds[d] / row_tokens
                self.draft_cost.setdefault((d, b_key), DecayedMean()).add(per_token)
                self.draft_cost_all[d].add(per_token)
