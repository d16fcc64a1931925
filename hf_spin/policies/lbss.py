"""Spin's learning-based drafter selection (LBSS): an online bandit that learns, per request, which
drafter gives the most goodput, under per-drafter batch capacities.

The reward is goodput, factored into what the request decides and what the machine decides:

    g(row, d) = E[tokens | row, d] / t_row(B, d, k)

- tokens = accepted + 1, what a step of d commits on the row: a property of the request and the
  drafter, the same at any batch size, and the only per-request quantity learned (`TokensModel`, a
  posterior shared across requests).
- t_row: the row's share of a step at the batch size B being planned (`row_seconds`), from the
  step-cost fits (`CostModel`): it depends on B and the device, not on the request (goodput learned
  per request and drafter did not carry across batch sizes: RESULTS.md, seventh measurement).
- A switch's catch-up is neither: it is charged once, in the matching, as a switching cost (below).

Each row runs its own schedule of epochs e = 1, 2, ... counted in the steps it has been in the batch:

    epoch e = [ exploration: alpha steps, in chunks of beta ] [ exploitation: 2^e steps ]

- Exploration: at the start of each chunk the row gets a drafter (alpha = beta x drafters steps by
  default, drafters measured by shadow drafts not counted) and keeps it for the chunk: the first
  step pays the catch-up, the others measure steady goodput. A stage re-measures every drafter,
  least-tried on the row first, by one maximum-weight matching of rows to drafter slots (drafter j
  repeated B_j times); ties go by one random order of the drafters shared by the rows, so rows
  starting a chunk together share a drafter's forwards. Which stages run, and what they explore, is
  `explorable`: past the first epoch, none the request cannot finish (`steps_left`); warm (ended
  requests inform the estimates), in epochs with 2^e < alpha only drafters fewer than `settle`
  ended requests measured, so a short request starts on the drafter the posterior expects best for
  it (its prompt length included) and leaves it when its own steps pull it below another; and only
  drafters whose catch-up can pay off (`pays_off`) and whose chunk repays what it could teach
  (`worth_exploring`), the others as a last resort. A row with no drafter to explore exploits.
- Exploitation: each step, a maximum-weight matching (`scipy.optimize.linear_sum_assignment`) of the
  rows to the free drafter slots, and to plain decoding (unlimited slots), on

      W[row, d]     = g(row, d) - g(row, d) s / (s + T tau)     s = c_d x lag(row, d)
      W[row, plain] = g_plain (1 + m_d*) x W[row, d*] / W'[row, d*]   (never-slower; see below)

  g(row, d): the tokens of d's next step on the row, `rank_optimism` posterior sds up (an upper
  confidence bound, `expected_tokens`), over tau = t_row. g_plain = B / t_verify(N = B): the
  goodput of a plain step; W': W at `careful_optimism` sds up; d*: the row's best drafter; m_d*:
  `plain_margin`. A row goes plain when W'[row, d*] < g_plain (1 + m_d*). A row's t_row depends on
  the others' choices (the drafting rows share the padded positions): the first matching assumes
  every row drafts, the next ones split the positions as the previous one did, until one repeats.
  c_d: seconds per token of catch-up (`catch_up_seconds`: learned by `CostModel`, or
  `switch_cost`); lag: tokens d's cache is behind on the row; T: steps left in the stage, at most
  the steps the request may still take. The penalty is exactly the goodput lost by paying s
  seconds once over T steps: g - T g tau / (T tau + s). To a drafter priced by the prior's upper
  bound the row may move only where an exploration chunk could (`may_switch`). Exploitation stages
  grow as 2^e, so exploration costs O(alpha log T) steps: regret is sublinear.
- Never slower: while exploiting, a row is matched to plain decoding when no drafter's estimate
  beats g_plain: the verify-cost fit at zero drafts, corrected by how far steps that drafted nothing
  sat from it. Extrapolated from steps that verified several tokens a row, that fit can be far off
  (RESULTS.md, fifth measurement), so a plain probe (`plain_probe`) decodes a whole step plainly
  (taking a step of each row's schedule) when its batch-size bucket has gone that many steps
  without one and no row is exploring: always the bucket's first, later ones only when every row's
  best drafter is within PROBE_MARGIN of the measured g_plain. A row decoding plainly tries the
  drafters again at its next exploration stage, after an exploitation stage twice as long as the
  last, so when drafting never pays it decodes plainly in all but O(alpha log T) of T steps. Cold,
  every stage a request can finish runs, so one unlucky early estimate cannot lock a row out of a
  drafter; warm, a short request decoding plainly is not probed again.
- Shadow drafts (`shadow`): a drafter without parameters (prompt lookup) costs next to nothing to
  run, so it drafts every row it does not serve (`Plan.shadow`), unverified, and is never given an
  exploration chunk. Its would-be reward on the row: matches with the committed tokens + 1; when
  every committed token matched and more were proposed, the rest at the row's per-token acceptance
  hits / (hits + misses), the estimate of a censored geometric.
- Preempting (`preempt`): at batch 1 and on packed rows, such a drafter also drafts first, and a
  row verifies its draft in place of its drafter's on the steps it is long enough, and continues a
  long enough match, to beat it (`preempt_plan`): a selection per step on top of the one per
  request.
- Fast switching: `Plan.prefill` names, for each idle model drafter, the rows it is likely to serve
  next (the next exploration chunk, drawn a step ahead; an exploiting row's runner-up within
  `prefill_margin`, when catching it up costs at most that fraction of a step), when it lags by at
  least `prefill_min_tokens` and the request has a step left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from .base import BatchView, DrafterInfo, DraftLength, Plan, Policy, StepFeedback
from .checks import check_float, check_int, check_per_drafter
from .estimates import CostModel, DecayedMean, DraftObservation, RunningMean, longest_draft
from .estimates import expected_tokens as geometric_tokens
from .tokens_model import TokensModel

PLAIN = -1  # a row's choice: plain decoding
NO_PLAIN = -1e18  # weight of a plain slot when plain decoding is not an option (taken only if no drafter slot is left)
LAST_RESORT = -1e6  # weight of a slot a row may not take (explore: not explorable; exploit: `may_switch`), taken only when no other is left
PRIOR_ROWS = 2.0  # pseudo-requests behind prior_spread in the spread estimate: a few requests override it
PRIOR_STEPS = 4.0  # pseudo-steps at the mean over all rows behind a row's tokens per step in `steps_left`
PRIOR_NOISE = 0.5  # prior step-to-step sd of log goodput (accepted + 1 in 1..k+1: logs spread ~0.5)
# A repeat plain probe is worth a step only where a new measurement could overturn the rows' choices
# and costs them little: a batch with a row whose best drafter leads the measured plain goodput by
# more than half is not probed again (the measurement drifts with context length by far less).
PROBE_MARGIN = 0.5
PREFILL_KINDS = frozenset({"model", "translation"})  # drafters that keep a per-row cache to pre-fill
# d log(draft seconds) / d log(parameters), pricing a drafter before its first draft from one
# measured (`draft_seconds`): 0.21-0.47 on a CPU at batch 1 (RESULTS.md, twentieth measurement).
# On a GPU a small drafter's forward is bound by latency, not size (elasticity ~0), so 0.5 prices
# a larger drafter high there until its first draft measures it.
DRAFT_SIZE_ELASTICITY = 0.5
MATCH_PRIOR = 2.0  # pseudo-drafts at the acceptance pooled over every row behind a row's acceptance per match length (`match_acceptance`)


def goodput(tokens: float, seconds: float | None) -> float:
    """Tokens per second; the tokens alone while no step time is known (they still rank drafters)."""
    return tokens / seconds if seconds else tokens


def linear_sum_assignment(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight matching of rows to columns (scipy), with a clear error when scipy is missing."""
    try:
        from scipy.optimize import linear_sum_assignment as lsa
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("policy='lbss' needs scipy for its matching: pip install scipy") from err
    return lsa(weights, maximize=True)


@dataclass
class LBSSConfig:
    alpha: int | None = None  # exploration steps per epoch; None: beta x drafters, so each row tries each drafter once per epoch
    beta: int = 2  # steps a row keeps a drafter while exploring: the first pays the catch-up, the rest measure steady goodput
    capacities: tuple[int | None, ...] | None = None  # B_j: most rows drafter j serves in one step (memory, latency); None: unlimited
    switch_cost: float | tuple[float, ...] | None = None  # seconds per token a drafter spends catching up a row; None: learned
    never_slower: bool = True  # exploiting, decode a row plainly when no drafter's estimated goodput beats plain decoding's
    plain_probe: int | None = 32  # never_slower: a whole plain step once a batch-size bucket went this many steps without one (None: never)
    prefill_margin: float = 0.1  # pre-fill an exploiting row's runner-up drafter when within this fraction of the best (and its catch-up within this fraction of a step)
    prefill_min_tokens: int = 8  # ...and only when it lags this many tokens: a forward for 1-2 tokens costs more than it saves
    optimism: float = 2.5  # exploiting, drafters are ranked at their posterior log tokens this many sds up (an upper confidence bound; see `expected_tokens`)
    plain_optimism: float = 1.0  # ...and weighed against plain decoding (never_slower) this many sds up (shadowed drafters: 0, `careful_optimism`)
    shadow_optimism: float = 0.5  # drafters measured by shadow drafts are ranked this many sds up instead of `optimism` (`rank_optimism`)
    shadow_margin: float = 0.1  # never_slower: a row leaves plain decoding for a drafter measured by shadow drafts only when it leads plain decoding's goodput by this fraction
    prior_spread: float = 0.3  # prior sd over requests of a drafter's log goodput around its mean (0.3: +-35%)
    catch_up_margin: float = 0.1  # a catch-up pays off (`pays_off`) when a drafter this fraction faster than plain decoding would repay it over the steps left
    history: int = 64  # ended requests whose measurements the estimates keep
    settle: int = 3  # warm, a row explores (once) each drafter fewer than this many ended requests measured, even in epochs too short to amortise a full exploration
    knowledge_gradient: bool = True  # a row explores a drafter the estimates cover only when what a chunk of it could teach beats its cost (`worth_exploring`)
    shadow: bool = True  # model-free drafters (prompt lookup) draft every row they do not serve, unverified: measured for free
    preempt: bool = True  # ...first, and a row verifies such a draft in place of its drafter's when it is long enough to beat it (`preempt_plan`)
    seed: int = 0  # exploration draws; the same seed gives the same plans on the same feedback

    def __post_init__(self):
        owner = "LBSSConfig"
        check_int(owner, "beta", self.beta, 1)
        if self.alpha is not None:
            check_int(owner, "alpha", self.alpha, self.beta)
        if self.capacities is not None:
            if not isinstance(self.capacities, (tuple, list)) or not all(
                c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1) for c in self.capacities
            ):
                raise ValueError(f"{owner}.capacities must be a tuple of positive ints (None: unlimited), one per drafter, got {self.capacities!r}")
            self.capacities = tuple(self.capacities)
        if isinstance(self.switch_cost, list):
            self.switch_cost = tuple(self.switch_cost)
        costs = self.switch_cost if isinstance(self.switch_cost, tuple) else () if self.switch_cost is None else (self.switch_cost,)
        for c in costs:
            check_float(owner, "switch_cost", c, 0.0, float("inf"), open_high=True)
        if not isinstance(self.never_slower, bool):
            raise ValueError(f"{owner}.never_slower must be True or False, got {self.never_slower!r}")
        if self.plain_probe is not None:
            check_int(owner, "plain_probe", self.plain_probe, 1)
        check_float(owner, "prefill_margin", self.prefill_margin, 0.0, 1.0, open_high=True)
        check_int(owner, "prefill_min_tokens", self.prefill_min_tokens, 1)
        check_float(owner, "optimism", self.optimism, 0.0, 10.0)
        check_float(owner, "plain_optimism", self.plain_optimism, 0.0, 10.0)
        check_float(owner, "shadow_optimism", self.shadow_optimism, 0.0, 10.0)
        check_float(owner, "shadow_margin", self.shadow_margin, 0.0, 1.0)
        check_float(owner, "prior_spread", self.prior_spread, 0.0, 10.0, open_low=True)
        check_float(owner, "catch_up_margin", self.catch_up_margin, 0.0, 1.0, open_low=True)
        check_int(owner, "history", self.history, 0)
        check_int(owner, "settle", self.settle, 0)
        if not isinstance(self.knowledge_gradient, bool):
            raise ValueError(f"{owner}.knowledge_gradient must be True or False, got {self.knowledge_gradient!r}")
        for name in ("shadow", "preempt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be True or False, got {getattr(self, name)!r}")
        check_int(owner, "seed", self.seed)


class Stage(NamedTuple):
    epoch: int
    explore: bool
    chunk_start: bool  # exploring: this step starts a chunk
    end: int  # age at which the chunk (exploring) or the exploitation stage ends
    epoch_end: int  # age at which the epoch (its exploitation stage) ends


@dataclass
class Arm:
    """What one row has seen of one drafter."""

    tries: int = 0  # exploration chunks drawn
    synced: int = 0  # committed tokens whose KV the drafter holds for the row (0: none yet)
    hits: int = 0  # draft tokens that matched the committed ones (served or shadow)
    misses: int = 0  # drafts that stopped matching within the committed tokens
    by_match: dict[int, list[int]] = field(default_factory=dict)  # the drafter's match length -> [hits, misses] of its drafts

    def count(self, matched: int, proposed: int, committed: int, match: int | None = None) -> None:
        """Per-token acceptance evidence of one draft: its matched tokens are hits; it missed when it
        stopped matching before its own end and before the committed tokens ran out (else censored).
        `match`: the length of the match the draft continued (`StepFeedback.match_lengths`), if any."""
        missed = matched < min(proposed, committed)
        self.hits += matched
        self.misses += missed
        if match is not None and proposed > 0:
            counts = self.by_match.setdefault(match, [0, 0])
            counts[0] += matched
            counts[1] += missed


@dataclass
class RowState:
    """Per-request state, keyed by row id."""

    row_id: int
    length: int  # committed tokens (prompt + generated) at the latest plan
    arms: list[Arm]  # [num_drafters]
    room: int | None = None  # tokens it may still generate at the latest plan (None: unknown)
    ks: list[int] = field(default_factory=list)  # [num_drafters] draft length of each drafter for the row at the latest plan
    usable: list[bool] = field(default_factory=list)  # [num_drafters] drafters usable at the latest plan
    tokens: RunningMean = field(default_factory=RunningMean)  # tokens committed per step, any drafter
    age: int = 0  # steps planned for this row
    chunk_drafter: int | None = None  # drafter of the exploration chunk in progress
    chunk_end: int = 0  # age at which that chunk ends
    pending: int | None = None  # drafter drawn for the next exploration chunk (pre-filled meanwhile)
    runner_up: int | None = None  # exploiting: a drafter within prefill_margin of the chosen one


class LBSSPolicy(Policy):
    """Learning-based drafter selection (Spin); see the module docstring."""

    def __init__(self, draft_length: DraftLength | None = None, config: LBSSConfig | None = None):
        super().__init__(draft_length)
        self.config = config or LBSSConfig()
        self.rng = np.random.default_rng(self.config.seed)
        self.rows: dict[int, RowState] = {}
        self.tokens_model = self._new_model(0)
        self.costs = CostModel(0)
        self.shadowed: list[bool] = []  # [num_drafters] measured by shadow drafts, never explored
        self.tokens_per_step = DecayedMean()  # over all rows: a new row's steps_left until it has its own
        self.fill: list[DecayedMean] = []  # [num_drafters] tokens drafted / k (a confidence stop, a prompt lookup without a match end drafts early)
        self.served: list[DecayedMean] = []  # [num_drafters] rows each drafter served per step it drafted
        self.by_match: list[Arm] = []  # [num_drafters] every row's drafts, pooled: acceptance per match length
        self.padded = True  # the verify pads rows to the longest draft (from the latest feedback)
        self.alpha = self.config.alpha or self.config.beta
        self.batch_size = 1  # of the step being planned
        self._prefill: dict[int, list[int]] = {}

    # --- set-up --------------------------------------------------------------------------------

    def bind(self, drafters: list[DrafterInfo]) -> None:
        super().bind(drafters)
        n = len(drafters)
        check_per_drafter("LBSSConfig", "capacities", self.config.capacities, n)
        check_per_drafter("LBSSConfig", "switch_cost", self.config.switch_cost, n)
        self.fill = [DecayedMean() for _ in range(n)]
        self.served = [DecayedMean() for _ in range(n)]
        self.by_match = [Arm() for _ in range(n)]
        self.tokens_model = self._new_model(n)
        self.costs = CostModel(n)
        self.shadowed = [self.config.shadow and info.num_parameters == 0 for info in drafters]
        self.alpha = self.config.alpha or self.config.beta * max(1, n - sum(self.shadowed))

    def _new_model(self, num_drafters: int) -> TokensModel:
        c = self.config
        return TokensModel(num_drafters, c.prior_spread, PRIOR_ROWS, PRIOR_NOISE, c.history)

    def capacity(self, drafter: int, batch_size: int) -> int:
        caps = self.config.capacities
        cap = caps[drafter] if caps is not None else None
        return batch_size if cap is None else min(cap, batch_size)

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        B = view.batch_size
        total = sum(self.capacity(d, B) for d in range(len(self.drafters)) if view.usable[d])
        if total < B:
            raise ValueError(
                f"LBSSConfig.capacities={self.config.capacities} let the drafters serve at most {total} rows in one step, "
                f"but the batch has {B} rows; raise the capacities (None: unlimited) or pass at most {total} rows"
            )
        for b in rows:
            self.rows[view.row_ids[b]] = self._new_row(view, b)

    def end_rows(self, row_ids: list[int]) -> None:
        for rid in row_ids:
            self.rows.pop(rid, None)
            self.tokens_model.end(rid)

    def _new_row(self, view: BatchView, b: int) -> RowState:
        self.tokens_model.start(view.row_ids[b], view.prompt_lengths[b])
        return RowState(row_id=view.row_ids[b], length=view.prompt_lengths[b] + view.generated[b], arms=[Arm() for _ in self.drafters])

    def _row(self, view: BatchView, b: int) -> RowState:
        rid = view.row_ids[b]
        if rid not in self.rows:  # a row nobody announced: start it now
            self.rows[rid] = self._new_row(view, b)
        return self.refresh(self.rows[rid], view, b)

    def refresh(self, row: RowState, view: BatchView, b: int) -> RowState:
        """The row's state as the step being planned finds it (batch row `b` of `view`)."""
        row.length = view.prompt_lengths[b] + view.generated[b]
        row.room = view.room[b] if view.room is not None else None
        row.ks = [self.draft_length.k(d, b, view) for d in range(len(self.drafters))]
        row.usable = list(view.usable)
        return row

    # --- schedule and estimates ----------------------------------------------------------------

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
        None outside an exploration stage, nor past the first epoch in one the request cannot
        finish (what it measures must have steps left to pay off; the first always runs, or a
        short request would never measure anything); else the drafters not measured by shadow
        drafts that pass `pays_off` and `worth_exploring`. Warm, in an epoch whose exploitation
        stage is shorter than a full exploration (2^e < alpha), only those of them that fewer than
        `settle` ended requests measured and the row has not tried: one or two steps of a drafter
        on the first request do not tell its mean effect, and a drafter they put low would never
        be chosen again (RESULTS.md, eighth and ninth measurements)."""
        st = self.stage(age)
        if not st.explore or (st.epoch > 1 and self.steps_left(row) < st.epoch_end - age):
            return set()
        candidates = {d for d in range(len(self.drafters)) if not self.shadowed[d]}
        if self.tokens_model.warm and 2**st.epoch < self.alpha:
            settle = self.config.settle
            candidates = {d for d in candidates if not row.arms[d].tries and self.tokens_model.requests(d) < settle}
        return {d for d in candidates if self.pays_off(row, d) and self.worth_exploring(row, d)}

    def pays_off(self, row: RowState, drafter: int) -> bool:
        """Whether catching `drafter` up on the row (seconds s = c_d x lag) can pay for itself:
        s at most the time a drafter `catch_up_margin` faster than plain decoding would save over
        the steps the row has left, steps_left x t x margin, t = the row's share of a plain step at
        this batch size (1 / g_plain). A long prompt late in a request costs a model drafter a
        prefill for a few steps of use, and at batch 4 a row's share of a plain step is a quarter of
        batch 1's, so the same catch-up needs four times the steps. The margin is a small constant:
        a drafter's margin over plain decoding is ~0 at batch 4 on a CPU and rarely above 0.3 at
        batch 1, and a margin from its upper bound let cold rows, whose bounds sit at the cap, pay
        catch-ups they could not repay (RESULTS.md, fourteenth measurement). True while either
        cost is unknown."""
        s = self.catch_up_seconds(drafter) * self.lag(row, drafter)
        g_plain = self.costs.plain_goodput(self.batch_size)
        if s <= 0 or not g_plain:
            return True
        return s <= self.steps_left(row) / g_plain * self.config.catch_up_margin

    def worth_exploring(self, row: RowState, drafter: int) -> bool:
        """Whether a chunk of `drafter` on the row is worth what it costs (`knowledge_gradient`): what
        its beta steps could teach, over the steps the row has left after them, against the tokens
        they give up to the row's incumbent (its best other option at the posterior mean, plain
        decoding included) and the catch-up. In log goodput per step, mu_e = m_e + sigma_e^2 / 2 -
        log t_row(e), with m_e ~ N(m, s^2) the `TokensModel` posterior of e's log tokens on the row;
        beta steps of d move its mean by a normal of sd s' = s^2 / sqrt(s^2 + sigma_d^2 / beta), and
        the row then takes d where it beats the incumbent mu_0, so the chunk gains

            kg = E[max(mu_d', mu_0)] - mu_0 = s' phi(delta / s') + delta Phi(delta / s'),   delta = mu_d - mu_0

        a step over the steps left after it (the knowledge gradient), in the incumbent's steps (t_0
        seconds of the row each). The chunk costs what its beta steps of t_d seconds give up at the
        incumbent's goodput, beta (t_d / t_0) (1 - e^min(delta, 0)) of those steps, plus the
        catch-up's seconds over t_0 (without t_d / t_0, a drafter several times the incumbent's step
        cost looked cheap to measure, and on a cold batch-4 trace plain rows waited on one row's
        exploring drafts). Spin's stages re-measure every drafter each epoch whatever the estimates
        say, and spent a quarter of a long request's steps on drafters measured 10-25% below the
        best (RESULTS.md, seventeenth measurement); here a long request still explores (the gain
        grows with the steps left), a short one only drafters whose estimate is close or uncertain.
        True for a drafter fewer than `settle` ended requests measured (a chunk on one of the first
        requests also informs every later request's prior, which the row's steps left do not count)
        and while anything is unknown: no step costs, no length limit."""
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
        if spread > 0:
            z = delta / spread
            kg = spread * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) + delta * (1 + math.erf(z / math.sqrt(2))) / 2
        else:
            kg = max(delta, 0.0)
        t0 = plain if incumbent == PLAIN else self.row_seconds(incumbent, row.ks[incumbent], self.batch_size)
        td = self.row_seconds(drafter, row.ks[drafter], self.batch_size)
        cost = beta * td / t0 * (1 - math.exp(min(delta, 0.0))) + self.catch_up_seconds(drafter) * self.lag(row, drafter) / t0
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
        """Exploiting, whether the row may move to `drafter`: always to one it has drafted with (its
        estimate has the row's own steps) or one that `settle` ended requests measured (the prior is
        informed), the switch penalty weighing the catch-up against the estimate; to any other only
        if the catch-up can pay (`pays_off`), as for an exploration chunk: its estimate is then the
        upper bound of a prior one step of one request may have set, up to k + 1 tokens, against
        which the penalty looks small (RESULTS.md, twelfth measurement). This gate is also why
        `settle` is not 1: at 1 the bench's 4-token warm-up request settled every drafter, and a
        cold batch-4 batch moved to Qwen2.5-0.5B at its capped estimate (thirteenth measurement)."""
        tm = self.tokens_model
        return tm.steps(row.row_id, drafter) > 0 or tm.requests(drafter) >= self.config.settle or self.pays_off(row, drafter)

    def steps_left(self, row: RowState) -> float:
        """Steps the row may still take (inf: no limit known): its room over the tokens it commits
        per step, its own mean shrunk toward the mean over all rows by PRIOR_STEPS pseudo-steps.
        Its own mean alone, after a first step that accepted nothing, put a 64-token request 63
        steps from its end, and every catch-up seemed to pay off over them (`pays_off`)."""
        if row.room is None:
            return float("inf")
        prior = self.tokens_per_step.mean or 1.0
        per_step = (row.tokens.mean * row.tokens.n + PRIOR_STEPS * prior) / (row.tokens.n + PRIOR_STEPS)
        return max(1.0, row.room / per_step)

    def estimate(self, row: RowState, drafter: int, k: int, drafting: int) -> float:
        """g(row, d) as weighed against plain decoding: the expected goodput of d's next step on the
        row at the batch size being planned, `expected_tokens` (`plain_optimism` sds up) over the
        row's predicted share of the step (`row_seconds`, with `drafting` rows drafting). Before any
        step (no costs): the tokens alone, for ranking."""
        return goodput(self.expected_tokens(row, drafter, k, self.careful_optimism(drafter)), self.row_seconds(drafter, k, drafting))

    def careful_optimism(self, drafter: int) -> float:
        """The sds up at which `drafter` is weighed against plain decoding: `plain_optimism`, so
        a row that stops drafting is not locked out of a drafter by one unlucky step; 0 for a
        drafter measured by shadow drafts, which keeps measuring the row while it decodes plainly
        and wins it back as soon as its steps say so. One sd up, prompt lookup's bursty tokens put
        a whole cold batch-4 batch on it after one match on one row, each step verifying a lone
        draft padded over four rows; at the mean among drafters too, batch 1 lost, the model
        drafters' bounds then outranking a cheap lookup that pays (RESULTS.md, fifteenth
        measurement)."""
        return 0.0 if self.shadowed[drafter] else self.config.plain_optimism

    def rank_optimism(self, drafter: int) -> float:
        """The sds up at which `drafter` is ranked against the other drafters: `optimism`, an upper
        confidence bound that gets a drafter tried; `shadow_optimism` for a drafter measured by
        shadow drafts, which is measured on every row whatever serves it, so an upper bound buys no
        measurement. At 2 sds up prompt lookup, whose effect varies most from request to request,
        served the first steps of nearly every 32-token request on the replays, mostly accepting
        nothing. 0.5 sds up gained 0.011-0.028 of plain decoding's speed on three question sets; the
        mean gained 0.000-0.047, nothing on the first set, where the model drafters' bounds then
        outrank lookup on rows where it pays (RESULTS.md, nineteenth measurement)."""
        return self.config.shadow_optimism if self.shadowed[drafter] else self.config.optimism

    def plain_margin(self, drafter: int | None) -> float:
        """The fraction by which `drafter` must lead plain decoding (at `careful_optimism`) for a row
        to leave plain decoding for it: `shadow_margin` for a drafter measured by shadow drafts, 0
        for the others. At batch 4 on a CPU prompt lookup and plain decoding sit within a few
        percent of each other in the estimates, and real runs flipped between them on timing noise.
        Such a drafter keeps being measured while its rows decode plainly, so the margin locks no
        row out of it; it gives up one that truly leads by less. A model drafter gets none: a row
        sent to plain decoding by an early, unlucky estimate measures it again only at its next
        exploration stage, and in the sim a 10% margin kept one 1.4x faster than plain off much of
        a long request (RESULTS.md, sixteenth measurement)."""
        return self.config.shadow_margin if drafter is not None and self.shadowed[drafter] else 0.0

    def expected_tokens(self, row: RowState, drafter: int, k: int, z: float | None = None) -> float:
        """The tokens d's next step commits on the row: the `TokensModel` posterior, z posterior sds
        up (default `optimism`). The posterior weighs earlier requests, the row's other drafters and
        its own steps with d by how reliable each has been (a few noisy steps do not overturn what
        many requests showed). A drafter no request has measured counts as good as the best
        measured one, so it gets tried. Capped at what d's drafts can commit, k x fill_d + 1.

        Two upper bounds, because they answer two questions. Ranking drafters (`optimism`, 2.5 sds):
        a drafter the row has not drafted with reaches the cap, the best its drafts can do, until
        the row's own steps pull it down. Narrower bounds kept rows on drafters whose prior was off,
        or moved them off the best on a few steps' evidence; wider ones keep a row trying drafters
        its own steps put below its best; 2.5 took most of the replays' gain at a fraction of that
        cost (RESULTS.md, thirteenth and twentieth measurements). Against plain decoding
        (`plain_optimism`, 1 sd): one unlucky step (no token accepted) must not send a row to plain
        decoding for the rest of a request that skips its exploration stages, but 2 sds drafted
        where drafting was slower than plain (sixth and thirteenth measurements)."""
        z = self.config.optimism if z is None else z
        tokens = self.tokens_model.expected_tokens(row.row_id, drafter, z)
        if tokens is None:
            known = [self.tokens_model.expected_tokens(row.row_id, d, z) for d in range(len(self.drafters))]
            tokens = max((x for x in known if x is not None), default=0.0)
        return min(tokens, k * self.fill_fraction(drafter) + 1)

    def fill_fraction(self, drafter: int) -> float:
        """fill_d: the fraction of k that d's drafts reach (1 before any)."""
        fill = self.fill[drafter].mean
        return 1.0 if fill is None else fill

    def row_seconds(self, drafter: int, k: int, drafting: int, fill: float | None = None) -> float | None:
        """t_row: a row's predicted share of a step at the batch size B being planned, with drafter
        d drafting k tokens for it (PLAIN: none) and `drafting` rows of the batch drafting (this one
        included). From the cost fits (`CostModel`):

            t_row = t_verify(B, B) / B                                   an equal part of a plain step
                  + [t_verify(B, B + n) - t_verify(B, B)] / drafting      the positions the drafts add
                  + (f_d F + t_d k fill_d s_d) / s_d                       d's forwards, shared by its rows

        n: packed, the drafting rows' own drafts, drafting x k x fill_d (fill_d: the fraction of k
        that d's drafts reach). Padded, every row verifies the longest draft, and the drafting rows
        share those positions (a lone drafting row pays them all): n = B x k x (1 - (1 - fill_d) ^
        drafting), the longest of `drafting` drafts that each reach k with probability fill_d: exact
        for drafts that are all or nothing (prompt lookup), an upper bound for drafts that stop
        part-way. The mean draft (B x k x fill_d) under-priced lookup's padding and chose it where
        it was slower than plain (RESULTS.md, eighth measurement).

        F: d's forwards, one per token of the longest of its s_d drafts, k x (1 - (1 - fill_d) ^ s_d)
        and at least 1, by the same argument; the draft fit is on the tokens drafted
        (`DraftObservation`), so a drafter whose confidence stop ends drafts after a token or two
        is priced for those, not for k (tenth measurement).

        s_d: the rows d has served per step (decayed mean; B before any): the draft fit separates
        forwards from row tokens only as far as s_d has varied, so it is read where it was measured
        (read elsewhere, on the simulated drafters, it doubled a drafter's cost). `fill`: in place
        of fill_d (1: a draft known to have k tokens). None before any step."""
        B, costs = self.batch_size, self.costs
        plain = costs.plain_seconds(B)
        if plain is None:
            return None
        if drafter == PLAIN or k <= 0:
            return plain / B
        fill = self.fill_fraction(drafter) if fill is None else fill
        added = B * longest_draft(k, fill, drafting) if self.padded else drafting * k * fill
        verify = max(costs.verify_seconds(B, B + added) - costs.verify_seconds(B, B), 0.0) / drafting
        served = self.served[drafter].mean or B
        forwards = max(1.0, longest_draft(k, fill, served))
        return plain / B + verify + self.draft_seconds(drafter, forwards, k * fill * served) / served

    def explore_weights(self, row: RowState, drafters: list[int], age: int) -> list[float]:
        """Exploration value of each drafter for the row's chunk starting at `age`: least-tried on
        the row first; a drafter it may not explore then (`explorable`: measured by its shadow
        drafts; warm, one whose catch-up cannot pay off or whose mean effect is settled) only as a
        slot of last resort."""
        explorable = self.explorable(row, age)
        return [-row.arms[d].tries if d in explorable else LAST_RESORT for d in drafters]

    def catch_up_seconds(self, drafter: int) -> float:
        """Seconds per token of catch-up for `drafter`: configured, or learned from feedback; before
        `drafter` has caught a row up, the measured cost of the drafter measured most, scaled by
        their parameter counts (a prefill's cost grows with the model's size; priced at 0, cold
        batch-4 rows caught every model drafter up on long prompts at a loss: RESULTS.md, eleventh
        measurement); 0 before any."""
        cost = self.config.switch_cost
        if cost is not None:
            return cost[drafter] if isinstance(cost, tuple) else cost
        costs = self.costs
        return costs.catch_up_seconds(drafter) or self.by_size(drafter, costs.catch_up_seconds, lambda e: costs.catch_up[e].weight, 1.0)

    def draft_seconds(self, drafter: int, forwards: float, row_tokens: float) -> float:
        """Predicted seconds of `drafter`'s drafts (`CostModel.draft_seconds`); before its first
        steady step, those of the model drafter measured most, scaled by the square root of their
        parameter counts (`DRAFT_SIZE_ELASTICITY`). Priced at 0 (the fit's default), a model drafter
        that a cold first request happened not to explore looked as cheap as prompt lookup, and
        later requests served it at its prior's upper bound (RESULTS.md, twentieth measurement)."""
        costs = self.costs
        if costs.draft[drafter].count > 0:
            return costs.draft_seconds(drafter, forwards, row_tokens)
        return self.by_size(drafter, lambda e: costs.draft_seconds(e, forwards, row_tokens), lambda e: costs.draft[e].count, DRAFT_SIZE_ELASTICITY)

    def by_size(self, drafter: int, measured, weight, elasticity: float) -> float:
        """A cost of `drafter` not measured yet: `measured(e)` of the drafter e with parameters whose
        measurement has the most `weight(e)`, times (parameters of `drafter` / of e) ^ `elasticity`;
        0 for a drafter without parameters or before any is measured."""
        size = self.drafters[drafter].num_parameters
        if not size:
            return 0.0
        known = [e for e in range(len(self.drafters)) if e != drafter and self.drafters[e].num_parameters and weight(e) > 0 and measured(e)]
        if not known:
            return 0.0
        e = max(known, key=weight)
        return measured(e) * (size / self.drafters[e].num_parameters) ** elasticity

    def lag(self, row: RowState, drafter: int) -> int:
        """Tokens `drafter` must catch up before it can draft for `row` (beyond the usual one)."""
        return max(0, row.length - row.arms[drafter].synced - 1)

    def switch_penalty(self, row: RowState, drafter: int, goodput: float, horizon: float, tau: float | None) -> float:
        """The goodput lost by paying d's catch-up on the row once over `horizon` steps of `tau` seconds."""
        s = self.catch_up_seconds(drafter) * self.lag(row, drafter)
        if s <= 0 or goodput <= 0:
            return 0.0
        tau = tau or 1.0 / goodput
        return goodput * s / (s + max(horizon, 1) * tau)

    # --- selection -----------------------------------------------------------------------------

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        B = self.batch_size = view.batch_size
        rows = [self._row(view, b) for b in range(B)]
        stages = [self.stage(r.age) for r in rows]
        cap = [self.capacity(d, B) if view.usable[d] else 0 for d in range(len(self.drafters))]
        choice: list[int | None] = [None] * B
        for r in rows:
            r.runner_up = None  # set again if the row is matched this step
        if self.probes_plain(view, rows):
            self._prefill = {}
            for r in rows:
                r.age += 1  # the probe takes this step of the row's schedule
            return [()] * B

        def take(b: int, d: int) -> None:
            choice[b] = d
            cap[d] -= 1

        # 1. Exploration chunks in progress keep their drafter, whatever the row would explore now
        #    (a drafter it has tried leaves `explorable`; its chunk still runs its beta steps).
        explore = [self.explores(r, r.age) for r in rows]
        for b, r in enumerate(rows):
            d = r.chunk_drafter
            if self.in_chunk(r) and cap[d] > 0:
                take(b, d)
            else:
                r.chunk_drafter = None
        # 2. New exploration chunks: the drafter drawn a step ahead, else a fresh random draw.
        exploring = [b for b in range(B) if choice[b] is None and explore[b]]
        to_draw = []
        for b in exploring:
            p = rows[b].pending
            if p is not None and cap[p] > 0:
                take(b, p)
            else:
                to_draw.append(b)
        for b, d in zip(to_draw, self._draw([rows[b] for b in to_draw], cap, ahead=0)):
            if d is None:
                choice[b] = PLAIN  # no drafter slot left this step
            else:
                take(b, d)
        for b in exploring:
            r = rows[b]
            if choice[b] != PLAIN:
                r.arms[choice[b]].tries += 1
                r.chunk_drafter, r.chunk_end = choice[b], stages[b].end
        for r in rows:
            r.pending = None  # drawn for this step only: a row that no longer explores drops it (else pre-filled for nothing)
        # 3. Exploitation: maximum-weight matching, plain decoding included.
        self._match(view, rows, stages, cap, choice)
        # 4. Draw the next exploration chunks a step ahead (their drafters are pre-filled meanwhile).
        self._draw_ahead(view, rows, choice)
        self._prefill = self._prefill_plan(view, rows, choice)
        for r in rows:
            r.age += 1
        return [() if d == PLAIN else (d,) for d in choice]

    def probes_plain(self, view: BatchView, rows: list[RowState]) -> bool:
        """Whether this step is a plain probe (see `LBSSConfig.plain_probe`): due at the batch-size
        bucket, no row exploring, and either the bucket's first (plain decoding never measured at
        this batch size) or every row's best drafter within PROBE_MARGIN of the measured plain
        goodput (a repeat probe then costs each row at most that margin)."""
        c, B = self.config, view.batch_size
        age = self.costs.steps_without_plain(B)
        if not c.never_slower or c.plain_probe is None or age < c.plain_probe:
            return False
        if any(self.in_chunk(r) or self.explores(r, r.age) for r in rows):  # an exploration chunk is not interrupted
            return False
        if age == float("inf"):
            return True  # the bucket's first: the fit's g_plain may be off by any amount
        g_plain = self.costs.plain_goodput(B)
        usable = [d for d in range(len(self.drafters)) if view.usable[d]]
        best = [max((self.estimate(r, d, r.ks[d], B) for d in usable), default=0.0) for r in rows]
        return all(g < (1 + PROBE_MARGIN) * g_plain for g in best)

    def _draw(self, rows: list[RowState], cap: list[int], ahead: int) -> list[int | None]:
        """Rows -> free drafter slots for their next exploration chunks, maximising the exploration
        weights. Ties are broken by one random order of the drafters, shared by the rows, so rows
        that start a chunk together explore the same drafter as far as its capacity allows: the
        drafters of a step run one after another on one device, and a step exploring three model
        drafters pays three draft passes where one would serve every row. `ahead`: the chunks start
        that many steps after the rows' current age."""
        slots = [d for d in range(len(cap)) for _ in range(min(max(cap[d], 0), len(rows)))]
        out: list[int | None] = [None] * len(rows)
        if not rows or not slots:
            return out
        weights = np.array([self.explore_weights(r, slots, r.age + ahead) for r in rows], dtype=float)  # [R, S]
        order = self.rng.random(len(cap))  # [num_drafters] the shared tie-break
        weights += 1e-6 * order[slots][None, :] + 1e-9 * self.rng.random(weights.shape)  # ties only; the last, between rows
        for i, j in zip(*linear_sum_assignment(weights)):
            out[i] = slots[j]
        return out

    def _match(self, view: BatchView, rows: list[RowState], stages: list[Stage], cap: list[int], choice: list[int | None]) -> None:
        """Exploitation: the rows without a choice yet -> drafter slots or plain, maximising estimated
        goodput net of switching (fills `choice`). A row's step time depends on what the others do
        (the drafting rows share the padded positions): the first matching assumes every row
        drafts; each next one splits the positions as the previous one (and the rows already
        decided: exploring) did, until a matching repeats. From that optimistic start, a row left
        alone drafting on a padded batch pays the positions it makes every row verify, and goes
        plain where that does not pay."""
        c, B = self.config, view.batch_size
        todo = [b for b in range(B) if choice[b] is None]
        if not todo:
            return
        slots = [d for d in range(len(cap)) for _ in range(min(max(cap[d], 0), len(todo)))] + [PLAIN] * len(todo)
        columns = [[j for j, e in enumerate(slots) if e == d] for d in range(len(cap))]  # [num_drafters] its slots
        g_plain = self.costs.plain_goodput(B) if c.never_slower else None
        ks = [rows[b].ks for b in todo]  # [R][num_drafters]
        # tokens of each drafter's next step on each row, at rank_optimism and at plain_optimism: the
        # same on every pass of the fixed-point loop below (only the step's split of seconds moves)
        tokens = [[self.expected_tokens(rows[b], d, ks[i][d], self.rank_optimism(d)) for d in range(len(cap))] for i, b in enumerate(todo)]  # [R][num_drafters]
        careful_tokens = [[self.expected_tokens(rows[b], d, ks[i][d], self.careful_optimism(d)) for d in range(len(cap))] for i, b in enumerate(todo)]
        horizons = [min(stages[b].epoch_end - rows[b].age, self.steps_left(rows[b])) for b in todo]
        allowed = [[self.may_switch(rows[b], d) for d in range(len(cap))] for b in todo]  # [R][num_drafters]
        decided = [d for d in choice if d is not None]  # exploring rows: they draft (or not) whatever the matching does
        seconds: dict[tuple[int, int, int], float | None] = {}  # (drafter, k, drafting) -> row_seconds: the same for every row
        guess: list[int] | None = None  # the previous matching ([R]); None: every row drafts
        for _ in range(len(todo) + 1):
            weights = np.full((len(todo), len(slots)), NO_PLAIN)  # [R, S]
            goodputs = np.zeros((len(todo), len(cap)))  # [R, num_drafters]
            for i, b in enumerate(todo):
                others = decided + (guess[:i] + guess[i + 1 :] if guess else [])
                drafting = B if guess is None else 1 + sum(e != PLAIN for e in others)
                ranked, careful = {}, {}  # d -> its weight at optimism, at plain_optimism (drafters the row may take)
                for d in range(len(cap)):
                    if (d, ks[i][d], drafting) not in seconds:
                        seconds[d, ks[i][d], drafting] = self.row_seconds(d, ks[i][d], drafting)
                    tau = seconds[d, ks[i][d], drafting]
                    goodputs[i, d] = goodput(tokens[i][d], tau)
                    penalty = self.switch_penalty(rows[b], d, goodputs[i, d], horizons[i], tau)
                    weights[i, columns[d]] = goodputs[i, d] - penalty if allowed[i][d] else LAST_RESORT
                    if allowed[i][d] and columns[d]:
                        ranked[d] = goodputs[i, d] - penalty
                        g = goodput(careful_tokens[i][d], tau)
                        careful[d] = g - self.switch_penalty(rows[b], d, g, horizons[i], tau)
                if g_plain is not None:
                    # plain decoding in the row's ranking units: the row goes plain when its best
                    # drafter, weighed carefully, does not beat g_plain (by shadow_margin if shadowed)
                    best = max(ranked, key=ranked.get, default=None)
                    scale = ranked[best] / careful[best] if best is not None and careful[best] > 0 else 1.0
                    weights[i, len(slots) - len(todo) :] = g_plain * scale * (1 + self.plain_margin(best))
            out = [PLAIN] * len(todo)
            for i, j in zip(*linear_sum_assignment(weights)):
                out[i] = slots[j]
            if out == guess:
                break
            guess = out
        for i, (b, d) in enumerate(zip(todo, out)):
            choice[b] = d
            if d != PLAIN:
                others = [e for e in range(len(cap)) if e != d and goodputs[i, e] >= (1 - c.prefill_margin) * goodputs[i, d]]
                rows[b].runner_up = max(others, key=lambda e: goodputs[i, e], default=None)

    def _draw_ahead(self, view: BatchView, rows: list[RowState], choice: list[int]) -> None:
        """Rows whose next step starts an exploration chunk get that chunk's drafter now."""
        B = view.batch_size
        nxt = [r for r in rows if self.stage(r.age + 1).chunk_start and self.explores(r, r.age + 1)]
        cap = [self.capacity(d, B) if view.usable[d] else 0 for d in range(len(self.drafters))]
        for r, d in zip(rows, choice):  # rows still inside a chunk next step keep their slot
            if d != PLAIN and r.chunk_drafter == d and r.chunk_end > r.age + 1:
                cap[d] -= 1
        for r, d in zip(nxt, self._draw(nxt, cap, ahead=1)):
            r.pending = d

    def _prefill_plan(self, view: BatchView, rows: list[RowState], choice: list[int]) -> dict[int, list[int]]:
        """Idle model drafters -> batch rows they will likely serve next and lag on."""
        busy = set(choice)
        idle = {d for d, info in enumerate(self.drafters) if view.usable[d] and d not in busy and info.kind in PREFILL_KINDS}
        plan: dict[int, list[int]] = {}
        for b, r in enumerate(rows):
            if self.steps_left(r) < 2:  # no later step to switch in
                continue
            for d in {r.pending, r.runner_up}:
                if d not in idle or (d != r.pending and not self._cheap_prefill(r, d, r.ks[d])):
                    continue
                if self.lag(r, d) >= self.config.prefill_min_tokens:
                    plan.setdefault(d, []).append(b)
        return plan

    def _cheap_prefill(self, row: RowState, drafter: int, k: int) -> bool:
        """A runner-up may never be switched to: pre-fill it only when that costs at most
        `prefill_margin` of a step of the row, the most a step on it could gain (an idle drafter is
        not free where drafters and the target share the device: on a CPU at batch 4, pre-fills of
        runner-ups cost 0.3-0.6 s each, a step or more of the whole batch, and were rarely used)."""
        step = self.row_seconds(drafter, k, self.batch_size) or 0.0
        return self.catch_up_seconds(drafter) * self.lag(row, drafter) <= self.config.prefill_margin * step

    def plan(self, view: BatchView) -> Plan:
        plan = super().plan(view)
        shadow = {
            d: {b: self.draft_length.k(d, b, view) for b, ds in enumerate(plan.drafters) if d not in ds}
            for d in range(len(self.drafters))
            if self.shadowed[d] and view.usable[d]
        }
        return replace(plan, prefill=self._prefill, shadow={d: rows for d, rows in shadow.items() if rows}, preempt=self.preempt_plan(view, plan))

    def preempt_plan(self, view: BatchView, plan: Plan) -> dict[int, dict[int, tuple[int, int, int]]]:
        """`Plan.preempt`: a drafter measured by shadow drafts (prompt lookup) drafts first for each
        row it does not serve; the row verifies that draft in its drafter's place when it has at
        least m tokens and continues a match of at least n tokens, the shortest whose goodput beats
        the row's plan (`preempt_rule`): its L tokens commit E[tokens | L] = sum_{i<=L} alpha^i,
        alpha its per-token acceptance on the row at that match length (`match_acceptance`), against
        the row's drafter at its posterior mean tokens over its t_row (plain decoding: 1 over a
        plain step's share). A lookup draft exists only where the text repeats (a copy: summaries,
        retrieval, code) and costs next to nothing, so per step, not per request, a row takes
        lookup's matches and its drafter's drafts elsewhere, which no single drafter does. Not in an
        exploration chunk (its steps must measure its drafter), nor on a padded batch of several
        rows, where one row's draft makes every row verify its length, which this per-row rule does
        not price (RESULTS.md, eighteenth measurement)."""
        B = view.batch_size
        if not self.config.preempt or (self.padded and B > 1):
            return {}
        drafting = sum(1 for ds in plan.drafters if ds)
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for p in range(len(self.drafters)):
            if not (self.shadowed[p] and view.usable[p]):
                continue
            for b, ds in enumerate(plan.drafters):
                row = self.rows.get(view.row_ids[b])
                if row is None or p in ds or len(ds) > 1 or not row.ks[p] or row.chunk_drafter is not None:
                    continue  # (an exploration chunk's steps measure its drafter)
                if ds:
                    d = ds[0]
                    tau = self.row_seconds(d, plan.k[b], drafting)
                    target = goodput(self.expected_tokens(row, d, plan.k[b], 0.0), tau) if tau else None
                else:
                    tau = self.row_seconds(PLAIN, 0, B)
                    target = 1.0 / tau if tau else None
                if target is None:
                    continue
                rule = self.preempt_rule(row, p, target, drafting + (not ds))
                if rule is not None:
                    out.setdefault(p, {})[b] = (row.ks[p], *rule)
        return out

    def preempt_rule(self, row: RowState, drafter: int, target: float, drafting: int) -> tuple[int, int] | None:
        """(least, min match) for `drafter` preempting on the row: the shortest match length, and the
        shortest draft continuing it, whose goodput reaches `target` (L tokens commit sum_{i<=L}
        alpha^i, alpha its acceptance at that match length, `match_acceptance`, over the row's share
        of a step verifying them); None when no draft it can make does."""
        for match, alpha in self.match_acceptance(row, drafter):
            for length in range(1, row.ks[drafter] + 1):
                if geometric_tokens(alpha, length) / self.row_seconds(drafter, length, drafting, fill=1.0) >= target:
                    return length, match
        return None

    def match_acceptance(self, row: RowState, drafter: int) -> list[tuple[int, float]]:
        """[(match length, per-token acceptance)] of `drafter`'s drafts on the row, shortest match
        first: per match length the row's hits / (hits + misses) shrunk toward every row's by
        MATCH_PRIOR pseudo-drafts. Prompt lookup's drafts differ most by the n-gram they continue
        (longer matches accept several times more), and where that split is sharp one acceptance
        per row takes every match or none (RESULTS.md, nineteenth measurement; on the Spec-Bench
        replay the two are level). A drafter that reports no match length: [(0, the row's
        acceptance over all its drafts, Laplace-smoothed)]."""
        pooled = self.by_match[drafter].by_match
        arm = row.arms[drafter]
        if not pooled:
            return [(0, (arm.hits + 1) / (arm.hits + arm.misses + 2))]
        out = []
        for match in sorted(pooled):
            hits, misses = pooled[match]
            prior = (hits + 1) / (hits + misses + 2)
            own_hits, own_misses = arm.by_match.get(match, (0, 0))
            out.append((match, (own_hits + MATCH_PRIOR * prior) / (own_hits + own_misses + MATCH_PRIOR)))
        return out

    # --- learning ------------------------------------------------------------------------------

    def update(self, feedback: StepFeedback) -> None:
        super().update(feedback)
        plan, n = feedback.plan, len(self.drafters)
        rows = [self.rows.get(rid) for rid in feedback.row_ids]
        new_length = [r.length + a + 1 if r else 0 for r, a in zip(rows, feedback.accepted)]
        # 1. Catch-up tokens per drafter (a switch or a pre-fill), and what each drafter now holds.
        switch = [0.0] * n
        for b, r in enumerate(rows):
            if r is not None and plan.k[b] > 0:
                for d in plan.drafters[b]:
                    switch[d] += self.lag(r, d)
                    r.arms[d].synced = new_length[b] - 1
        for d, batch_rows in plan.prefill.items():
            for b in batch_rows:
                r = rows[b]
                if r is not None and d < n:
                    switch[d] += max(0, new_length[b] - 1 - r.arms[d].synced)
                    r.arms[d].synced = new_length[b] - 1
        self.costs.update(feedback, switch)
        for d in range(n):
            if work := DraftObservation.of(feedback, d):
                self.served[d].add(work.rows)
        self.padded = feedback.padded
        # 2. Rewards: the tokens each single-drafter row committed (its step time is the cost fits').
        for b, r in enumerate(rows):
            if r is None or len(plan.drafters[b]) != 1 or plan.k[b] == 0:
                continue
            d = plan.drafters[b][0]
            self._count(r, d, feedback.accepted[b], feedback.drafted[b], feedback.accepted[b] + 1, feedback, b)
            self.fill[d].add(feedback.drafted[b] / plan.k[b])
            self.tokens_model.add(r.row_id, d, feedback.accepted[b] + 1)
        # 3. Shadow drafts: what a model-free drafter would have committed on the rows it did not serve.
        for b, r in enumerate(rows):
            if r is None:
                continue
            committed = feedback.accepted[b] + 1
            r.tokens.add(committed)
            self.tokens_per_step.add(committed)
            for d, proposed in (feedback.shadow_proposed[b] if feedback.shadow_proposed else {}).items():
                matched = feedback.shadow_matched[b][d]
                self._count(r, d, matched, proposed, committed, feedback, b)
                if plan.shadow.get(d, {}).get(b):
                    self.fill[d].add(proposed / plan.shadow[d][b])
                self.tokens_model.add(r.row_id, d, self.shadow_tokens(r.arms[d], committed, proposed, matched))

    def _count(self, row: RowState, drafter: int, matched: int, proposed: int, committed: int, feedback: StepFeedback, b: int) -> None:
        """A draft's per-token acceptance evidence (`Arm.count`), on the row and pooled over every row."""
        match = feedback.match_lengths[b].get(drafter) if feedback.match_lengths else None
        row.arms[drafter].count(matched, proposed, committed, match)
        self.by_match[drafter].count(matched, proposed, committed, match)

    @staticmethod
    def shadow_tokens(arm: Arm, committed: int, proposed: int, matched: int) -> float:
        """Tokens a step would have committed had the shadow draft been verified (greedy: exact unless
        censored). Censored (every committed token matched, more were proposed): the rest follows the
        row's per-token acceptance for the drafter, hits / (hits + misses), the censored geometric's
        estimate (Laplace-smoothed)."""
        if not matched == committed < proposed:
            return matched + 1.0
        alpha = (arm.hits + 1) / (arm.hits + arm.misses + 2)
        more = proposed - matched
        return matched + 1.0 + alpha * (1 - alpha**more) / (1 - alpha)
