"""Online estimates the learning policies share: running means, decayed least-squares fits, and
the step-cost model (verify cost vs tokens verified, draft cost per drafter, catch-up cost).

Nothing here decides anything; policies read these numbers and decide.

Notation: B = rows in the step, N = tokens verified in the step (B + drafted), k = draft length,
a = per-token acceptance (a draft token is accepted with probability a given that the
ones before it were), E(k) = (1 - a^(k+1)) / (1 - a) = expected tokens per step (`geometric_tokens`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .plan import StepFeedback

# Forgetting factor of the decayed fits, per observation: costs drift (other work on the device,
# cache growth) and an effective memory of ~1 / (1 - 0.98) = 50 observations follows that drift
# while still averaging out timing noise.
COST_DECAY = 0.98
# Prior elasticity of verify time in tokens verified (d log t / d log N), used while N has barely
# varied and the slope cannot be measured. GPUs verify a few tokens per row at nearly the cost of
# one (memory-bound, elasticity ~0.1 on the packaged models), CPUs closer to proportionally (~0.8);
# 0.2 leans to the GPU. Extrapolated to N = B the fit can be far off either way, so measured plain
# steps correct it there (`CostModel.plain_goodput`).
VERIFY_ELASTICITY_PRIOR = 0.2
# How far (in log seconds) the verify fit at N = B may sit from measured plain steps before it is
# corrected by that bias: about twice the step-to-step timing noise of one measured step (~7% on a
# CPU), so a lone noisy plain step does not override the fit, but a fit off by 40% is not trusted.
PLAIN_FIT_TOLERANCE = 0.15
# Weight of that prior, in squared units of the mean N (scale-free): a few steps at other N
# (rows finishing, rows decoding plainly, adaptive k) override it.
VERIFY_PRIOR_WEIGHT = 0.02


def bucket(batch_size: int) -> int:
    """Batch-size bucket: 1 -> 0, 2-3 -> 1, 4-7 -> 2, 8-15 -> 3, ... (costs change slowly with B)."""
    return max(int(batch_size), 1).bit_length() - 1


def acceptance_with_prior(accepted: float, rejected: float, prior: float, weight: float) -> float:
    """Acceptance estimated from counts and a prior worth `weight` pseudo-observations:
    (accepted + prior weight) / (accepted + rejected + weight)."""
    return (accepted + prior * weight) / (accepted + rejected + weight)


def geometric_tokens(acceptance: float, k: int) -> float:
    """E[accepted + 1] for k drafts with per-token acceptance `acceptance` (truncated geometric)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class RunningMean:
    """Plain running mean (every observation weighs the same), with Welford's sum of squared
    deviations `m2` (variance = m2 / (n - 1))."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)


class DecayedMean:
    """Exponentially forgetting mean; `weight` is the effective number of observations."""

    def __init__(self, decay: float = COST_DECAY):
        self.decay, self.weight, self.total = decay, 0.0, 0.0

    def add(self, x: float, w: float = 1.0) -> None:
        self.weight = self.weight * self.decay + w
        self.total = self.total * self.decay + w * x

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class VerifyFit:
    """t(N) = a + b N, fitted by decayed least squares on (N, seconds).

    While N has barely varied the slope is not identified, so it is shrunk toward a prior
    elasticity: b0 = e0 * mean(t) / mean(N). The slope is clamped to [0, mean(t) / mean(N)], so
    t(N) lies between flat (memory-bound) and proportional to N (compute-bound) and a >= 0.
    """

    def __init__(self, decay: float = COST_DECAY):
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._ab: tuple[float, float] | None = (
            None  # coefficients() since the last add (a policy reads them ~50x a step)
        )

    def add(self, n_tokens: float, seconds: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + n_tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + n_tokens * n_tokens, self.sxy * d + n_tokens * seconds
        self._ab = None

    @property
    def count(self) -> float:
        return self.w

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) or None before any observation."""
        if self.w <= 0:
            return None
        if self._ab is None:
            self._ab = self._solve()
        return self._ab

    def _solve(self) -> tuple[float, float]:
        mx, my = self.sx / self.w, self.sy / self.w
        cxx = self.sxx - self.sx * mx  # centred sums
        cxy = self.sxy - self.sx * my
        lam = VERIFY_PRIOR_WEIGHT * mx * mx
        b0 = VERIFY_ELASTICITY_PRIOR * my / mx if mx > 0 else 0.0
        b = (cxy + lam * b0) / (cxx + lam) if cxx + lam > 0 else b0
        b = min(max(b, 0.0), my / mx if mx > 0 else 0.0)
        return my - b * mx, b

    def predict(self, n_tokens: float) -> float | None:
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * n_tokens


class DecayedLeastSquares:
    """y = x . theta without intercept, decayed. A ridge proportional to each feature's own scale
    (scale-free) keeps collinear features apart and features never seen at 0."""

    def __init__(self, n_features: int, decay: float = COST_DECAY, ridge: float = 1e-3):
        self.xtx = np.zeros((n_features, n_features))
        self.xty = np.zeros(n_features)
        self.decay, self.ridge, self.count = decay, ridge, 0.0
        self._theta: np.ndarray | None = None  # coefficients() since the last add

    def add(self, x: list[float], y: float) -> None:
        x = np.asarray(x, dtype=float)
        self.xtx = self.xtx * self.decay + np.outer(x, x)
        self.xty = self.xty * self.decay + x * y
        self.count = self.count * self.decay + 1
        self._theta = None

    def coefficients(self) -> np.ndarray:
        """theta clamped at >= 0 (costs are never negative); read-only (shared until the next add)."""
        if self._theta is None:
            ridge = np.diag(self.ridge * np.diag(self.xtx) + 1e-12)
            self._theta = np.clip(np.linalg.solve(self.xtx + ridge, self.xty), 0.0, None)
            self._theta.flags.writeable = False
        return self._theta


@dataclass
class DraftObservation:
    """What one drafter did in one step, as the draft-cost fit sees it: the tokens it actually
    drafted, not the k it was asked for. A model drafter runs one forward per token of its longest
    draft (the catch-up forward yields the first), and a confidence stop ends most drafts early: on
    a CPU at batch 1, drafts of 1-3 of k = 5 tokens, and seconds in proportion (SmolLM2-135M
    0.04 s for one token). Fitted on the planned k, every step looked like 5 forwards, so a drafter
    was priced at the mean draft length of the steps it happened to be chosen on."""

    forwards: int  # sequential forwards: the longest draft among its rows, at least 1
    row_tokens: int  # draft tokens it proposed, summed over the rows it served
    rows: int  # rows it served

    @classmethod
    def of(cls, feedback: StepFeedback, drafter: int) -> DraftObservation | None:
        """The drafter's work in the step; None when it served no row (it only caught up or shadowed)."""
        plan = feedback.plan
        drafted = [
            feedback.proposed[b].get(drafter, 0)
            for b, (ds, k) in enumerate(zip(plan.drafters, plan.k))
            if drafter in ds and k > 0
        ]
        if not drafted:
            return None
        return cls(max(1, max(drafted)), sum(drafted), len(drafted))


def longest_draft(k: int, fill: float, rows: float) -> float:
    """Expected longest of `rows` drafts of up to k tokens that each reach k with probability
    `fill`: k (1 - (1 - fill)^rows); exact for all-or-nothing drafts, an upper bound otherwise. A fill
    above 1 (token trees: more nodes than k) is every draft's width: k fill."""
    return k * fill if fill >= 1 else k * (1 - (1 - fill) ** rows)


class CostModel:
    """The step costs every policy reads (`Policy.costs`), one interface whether or not a cost
    profile exists: once the pool's `CostProfile` is attached (`attach`, from `Policy.attach_profile`)
    it answers verify, plain and model-drafter costs; without one (profile "off"), and for what it does
    not measure (model-free drafters' costs, catch-ups, plain-step ages), the fits below, learned from
    every step's `StepFeedback`.

    verify: per batch-size bucket and overall, t_verify(N) (see `VerifyFit`; N = the token positions
    the forward ran, `StepFeedback.verified_tokens`); and, per bucket, how far steps that drafted
    nothing (N = B) sat from the fit: its extrapolation error at N = B (at batch 4 on a CPU it made
    plain decoding ~40% slower than measured).
    draft: per drafter, seconds = f * forwards + t * row_tokens + c * switch_tokens (forwards and
    row tokens as drafted: `DraftObservation`), c the per-token catch-up cost that a drafter switch
    pays. f and t are fitted (decayed least squares, clamped
    >= 0) on the steps without a catch-up only; c is the decayed mean of what the steps with one
    took beyond that, per catch-up token. One least-squares fit of the three on a drafter's first
    step (5 draft tokens, 52 catch-up tokens, 0.45 s for SmolLM2-135M on a CPU) gave f and t two
    thirds of the time, a steady step five times its measured cost, and the drafter was never
    chosen again to correct it.

    Its interface, all a policy reads: `verify_seconds`, `plain_seconds`, `plain_goodput`,
    `steps_without_plain`, `draft_seconds`, `knows_draft`, `draft_evidence`, `catch_up_seconds`,
    `catch_up_evidence` (and `attach`, `update`). The fits' attributes are its own.
    """

    def __init__(self, num_drafters: int):
        self.verify_by_bucket: dict[int, VerifyFit] = defaultdict(VerifyFit)
        self.verify_all = VerifyFit()
        self.plain_bias: dict[int, DecayedMean] = defaultdict(
            DecayedMean
        )  # bucket -> log(measured / fitted) of its plain steps
        self.plain_age: dict[int, float] = {}  # bucket -> its steps since the last plain one (inf: none yet)
        self.draft = [DecayedLeastSquares(2) for _ in range(num_drafters)]  # f, t
        self.catch_up = [DecayedMean() for _ in range(num_drafters)]  # c
        self.profile = None  # the pool's CostProfile, once attached: it answers for the fits below

    def attach(self, profile) -> None:
        """Answer from `profile` (a `CostProfile`: measured, refined online) where it measures, from
        the fits elsewhere. The fits keep learning meanwhile."""
        self.profile = profile

    def update(self, feedback: StepFeedback, switch_tokens: list[float] | None = None) -> None:
        B = feedback.batch_size
        n_tokens = feedback.verified_tokens()
        self.verify_by_bucket[bucket(B)].add(n_tokens, feedback.verify_seconds)
        self.verify_all.add(n_tokens, feedback.verify_seconds)
        if n_tokens == B:
            fitted = self.verify_seconds(B, B)  # with this step in the fit: the error its line cannot absorb
            if fitted and fitted > 0 and feedback.verify_seconds > 0:
                self.plain_bias[bucket(B)].add(math.log(feedback.verify_seconds / fitted))
            self.plain_age[bucket(B)] = 0
        else:
            self.plain_age[bucket(B)] = self.plain_age.get(bucket(B), float("inf")) + 1
        for d, seconds in enumerate(feedback.draft_seconds[: len(self.draft)]):
            work = DraftObservation.of(feedback, d)
            extra = switch_tokens[d] if switch_tokens else 0.0
            if extra > 0:
                steady = self.draft_seconds(d, work.forwards, work.row_tokens) if work else 0.0
                self.catch_up[d].add(max(seconds - steady, 0.0) / extra, extra)
            elif work:
                self.draft[d].add([work.forwards, work.row_tokens], seconds)

    def verify_seconds(self, batch_size: int, n_tokens: float) -> float | None:
        """Predicted verify time of a step with `batch_size` rows and `n_tokens` tokens verified."""
        if self.profile is not None:
            return self.profile.verify_seconds(batch_size, n_tokens)
        fit = self.verify_by_bucket.get(bucket(batch_size))
        if fit is None or fit.count < 1:
            fit = self.verify_all
        return fit.predict(n_tokens)

    def plain_seconds(self, batch_size: int) -> float | None:
        """Seconds of a plain step (N = B): see `plain_goodput` (the profile's, once attached)."""
        if self.profile is not None:
            return self.profile.plain_seconds(batch_size)
        t = self.verify_seconds(batch_size, batch_size)
        if t is None or t <= 0:
            return None
        bias = self.plain_bias.get(bucket(batch_size))
        if bias is not None and bias.weight > 0 and abs(bias.mean) > PLAIN_FIT_TOLERANCE:
            t *= math.exp(bias.mean)
        return t

    def plain_goodput(self, batch_size: int) -> float | None:
        """Tokens per second of one row under plain decoding: B / t_verify(N = B) from the fit (it
        follows the current requests' context lengths), corrected by how far measured plain steps
        at this batch-size bucket sat from it (log measured / fitted, decayed mean) when that bias
        exceeds PLAIN_FIT_TOLERANCE: the probe measures the fit's extrapolation error, not an
        absolute time that would go stale when the context changes. None before any step."""
        t = self.plain_seconds(batch_size)
        return None if t is None else batch_size / t

    def steps_without_plain(self, batch_size: int) -> float:
        """Steps at this batch-size bucket since the last plain one (inf: none yet)."""
        return self.plain_age.get(bucket(batch_size), float("inf"))

    def draft_seconds(self, drafter: int, forwards: float, row_tokens: float) -> float:
        """Predicted seconds of one step of `drafter`'s drafts, catch-up aside: `forwards` sequential
        forwards (its longest draft, in tokens) and `row_tokens` draft tokens summed over the rows it
        serves (not rows: the profile's `CostProfile.draft_seconds_for_rows` takes rows, here
        row_tokens / forwards). 0 before a step without catch-up: an unmeasured drafter looks free,
        so it gets tried."""
        if self.profile is not None and self.profile.drafters[drafter] is not None:
            rows = max(1, round(row_tokens / max(forwards, 1)))
            return self.profile.draft_seconds_for_rows(drafter, forwards, rows)
        if self.draft[drafter].count <= 0:
            return 0.0
        f, t = self.draft[drafter].coefficients()
        return float(f * forwards + t * row_tokens)

    def knows_draft(self, drafter: int) -> bool:
        """Whether `drafter`'s draft cost is known: measured by the profile, or fitted on a step."""
        return (self.profile is not None and self.profile.drafters[drafter] is not None) or self.draft[
            drafter
        ].count > 0

    def draft_evidence(self, drafter: int) -> float:
        """How much the fitted draft cost of `drafter` rests on: the steps without a catch-up it
        drafted in, decayed (an effective count; 0 before any). The profile's measurement does not
        count: this says which drafter's fit to scale from (`Pricing.draft_seconds`)."""
        return self.draft[drafter].count

    def catch_up_seconds(self, drafter: int) -> float:
        """Seconds per token that `drafter` spends catching up a row it did not serve (0 before any)."""
        return self.catch_up[drafter].mean or 0.0

    def catch_up_evidence(self, drafter: int) -> float:
        """How much `catch_up_seconds(drafter)` rests on: the tokens `drafter` was seen catching up,
        decayed (an effective count; 0 before any)."""
        return self.catch_up[drafter].weight
