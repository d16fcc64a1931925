"""The goodput model: g(row, d) = E[tokens | row, d] / t_row(B, d, k) (docs/lbss.md#goodput).

The tokens are learned per request (`TokensModel`); the seconds come from the step-cost fits
(`CostModel`) at the batch size being planned, so what a request taught carries across batch sizes.
A switch's catch-up is priced apart, once, as a penalty in the matching (docs/lbss.md#catch-up).
"""

from __future__ import annotations

from ...planning.estimates import longest_draft
from .state import PLAIN, LBSSState, RowState

# d log(draft seconds) / d log(parameters): prices a drafter before its first draft from the one
# measured most (`Pricing.draft_seconds`; docs/lbss.md#draft-size-elasticity).
DRAFT_SIZE_ELASTICITY = 0.5


def goodput(tokens: float, seconds: float | None) -> float:
    """Tokens per second; the tokens alone while no step time is known (they still rank drafters)."""
    return tokens / seconds if seconds else tokens


class Pricing(LBSSState):
    """Expected tokens, a row's seconds of a step, catch-up costs: what every decision weighs."""

    def estimate(self, row: RowState, drafter: int, k: int, drafting: int) -> float:
        """g(row, d) as weighed against plain decoding: `expected_tokens` at `careful_optimism` over
        the row's share of the step (`row_seconds`, with `drafting` rows drafting)."""
        return goodput(
            self.expected_tokens(row, drafter, k, self.careful_optimism(drafter)),
            self.row_seconds(drafter, k, drafting),
        )

    def careful_optimism(self, drafter: int) -> float:
        """Sds up at which `drafter` is weighed against plain decoding: `plain_optimism`; 0 for a
        drafter measured by shadow drafts, which keeps measuring a row that decodes plainly
        (docs/lbss.md#plain_optimism)."""
        return 0.0 if self.shadowed[drafter] else self.config.plain_optimism

    def rank_optimism(self, drafter: int) -> float:
        """Sds up at which `drafter` is ranked against the other drafters: `optimism`;
        `shadow_optimism` for a drafter measured by shadow drafts, which an upper bound would not get
        measured any more than it is (docs/lbss.md#shadow_optimism)."""
        return self.config.shadow_optimism if self.shadowed[drafter] else self.config.optimism

    def plain_margin(self, drafter: int | None) -> float:
        """Fraction by which `drafter` must lead plain decoding for a row to leave plain decoding for
        it: `shadow_margin` for a drafter measured by shadow drafts (no row is locked out of it), 0
        for the others (docs/lbss.md#shadow_margin)."""
        return self.config.shadow_margin if drafter is not None and self.shadowed[drafter] else 0.0

    def expected_tokens(self, row: RowState, drafter: int, k: int, z: float | None = None) -> float:
        """Tokens d's next step commits on the row: the `TokensModel` posterior z sds up (default
        `optimism`); a drafter no request has measured counts as the best measured one, so it gets
        tried. Capped at what d's drafts can commit, k x min(fill_d, 1) + 1 (docs/lbss.md#optimism)."""
        z = self.config.optimism if z is None else z
        tokens = self.tokens_model.tokens_per_step(row.row_id, drafter, z)
        if tokens is None:
            known = [self.tokens_model.tokens_per_step(row.row_id, d, z) for d in range(len(self.drafters))]
            tokens = max((x for x in known if x is not None), default=0.0)
        return min(
            tokens, k * min(self.fill_fraction(drafter), 1.0) + 1
        )  # a tree of more nodes than k still commits at most k + 1

    def fill_fraction(self, drafter: int) -> float:
        """fill_d: the fraction of k that d's drafts reach (1 before any)."""
        fill = self.fill[drafter].mean
        return 1.0 if fill is None else fill

    def row_seconds(self, drafter: int, k: int, drafting: int, fill: float | None = None) -> float | None:
        """t_row: a row's predicted share of a step at the batch size B being planned, with drafter d
        drafting k tokens for it (PLAIN: none) and `drafting` rows of the batch drafting:

            t_row = t_verify(B, B) / B                                   an equal part of a plain step
                  + [t_verify(B, B + n) - t_verify(B, B)] / drafting      the positions the drafts add
                  + (f_d F + t_d k fill_d s_d) / s_d                       d's forwards, shared by its rows

        n: packed, drafting x k x fill_d; padded, B x the longest of `drafting` drafts. F: the
        longest of d's s_d drafts, at least 1; s_d: rows d serves per step (B before any). `fill`:
        in place of fill_d. None before any step. Derivation: docs/lbss.md#row-seconds."""
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
        forwards = max(
            1.0, longest_draft(k, min(fill, 1.0), served)
        )  # a tree's k depths: k forwards, however many nodes
        return plain / B + verify + self.draft_seconds(drafter, forwards, k * fill * served) / served

    def catch_up_seconds(self, drafter: int) -> float:
        """Seconds per token of catch-up for `drafter`: configured, or learned; before it has caught a
        row up, the learned cost of the drafter measured most scaled by parameter count; 0 before
        any. A catch-up priced at 0 is paid at a loss (docs/lbss.md#catch-up)."""
        cost = self.config.switch_cost
        if cost is not None:
            return cost[drafter] if isinstance(cost, tuple) else cost
        costs = self.costs
        return costs.catch_up_seconds(drafter) or self.by_size(
            drafter, costs.catch_up_seconds, costs.catch_up_evidence, 1.0
        )

    def draft_seconds(self, drafter: int, forwards: float, row_tokens: float) -> float:
        """Predicted seconds of `drafter`'s drafts in a step, `forwards` sequential forwards and
        `row_tokens` draft tokens summed over its rows (`CostModel.draft_seconds`); before its first steady
        step, those of the drafter measured most scaled by `DRAFT_SIZE_ELASTICITY`: priced at 0, an
        unexplored model drafter looked as cheap as prompt lookup (docs/lbss.md#draft-size-elasticity)."""
        costs = self.costs
        if costs.knows_draft(drafter):
            return costs.draft_seconds(drafter, forwards, row_tokens)
        return self.by_size(
            drafter,
            lambda e: costs.draft_seconds(e, forwards, row_tokens),
            costs.draft_evidence,
            DRAFT_SIZE_ELASTICITY,
        )

    def by_size(self, drafter: int, measured, weight, elasticity: float) -> float:
        """A cost of `drafter` not measured yet: `measured(e)` of the drafter e with parameters whose
        cost has the most evidence `weight(e)` (`CostModel.draft_evidence`, `catch_up_evidence`),
        times (parameters of `drafter` / of e) ^ `elasticity`; 0 for a drafter without parameters or
        before any is measured."""
        size = self.drafters[drafter].num_parameters
        if not size:
            return 0.0
        known = [
            e
            for e in range(len(self.drafters))
            if e != drafter and self.drafters[e].num_parameters and weight(e) > 0 and measured(e)
        ]
        if not known:
            return 0.0
        e = max(known, key=weight)
        return measured(e) * (size / self.drafters[e].num_parameters) ** elasticity

    def lag(self, row: RowState, drafter: int) -> int:
        """Tokens `drafter` must catch up before it can draft for `row` (beyond the usual one)."""
        return max(0, row.length - row.arms[drafter].synced - 1)

    def switch_penalty(self, row: RowState, drafter: int, goodput: float, horizon: float, tau: float | None) -> float:
        """The goodput lost by paying d's catch-up on the row once over `horizon` steps of `tau`
        seconds, g s / (s + T tau) (docs/lbss.md#matching)."""
        s = self.catch_up_seconds(drafter) * self.lag(row, drafter)
        if s <= 0 or goodput <= 0:
            return 0.0
        tau = tau or 1.0 / goodput
        return goodput * s / (s + max(horizon, 1) * tau)
