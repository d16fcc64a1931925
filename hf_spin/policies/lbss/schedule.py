"""Each row's epoch schedule, and what it may explore (docs/lbss.md#epochs, docs/lbss.md#exploration).

Epoch e = [exploration: alpha steps, in chunks of beta] [exploitation: 2^e steps], counted in the
steps the row has been in the batch; exploration thus costs O(alpha log T) of T steps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .pricing import Pricing
from .state import PLAIN, RowState

PRIOR_STEPS = 4.0  # pseudo-steps at the mean over all rows behind a row's tokens per step in `steps_left`


class Stage(NamedTuple):
    epoch: int
    explore: bool
    chunk_start: bool  # exploring: this step starts a chunk
    end: int  # age at which the chunk (exploring) or the exploitation stage ends
    epoch_end: int  # age at which the epoch (its exploitation stage) ends


def knowledge_gradient(delta: float, spread: float) -> float:
    """E[max(mu_0 + delta + spread Z, mu_0)] - mu_0, Z ~ N(0, 1): what learning a drafter's mean to
    within `spread` gains over an incumbent `delta` above it (docs/lbss.md#knowledge_gradient)."""
    if spread > 0:
        z = delta / spread
        return spread * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) + delta * (1 + math.erf(z / math.sqrt(2))) / 2
    return max(delta, 0.0)


class Schedule(Pricing):
    """Where a row is in its epochs, and which drafters it may explore or move to."""

    def stage(self, age: int) -> Stage:
        """Where a row of this age is in its epochs."""
        start, epoch = 0, 1
        while age >= start + self.alpha + 2**epoch:
            start += self.alpha + 2**epoch
            epoch += 1
        offset = age - start
        if offset < self.alpha:
            end = start + min((offset // self.config.beta + 1) * self.config.beta, self.alpha)
            return Stage(epoch, True, offset % self.config.beta == 0, end, start + self.alpha + 2**epoch)
        return Stage(epoch, False, False, start + self.alpha + 2**epoch, start + self.alpha + 2**epoch)

    @staticmethod
    def in_chunk(row: RowState) -> bool:
        """Whether the row is inside an exploration chunk (its drafter drawn at an earlier step)."""
        return row.chunk_drafter is not None and row.age < row.chunk_end

    def explores(self, row: RowState, age: int) -> bool:
        """Whether the row explores at this age: whether it has a drafter to explore (`explorable`)."""
        return bool(self.explorable(row, age))

    def explorable(self, row: RowState, age: int) -> set[int]:
        """The drafters the row may explore at this age; the others are slots of last resort.

        None outside an exploration stage, nor past the first epoch in a stage the request cannot
        finish; else the drafters not measured by shadow drafts that pass `pays_off` and
        `worth_exploring`. Warm, in an epoch with 2^e < alpha, only those fewer than `settle` ended
        requests measured and the row has not tried, so one unlucky chunk on an early request does
        not rank a drafter for good (docs/lbss.md#settle)."""
        st = self.stage(age)
        if not st.explore or (st.epoch > 1 and self.steps_left(row) < st.epoch_end - age):
            return set()
        candidates = {d for d in range(len(self.drafters)) if not self.shadowed[d]}
        if self.tokens_model.warm and 2**st.epoch < self.alpha:
            settle = self.config.settle
            candidates = {d for d in candidates if not row.arms[d].tries and self.tokens_model.requests(d) < settle}
        return {d for d in candidates if self.pays_off(row, d) and self.worth_exploring(row, d)}

    def pays_off(self, row: RowState, drafter: int) -> bool:
        """Whether catching `drafter` up on the row (s = c_d x lag seconds) can pay for itself: s at
        most what a drafter `catch_up_margin` faster than plain decoding saves over the steps left,
        steps_left / g_plain x margin. True while either cost is unknown
        (docs/lbss.md#catch_up_margin)."""
        s = self.catch_up_seconds(drafter) * self.lag(row, drafter)
        g_plain = self.costs.plain_goodput(self.batch_size)
        if s <= 0 or not g_plain:
            return True
        return s <= self.steps_left(row) / g_plain * self.config.catch_up_margin

    def worth_exploring(self, row: RowState, drafter: int) -> bool:
        """Whether a chunk of `drafter` on the row is worth what it costs (`knowledge_gradient`).

        Gain: the knowledge gradient of the chunk's beta steps on d's posterior log goodput against
        the row's incumbent (its best other option at the mean, plain decoding included), over the
        steps left after them. Cost: the incumbent's steps the chunk gives up, beta (t_d / t_0)
        (1 - e^min(delta, 0)), plus the catch-up over t_0. True for a drafter fewer than `settle`
        ended requests measured and while anything is unknown. Derivation and evidence:
        docs/lbss.md#knowledge_gradient."""
        if not self.config.knowledge_gradient or self.tokens_model.requests(drafter) < self.config.settle:
            return True
        steps = self.steps_left(row) - self.config.beta
        estimate = self.log_goodput(row, drafter)
        if estimate is None or math.isinf(steps):
            return True
        options = [(self.log_goodput(row, e), e) for e in range(len(self.drafters)) if e != drafter and row.usable[e]]
        options = [(m[0], e) for m, e in options if m is not None]
        plain = self.row_seconds(PLAIN, 0, self.batch_size)
        if self.config.never_slower and plain:
            options.append((-math.log(plain), PLAIN))
        if not options:
            return True
        mu0, incumbent = max(options)
        (mu, sd), beta = estimate, self.config.beta
        spread = sd**2 / math.sqrt(sd**2 + self.tokens_model.sigma2[drafter] / beta)
        delta = mu - mu0
        kg = knowledge_gradient(delta, spread)
        t0 = plain if incumbent == PLAIN else self.row_seconds(incumbent, row.ks[incumbent], self.batch_size)
        td = self.row_seconds(drafter, row.ks[drafter], self.batch_size)
        cost = (
            beta * td / t0 * (1 - math.exp(min(delta, 0.0)))
            + self.catch_up_seconds(drafter) * self.lag(row, drafter) / t0
        )
        return kg * max(steps, 0.0) > cost

    def log_goodput(self, row: RowState, drafter: int) -> tuple[float, float] | None:
        """(mu, s): the posterior mean and sd of `drafter`'s log goodput on the row (see
        `worth_exploring`); None before the drafter is measured or a step is timed."""
        posterior = self.tokens_model.predict(row.row_id, drafter)
        seconds = self.row_seconds(drafter, row.ks[drafter], self.batch_size)
        if posterior is None or not seconds:
            return None
        return posterior[0] + self.tokens_model.sigma2[drafter] / 2 - math.log(seconds), posterior[1]

    def may_switch(self, row: RowState, drafter: int) -> bool:
        """Exploiting, whether the row may move to `drafter`: always to one it has drafted with or
        that `settle` ended requests measured; to any other only where an exploration chunk could
        (`pays_off`), since its estimate is then a prior's upper bound (docs/lbss.md#settle)."""
        tm = self.tokens_model
        return (
            tm.steps(row.row_id, drafter) > 0
            or tm.requests(drafter) >= self.config.settle
            or self.pays_off(row, drafter)
        )

    def steps_left(self, row: RowState) -> float:
        """Steps the row may still take (inf: no limit known): its room over the tokens it commits per
        step, its own mean shrunk toward all rows' by PRIOR_STEPS pseudo-steps, so one step that
        accepted nothing does not put a short request far from its end (docs/lbss.md#steps-left)."""
        if row.room is None:
            return float("inf")
        prior = self.tokens_per_step.mean or 1.0
        per_step = (row.tokens.mean * row.tokens.n + PRIOR_STEPS * prior) / (row.tokens.n + PRIOR_STEPS)
        return max(1.0, row.room / per_step)
