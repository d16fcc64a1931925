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

from ..planning.estimates import RunningMean

# Alternating least-squares sweeps for a and b: the fit starts from the last one, so a few suffice.
SWEEPS = 4
# Prior sd of the request effect a_row in log tokens, before any request is measured: a request
# commits from ~1 token a step (open chat) to ~4-6 (code, a copied summary), e^+-1 around ~2.
PRIOR_REQUEST_SPREAD = 1.0


class TokensModel:
    def __init__(self, num_drafters: int, prior_spread: float, prior_rows: float, prior_noise: float, history: int):
        self.num_drafters = num_drafters
        self.prior_spread, self.prior_rows, self.prior_noise, self.history = (
            prior_spread,
            prior_rows,
            prior_noise,
            history,
        )
        self.rows: OrderedDict[int, list[RunningMean]] = (
            OrderedDict()
        )  # row id -> [num_drafters] log tokens, oldest first
        self.live: set[int] = set()
        self.a: dict[int, float] = {}  # row effects of the latest fit
        self.b: list[float | None] = [None] * num_drafters
        self.c = [0.0] * num_drafters  # slope of log tokens in x_row, per drafter
        self.x: dict[int, float] = {}  # row id -> log(prompt length), for rows that gave one
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
        self.rows[row_id] = [RunningMean() for _ in range(self.num_drafters)]
        self.live.add(row_id)
        if prompt_length is not None:
            self.x[row_id] = math.log(max(prompt_length, 1))
        self.predictions = {}  # the fit reads only rows with steps, so it stands; a new row's x does not

    def end(self, row_id: int) -> None:
        self.live.discard(row_id)
        ended = [r for r in self.rows if r not in self.live]
        for r in ended[: max(0, len(ended) - self.history)]:
            del self.rows[r]
            self.a.pop(r, None)
            self.x.pop(r, None)
        self.stale = True

    def add(self, row_id: int, drafter: int, tokens: float) -> None:
        if row_id not in self.rows:
            self.start(row_id)
        self.rows[row_id][drafter].add(math.log(tokens))
        self.stale = True

    @property
    def warm(self) -> bool:
        """Whether an ended request informs the estimates."""
        return len(self.rows) > len(self.live)

    def steps(self, row_id: int, drafter: int) -> int:
        """Steps of `drafter` measured on `row_id` (served or shadow)."""
        stats = self.rows.get(row_id)
        return stats[drafter].n if stats is not None else 0

    def requests(self, drafter: int) -> int:
        """Ended requests (of the kept `history`) that measured `drafter`."""
        self.fit()
        return self.ended[drafter]

    # --- fit -----------------------------------------------------------------------------------

    def fit(self) -> None:
        """a, (b, c) by alternating least squares on the row-drafter means; then tau_d and sigma_d. Each
        drafter's rows, their log prompt lengths' mean and spread are gathered once: the sweeps move only
        a, b and c."""
        if not self.stale:
            return
        self.stale = False
        self.predictions = {}
        D, w0 = self.num_drafters, self.prior_rows
        seen = {r: [(d, s[d]) for d in range(D) if s[d].n] for r, s in self.rows.items()}
        seen = {r: ds for r, ds in seen.items() if ds}  # row id -> [(drafter, its RunningMean)] measured
        a = {r: self.a.get(r, 0.0) for r in seen}
        x = {r: self.x.get(r) for r in seen}
        of = [[(r, s) for r, ds in seen.items() for e, s in ds if e == d] for d in range(D)]  # [D] (row id, stats)
        sxx = [0.0] * D
        for d, pairs in enumerate(of):
            if pairs:
                xs = [x[r] for r, _ in pairs if x[r] is not None]
                self.x_mean[d] = sum(xs) / len(xs) if xs else 0.0
                sxx[d] = sum((xr - self.x_mean[d]) ** 2 for xr in xs)
        b: list[float | None] = [None] * D
        for _ in range(SWEEPS):
            for d, pairs in enumerate(of):
                if not pairs:
                    b[d] = None
                    continue
                devs = [s.mean - a[r] for r, s in pairs]
                b[d] = sum(devs) / len(devs)
                sxy = sum(
                    (x[r] - self.x_mean[d]) * (dev - b[d]) for (r, _), dev in zip(pairs, devs) if x[r] is not None
                )
                self.c[d] = sxy / (sxx[d] + w0)
            self.b = b
            for r, ds in seen.items():
                a[r] = sum(s.mean - self._expected(d, x[r]) for d, s in ds) / len(ds)
        self.a = a
        # The spread of a over requests, around their mean (PRIOR_REQUEST_SPREAD behind prior_rows pseudo-rows).
        self.a_mean = sum(a.values()) / len(a) if a else 0.0
        sq = sum((v - self.a_mean) ** 2 for v in a.values())
        self.a_var = (sq + w0 * PRIOR_REQUEST_SPREAD**2) / (len(a) + w0)
        # tau_d: spread of e over rows that measured d and at least one other drafter. A row's m
        # residuals sum to zero, which shrinks each by (m - 1) / m on average: scaled back up.
        for d, pairs in enumerate(of):
            sq, count = 0.0, 0.0
            for r, s in pairs:
                if (m := len(seen[r])) > 1:
                    sq += (s.mean - a[r] - self._expected(d, x[r])) ** 2 * m / (m - 1)
                    count += 1
            self.tau2[d] = (sq + w0 * self.prior_spread**2) / (count + w0)
            m2 = sum(s.m2 for _, s in pairs)  # rows that never measured d add nothing
            dof = sum(s.n - 1 for _, s in pairs)
            self.sigma2[d] = (m2 + w0 * self.prior_noise**2) / (dof + w0)
            # var(b_d): b_d is the mean over the R_d rows that measured d of (mean_rd - a_r - ...),
            # each off by its own e_row,d and step noise: sum_r (tau_d^2 + sigma_d^2 / n_rd) / R_d^2.
            ns = [s.n for _, s in pairs]
            self.b_var[d] = sum(self.tau2[d] + self.sigma2[d] / n for n in ns) / len(ns) ** 2 if ns else 0.0
            self.ended[d] = sum(1 for r, _ in pairs if r not in self.live)

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
        x = self.x.get(row_id)
        for d, stats in enumerate(self.rows.get(row_id, [])):
            if d != exclude and stats.n and self.b[d] is not None:
                v = self.tau2[d] + self.sigma2[d] / stats.n + self.b_var[d]
                precision += 1.0 / v
                total += (stats.mean - self._expected(d, x)) / v
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
        prior, prior_var = (
            a + self._expected(drafter, self.x.get(row_id)),
            a_var + self.tau2[drafter] + self.b_var[drafter],
        )
        stats = self.rows.get(row_id)
        n, mean = (stats[drafter].n, stats[drafter].mean) if stats is not None else (0, 0.0)
        precision = 1.0 / prior_var + n / self.sigma2[drafter]
        return (prior / prior_var + n * mean / self.sigma2[drafter]) / precision, precision**-0.5
