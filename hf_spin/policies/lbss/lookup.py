"""Prompt lookup (a drafter without parameters): measured by shadow drafts, and preempting per step.

- Shadow drafts (docs/lbss.md#shadow): it drafts every row it does not serve, unverified; its
  would-be tokens on the row are what the step committed of its draft (`shadow_tokens`).
- Preemption (docs/lbss.md#preempt): at batch 1 and on packed rows it also drafts first, and a row
  verifies its draft in its drafter's place on the steps the draft is long enough, continuing a long
  enough match, to beat the row's plan (`preempt_plan`): a selection per step on top of the one per
  request.
"""

from __future__ import annotations

import functools

from ...planning.estimates import acceptance_with_prior, geometric_tokens
from ...planning.plan import BatchView, Plan, Preempt
from .pricing import Pricing, goodput
from .state import PLAIN, Arm, RowState

# pseudo-drafts at the acceptance pooled over every row behind a row's acceptance per match length
# (`match_acceptance`)
MATCH_PRIOR = 2.0


class Lookup(Pricing):
    """`Plan.shadow` and `Plan.preempt` for the drafters measured by shadow drafts."""

    def shadow_plan(self, view: BatchView, plan: Plan) -> dict[int, dict[int, int]]:
        """`Plan.shadow`: each usable drafter measured by shadow drafts -> {batch row it does not serve: k}."""
        shadow = {
            d: {b: self.draft_length.k(d, b, view) for b, ds in enumerate(plan.drafters) if d not in ds}
            for d in range(len(self.drafters))
            if self.shadowed[d] and view.usable[d]
        }
        return {d: rows for d, rows in shadow.items() if rows}

    def preempt_plan(self, view: BatchView, plan: Plan) -> dict[int, dict[int, Preempt]]:
        """`Plan.preempt`: for each row a drafter measured by shadow drafts does not serve, (k, least,
        min match) from `preempt_rule`, against the row's drafter at its posterior mean tokens over
        its t_row (plain decoding: a plain step's share). Not in an exploration chunk (its steps
        measure its drafter), nor on a padded batch of several rows, where one row's draft makes
        every row verify its length, which this per-row rule does not price (docs/lbss.md#preempt)."""
        B = view.batch_size
        if not self.config.preempt or (self.padded and B > 1):
            return {}
        drafting = sum(1 for ds in plan.drafters if ds)
        out: dict[int, dict[int, Preempt]] = {}
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
                    out.setdefault(p, {})[b] = Preempt(row.ks[p], *rule)
        return out

    def preempt_rule(self, row: RowState, drafter: int, target: float, drafting: int) -> tuple[int, int] | None:
        """(least, min match) for `drafter` preempting on the row: the shortest match length, and the
        shortest draft continuing it, whose goodput reaches `target` (L tokens commit sum_{i<=L}
        a^i, a its acceptance at that match length, `match_acceptance`, over the row's share
        of a step verifying them); None when no draft it can make does."""
        # length -> the row's share of a step verifying it: the same at every match length, priced once
        share = functools.cache(lambda length: self.row_seconds(drafter, length, drafting, fill=1.0))
        for match, acceptance in self.match_acceptance(row, drafter):
            for length in range(1, row.ks[drafter] + 1):
                if geometric_tokens(acceptance, length) / share(length) >= target:
                    return length, match
        return None

    def match_acceptance(self, row: RowState, drafter: int) -> list[tuple[int, float]]:
        """[(match length, per-token acceptance)] of `drafter`'s drafts on the row, shortest match
        first: per match length the row's hits / (hits + misses) shrunk toward every row's by
        MATCH_PRIOR pseudo-drafts, since lookup's drafts accept far more after longer matches
        (docs/lbss.md#preempt). A drafter that reports no match length: [(0, the row's acceptance
        over all its drafts, Laplace-smoothed)]."""
        pooled = self.by_match[drafter].by_match
        arm = row.arms[drafter]
        if not pooled:
            return [(0, acceptance_with_prior(arm.hits, arm.misses, 0.5, 2))]
        out = []
        for match in sorted(pooled):
            hits, misses = pooled[match]
            prior = acceptance_with_prior(hits, misses, 0.5, 2)
            own_hits, own_misses = arm.by_match.get(match, (0, 0))
            out.append((match, acceptance_with_prior(own_hits, own_misses, prior, MATCH_PRIOR)))
        return out

    @staticmethod
    def shadow_tokens(arm: Arm, committed: int, proposed: int, matched: int) -> float:
        """Tokens a step would have committed had the shadow draft been verified (greedy: exact unless
        censored). Censored (every committed token matched, more were proposed): the rest follows the
        row's per-token acceptance for the drafter, hits / (hits + misses), the censored geometric's
        estimate (Laplace-smoothed)."""
        if not matched == committed < proposed:
            return matched + 1.0
        acceptance = acceptance_with_prior(arm.hits, arm.misses, 0.5, 2)
        more = proposed - matched
        return matched + 1.0 + acceptance * (1 - acceptance**more) / (1 - acceptance)
