"""`LBSSConfig`: the knobs of LBSS, validated when made. Each knob's meaning, default and the evidence
behind the default: docs/lbss.md#knobs (one heading per knob)."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_float, check_int


@dataclass
class LBSSConfig:
    # Exploration steps per epoch; None: beta x the drafters not measured by shadow drafts, so each
    # row tries each of them once per epoch (docs/lbss.md#alpha).
    alpha: int | None = None
    # Steps a row keeps a drafter while exploring: the first pays the catch-up, the rest measure its
    # steady goodput (docs/lbss.md#beta).
    beta: int = 2
    # B_j: most rows drafter j serves in one step (its memory, its latency); None: unlimited
    # (docs/lbss.md#capacities).
    capacities: tuple[int | None, ...] | None = None
    # Seconds per token a drafter spends catching a row up, one for all or one per drafter; None:
    # learned from the steps (docs/lbss.md#switch_cost).
    switch_cost: float | tuple[float, ...] | None = None
    # Exploiting, a row decodes plainly when no drafter's estimated goodput beats plain decoding's
    # (docs/lbss.md#never_slower).
    never_slower: bool = True
    # A whole plain step once a batch-size bucket went this many steps without one (None: never):
    # the verify fit extrapolated to zero drafts can be far off (docs/lbss.md#plain_probe).
    plain_probe: int | None = 32
    # Pre-fill an exploiting row's runner-up drafter when within this fraction of the best, and its
    # catch-up within this fraction of a step (docs/lbss.md#prefill_margin).
    prefill_margin: float = 0.1
    # ...and only when it lags this many tokens: a forward for 1-2 tokens costs more than it saves
    # (docs/lbss.md#prefill_min_tokens).
    prefill_min_tokens: int = 8
    # Exploiting, drafters are ranked at their posterior log tokens this many sds up, an upper
    # confidence bound that gets an untried drafter tried (docs/lbss.md#optimism).
    optimism: float = 2.5
    # ...and weighed against plain decoding this many sds up (drafters measured by shadow drafts: at
    # their mean), so one unlucky step does not end a drafter's use (docs/lbss.md#plain_optimism).
    plain_optimism: float = 1.0
    # Drafters measured by shadow drafts are ranked this many sds up instead of `optimism`: they are
    # measured on every row anyway (docs/lbss.md#shadow_optimism).
    shadow_optimism: float = 0.5
    # never_slower: a row leaves plain decoding for a drafter measured by shadow drafts only when it
    # leads plain decoding's goodput by this fraction (docs/lbss.md#shadow_margin).
    shadow_margin: float = 0.1
    # Prior sd over requests of a drafter's log goodput around its mean (0.3: +-35%)
    # (docs/lbss.md#prior_spread).
    prior_spread: float = 0.3
    # A catch-up pays off when a drafter this fraction faster than plain decoding would repay it
    # over the steps the row has left (docs/lbss.md#catch_up_margin).
    catch_up_margin: float = 0.1
    # Ended requests whose steps the estimates keep (docs/lbss.md#history).
    history: int = 64
    # Warm, a row explores (once) each drafter fewer than this many ended requests measured, even in
    # epochs too short to amortise a full exploration (docs/lbss.md#settle).
    settle: int = 3
    # A row explores a drafter the estimates cover only when what a chunk of it could teach beats
    # its cost (docs/lbss.md#knowledge_gradient).
    knowledge_gradient: bool = True
    # Model-free drafters (prompt lookup) draft every row they do not serve, unverified: measured for
    # free (docs/lbss.md#shadow).
    shadow: bool = True
    # ...and draft first, a row verifying such a draft in place of its drafter's when it is long
    # enough to beat it (docs/lbss.md#preempt).
    preempt: bool = True
    # Exploration draws: the same seed gives the same plans on the same feedback.
    seed: int = 0

    def __post_init__(self):
        owner = "LBSSConfig"
        check_int(owner, "beta", self.beta, 1)
        if self.alpha is not None:
            check_int(owner, "alpha", self.alpha, self.beta)
        if self.capacities is not None:
            if not isinstance(self.capacities, (tuple, list)) or not all(
                c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1) for c in self.capacities
            ):
                raise ValueError(
                    f"{owner}.capacities must be a tuple of positive ints (None: unlimited), one per drafter, "
                    f"got {self.capacities!r}"
                )
            self.capacities = tuple(self.capacities)
        if isinstance(self.switch_cost, list):
            self.switch_cost = tuple(self.switch_cost)
        costs = (
            self.switch_cost
            if isinstance(self.switch_cost, tuple)
            else ()
            if self.switch_cost is None
            else (self.switch_cost,)
        )
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
