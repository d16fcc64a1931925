"""What LBSS knows of a drafter on a request it has not (or barely) tried: a two-way model of the
log tokens a step commits (accepted + 1), learned across requests, so a new request starts from
what earlier requests showed. Tokens, not goodput: they depend on the request and the drafter
only; the seconds a step takes depend on the batch size and the device and come from the cost
fits (`lbss/pricing.py`, `Pricing.row_seconds`; docs/lbss.md#goodput).

    log n(row, d) = a_row + b_d + c_d (x_row - x_d) + e_row,d + noise,
    e_row,d ~ N(0, tau_d^2),   noise ~ N(0, sigma_d^2),   x_row = log(prompt length)

- a_row: how predictable the request's text is, for every drafter (code and summaries commit
  several tokens a step, open chat one or two). It cancels when drafters are compared on one row,
  so one drafter's measurement on a row says how many tokens the others would commit there.
- b_d: how good drafter d is on the average request (that measured it: x_d is their mean x).
- c_d: how that changes with the prompt's length, known before the request drafts anything:
  prompt lookup gains on long prompts it can copy from (summaries, retrieval). A ridge regression
  over rows, shrunk toward 0 by `prior_rows` pseudo-rows at unit spread of x, so a few requests do
  not make a slope.
- e_row,d: how much this request departs from that for d (prompt lookup on summarization: large;
  two chat models of one family: small). tau_d is its spread over requests, estimated from rows
  that tried several drafters (with `prior_rows` pseudo-rows at `prior_spread`, so the first
  requests still explore).
- sigma_d: step-to-step noise within a row.

The prediction for (row, d) is the Gaussian posterior of a_row + b_d + c_d (x_row - x_d) + e_row,d:
a_row from the row's *other* drafters (each weighed by how much it varies between requests and how
often the row measured it) and the spread of a over requests; then the row's own n steps with d.
b_d is itself an average over the R_d requests that measured d, off by var(b_d) =
sum_r (tau_d^2 + sigma_d^2 / n_rd) / R_d^2, which widens both: a drafter one request measured for
a step or two stays uncertain, where treating its b_d as known made it look as well measured as
one measured on every request.
Mean and standard deviation, in log tokens. `None` for a drafter no request
has measured yet. Rows are kept after they end (the last `history` of them): they are the evidence.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

# Alternating least-squares sweeps for a and b: the fit starts from the last one, so a few suffice.
SWEEPS = 4
# Prior sd of the request effect a_row in log tokens, before any request is measured: a request
# commits from ~1 token a step (open chat) to ~4-6 (code, a copied summary), e^+-1 around ~2.
PRIOR_REQUEST_SPREAD = 1.0


class TokensModel:
    """The evidence lives in arrays, a slot per kept row: `fit` runs every step a policy learned something, over
    every kept request (up to `history` ended ones), and as Python loops over cells it cost a millisecond a step
    with the history full; on the arrays, a tenth of that."""

    def __init__(self, num_drafters: int, prior_spread: float, prior_rows: float, prior_noise: float, history: int):
        self.num_drafters = num_drafters
        self.prior_spread, self.prior_rows, self.prior_noise, self.history = (
            prior_spread,
            prior_rows,
            prior_noise,
            history,
        )
        self.slots: OrderedDict[int, int] = OrderedDict()  # row id -> its slot in the arrays, oldest first
        self.free: list[int] = []  # slots of dropped rows
        # [slots, num_drafters] each row's steps with each drafter: count, mean log tokens, Welford's m2
        self.n, self.mean, self.m2 = (np.zeros((0, num_drafters)) for _ in range(3))
        self.x = np.zeros(0)  # [slots] log(prompt length), nan where the row gave none
        self.a = np.zeros(0)  # [slots] row effects of the latest fit (its warm start)
        self.live: set[int] = set()
        self.b: list[float | None] = [None] * num_drafters
        self.c = [0.0] * num_drafters  # slope of log tokens in x_row, per drafter
        self.x_mean: list[float] = [0.0] * num_drafters  # x_d
        self.a_mean, self.a_var = 0.0, PRIOR_REQUEST_SPREAD**2  # a over requests
        self.tau2 = [prior_spread**2] * num_drafters
        self.sigma2 = [prior_noise**2] * num_drafters
        self.b_var = [0.0] * num_drafters  # var(b_d): how well the requests that measured d pin its mean effect
        self.ended = [0] * num_drafters  # ended requests (of the kept history) that measured each drafter
        self.stale = True
        self.predictions: dict[
            tuple[int, int], tuple[float, float] | None
        ] = {}  # (row id, drafter) -> `predict`, until the evidence changes

    # --- evidence ------------------------------------------------------------------------------

    def start(self, row_id: int, prompt_length: int | None = None) -> None:
        slot = self.slots.get(row_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.slots[row_id] = self.free.pop()
        self.n[slot], self.mean[slot], self.m2[slot], self.a[slot] = 0.0, 0.0, 0.0, 0.0
        self.x[slot] = math.log(max(prompt_length, 1)) if prompt_length is not None else math.nan
        self.live.add(row_id)
        self.predictions = {}  # the fit reads only rows with steps, so it stands; a new row's x does not

    def _grow(self) -> None:
        """Twice the slots (at least 8), the new ones free."""
        old = len(self.x)
        new = max(8, 2 * old)
        self.n, self.mean, self.m2 = (
            np.concatenate([v, np.zeros((new - old, self.num_drafters))]) for v in (self.n, self.mean, self.m2)
        )
        self.x, self.a = (
            np.concatenate([self.x, np.full(new - old, math.nan)]),
            np.concatenate([self.a, np.zeros(new - old)]),
        )
        self.free += range(new - 1, old - 1, -1)

    def end(self, row_id: int) -> None:
        self.live.discard(row_id)
        ended = [r for r in self.slots if r not in self.live]
        for r in ended[: max(0, len(ended) - self.history)]:
            self.free.append(self.slots.pop(r))  # `start` clears it for the row that takes it
        self.stale = True

    def add(self, row_id: int, drafter: int, tokens: float) -> None:
        if row_id not in self.slots:
            self.start(row_id)
        slot, value = self.slots[row_id], math.log(tokens)
        n = self.n[slot, drafter] + 1  # Welford's update of the cell
        delta = value - self.mean[slot, drafter]
        mean = self.mean[slot, drafter] + delta / n
        self.n[slot, drafter], self.mean[slot, drafter] = n, mean
        self.m2[slot, drafter] += delta * (value - mean)
        self.stale = True

    @property
    def warm(self) -> bool:
        """Whether an ended request informs the estimates."""
        return len(self.slots) > len(self.live)

    def steps(self, row_id: int, drafter: int) -> int:
        """Steps of `drafter` measured on `row_id` (served or shadow)."""
        slot = self.slots.get(row_id)
        return int(self.n[slot, drafter]) if slot is not None else 0

    def requests(self, drafter: int) -> int:
        """Ended requests (of the kept `history`) that measured `drafter`."""
        self.fit()
        return self.ended[drafter]

    def _row(self, row_id: int) -> tuple[list[float], list[float], float | None]:
        """The row's (steps, mean log tokens) per drafter and its log prompt length (None: unknown)."""
        slot = self.slots.get(row_id)
        if slot is None:
            return [0.0] * self.num_drafters, [0.0] * self.num_drafters, None
        x = float(self.x[slot])
        return self.n[slot].tolist(), self.mean[slot].tolist(), None if math.isnan(x) else x

    # --- fit -----------------------------------------------------------------------------------

    def fit(self) -> None:
        """a, (b, c) by alternating least squares on the row-drafter means; then tau_d and sigma_d: over the
        slots whose rows measured anything [R] and the drafters [D], each cell weighing the same."""
        if not self.stale:
            return
        self.stale = False
        self.predictions = {}
        D, w0 = self.num_drafters, self.prior_rows
        kept = np.fromiter(self.slots.values(), dtype=int, count=len(self.slots))
        measured = self.n[kept].any(axis=1)  # [kept] rows that measured any drafter
        ids = [r for r, m in zip(self.slots, measured.tolist()) if m]  # [R]
        if not ids:
            self.b, self.ended, self.a_mean, self.a_var = [None] * D, [0] * D, 0.0, PRIOR_REQUEST_SPREAD**2
            self.tau2, self.sigma2, self.b_var = [self.prior_spread**2] * D, [self.prior_noise**2] * D, [0.0] * D
            return
        slots = kept[measured]
        n, mean, m2, x = self.n[slots], self.mean[slots], self.m2[slots], self.x[slots]  # [R, D], [R]
        w = (n > 0).astype(float)  # [R, D] measured
        per = w.sum(axis=0)  # [D] rows that measured each drafter
        known = per > 0
        wx = w * ~np.isnan(x)[:, None]  # [R, D] measured, with a known x
        x0 = np.nan_to_num(x)  # [R]
        x_mean = np.where(known, (wx * x0[:, None]).sum(axis=0) / np.maximum(wx.sum(axis=0), 1), self.x_mean)
        dx = (x0[:, None] - x_mean) * wx  # [R, D] x_row - x_d where it counts, else 0
        sxx = (dx * dx).sum(axis=0)  # [D]
        cells = w.sum(axis=1)  # [R] drafters each row measured
        a, c = self.a[slots], np.array(self.c)  # warm start: the last fit's
        for _ in range(SWEEPS):
            dev = (mean - a[:, None]) * w  # [R, D]
            b = dev.sum(axis=0) / np.maximum(per, 1)  # [D]
            c = np.where(known, (dx * (dev - b * w)).sum(axis=0) / (sxx + w0), c)
            a = ((mean - b - c * dx) * w).sum(axis=1) / cells
        self.a[slots] = a
        self.b = [float(v) if k else None for v, k in zip(b, known)]
        self.c, self.x_mean = c.tolist(), x_mean.tolist()
        # The spread of a over requests, around their mean (PRIOR_REQUEST_SPREAD behind prior_rows pseudo-rows).
        self.a_mean = float(a.mean())
        self.a_var = float((((a - self.a_mean) ** 2).sum() + w0 * PRIOR_REQUEST_SPREAD**2) / (len(a) + w0))
        # tau_d: spread of e over rows that measured d and at least one other drafter. A row's m
        # residuals sum to zero, which shrinks each by (m - 1) / m on average: scaled back up.
        several = w * (cells > 1)[:, None]  # [R, D]
        residual = mean - a[:, None] - b - c * dx
        scale = (cells / np.maximum(cells - 1, 1))[:, None]
        tau2 = ((residual * residual * scale * several).sum(axis=0) + w0 * self.prior_spread**2) / (
            several.sum(axis=0) + w0
        )
        sigma2 = ((m2 * w).sum(axis=0) + w0 * self.prior_noise**2) / (((n - 1) * w).sum(axis=0) + w0)
        # var(b_d): b_d is the mean over the R_d rows that measured d of (mean_rd - a_r - ...),
        # each off by its own e_row,d and step noise: sum_r (tau_d^2 + sigma_d^2 / n_rd) / R_d^2.
        b_var = (tau2 * per + sigma2 * (w / np.maximum(n, 1)).sum(axis=0)) / np.maximum(per, 1) ** 2
        self.tau2, self.sigma2, self.b_var = tau2.tolist(), sigma2.tolist(), b_var.tolist()
        ended = np.array([r not in self.live for r in ids], dtype=float)  # [R]
        self.ended = [int(v) for v in ended @ w]

    def _expected(self, drafter: int, x: float | None) -> float:
        """b_d + c_d (x - x_d): drafter d's effect on a row of log prompt length x (None: unknown, b_d)."""
        b = self.b[drafter]
        return b + (self.c[drafter] * (x - self.x_mean[drafter]) if x is not None else 0.0)

    def tokens_per_step(self, row_id: int, drafter: int, optimism: float = 0.0) -> float | None:
        """Expected tokens of the next step of `drafter` on `row_id`: the log-normal mean
        exp(m + (s^2 + sigma_d^2) / 2) of the posterior (m, s) (`predict`) and the step noise. Before
        the row's own steps with d: exp(a_row + b_d + c_d (x_row - x_d) + (var(a_row) + tau_d^2 + sigma_d^2) / 2).
        optimism z: with m + z s for m (an upper confidence bound, z posterior sds up). None if never
        measured."""
        p = self.predict(row_id, drafter)
        return None if p is None else math.exp(p[0] + optimism * p[1] + (p[1] ** 2 + self.sigma2[drafter]) / 2)

    def row_effect(self, row_id: int, exclude: int | None = None) -> tuple[float, float]:
        """Posterior (mean, variance) of a_row from the row's drafters other than `exclude`: drafter
        d measured n times says a_row = mean - b_d - c_d (x_row - x_d), give or take
        tau_d^2 + sigma_d^2 / n + var(b_d); combined with the spread of a over requests around their mean (an
        average request when nothing else is known). Leaving the predicted drafter out keeps its own
        steps from counting twice (in a_row and again as data), and a drafter whose effect varies
        a lot between requests (prompt lookup) says little about a_row."""
        self.fit()
        precision, total = 1.0 / self.a_var, self.a_mean / self.a_var
        ns, means, x = self._row(row_id)
        for d, (n, mean) in enumerate(zip(ns, means)):
            if d != exclude and n and self.b[d] is not None:
                v = self.tau2[d] + self.sigma2[d] / n + self.b_var[d]
                precision += 1.0 / v
                total += (mean - self._expected(d, x)) / v
        return total / precision, 1.0 / precision

    def predict(self, row_id: int, drafter: int) -> tuple[float, float] | None:
        """Posterior (mean, sd) of log tokens of `drafter` on `row_id`: the prior a_row + b_d +
        c_d (x_row - x_d), a_row from the row's other drafters (`row_effect`), with variance
        var(a_row) + tau_d^2 + var(b_d), updated by the row's own n steps with d. None if never measured."""
        self.fit()
        key = (row_id, drafter)
        if key not in self.predictions:  # a policy reads each (row, drafter) several times a step
            self.predictions[key] = self._predict(row_id, drafter)
        return self.predictions[key]

    def _predict(self, row_id: int, drafter: int) -> tuple[float, float] | None:
        if self.b[drafter] is None:
            return None
        a, a_var = self.row_effect(row_id, exclude=drafter)
        ns, means, x = self._row(row_id)
        n, mean = ns[drafter], means[drafter]
        prior, prior_var = a + self._expected(drafter, x), a_var + self.tau2[drafter] + self.b_var[drafter]
        precision = 1.0 / prior_var + n / self.sigma2[drafter]
        return (prior / prior_var + n * mean / self.sigma2[drafter]) / precision, precision**-0.5
