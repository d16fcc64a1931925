"""Which drafter serves which row this step, as maximum-weight matchings of rows to drafter slots
(drafter j repeated B_j times, plain decoding unlimited), and which idle drafters catch up for the next step.

- Exploration draws (`_draw`): rows starting a chunk -> free slots, least-tried drafter first; ties by
  one random order shared by the rows, so rows exploring together share a drafter's forwards.
- Exploitation (`_match`): rows -> slots on estimated goodput net of the switch penalty, plain
  decoding weighed as never-slower asks (docs/lbss.md#matching, docs/lbss.md#never_slower).
- Plain probes (`probes_plain`, docs/lbss.md#plain_probe) and catch-ups (`_catch_up_plan`,
  docs/lbss.md#prefill_margin).
"""

from __future__ import annotations

import numpy as np

from ..base import BatchView
from .pricing import goodput
from .schedule import Schedule, Stage
from .state import PLAIN, RowState

NO_PLAIN = -1e18  # weight of a plain slot when plain decoding is not an option (taken only if no drafter slot is left)
# weight of a slot a row may not take (explore: not explorable; exploit: `may_switch`), taken only when no other is
# left
LAST_RESORT = -1e6
# A repeat plain probe only where the rows' best drafters are within this fraction of the measured
# plain goodput: only there could it overturn their choices at little cost (docs/lbss.md#plain_probe).
PROBE_MARGIN = 0.5
CATCH_UP_KINDS = frozenset({"model", "translation"})  # drafters that keep a per-row cache to catch up


def linear_sum_assignment(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight matching of rows to columns (scipy), with a clear error when scipy is missing."""
    try:
        from scipy.optimize import linear_sum_assignment as lsa
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("policy='lbss' needs scipy for its matching: pip install scipy") from err
    return lsa(weights, maximize=True)


def assign(weights: np.ndarray, slots: list[int]) -> list[int]:
    """[R] the slot entry (a drafter, or PLAIN) each row takes in a maximum-weight matching of `weights` [R, S]
    (columns: `slots`): each row's best column where that takes no entry more often than it has slots (no row gives
    anything up, so it is a maximum matching, and scipy's; the usual case: every drafter offers every row a slot),
    else scipy's matching. Scipy costs tens of microseconds a call, and the matching runs every step."""
    best = [slots[j] for j in weights.argmax(axis=1)]
    if all(best.count(e) <= slots.count(e) for e in set(best)):
        return best
    out = [PLAIN] * len(best)
    for i, j in zip(*linear_sum_assignment(weights)):
        out[i] = slots[j]
    return out


class Matching(Schedule):
    """Rows -> drafter slots, step by step; the slots each drafter offers (`capacity`)."""

    def capacity(self, drafter: int, batch_size: int) -> int:
        """B_j at this batch size: `LBSSConfig.capacities` (None: every row)."""
        caps = self.config.capacities
        cap = caps[drafter] if caps is not None else None
        return batch_size if cap is None else min(cap, batch_size)

    def probes_plain(self, view: BatchView, rows: list[RowState]) -> bool:
        """Whether this step is a plain probe: due at the batch-size bucket (`plain_probe`), no row
        exploring, and either the bucket's first or every row's best drafter within PROBE_MARGIN of
        the measured plain goodput (a repeat probe then costs each row at most that margin)."""
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

    def explore_weights(self, row: RowState, drafters: list[int], age: int) -> list[float]:
        """Exploration value of each drafter for the row's chunk starting at `age`: least-tried on the
        row first; a drafter it may not explore then (`explorable`) only as a slot of last resort."""
        explorable = self.explorable(row, age)
        return [-row.arms[d].tries if d in explorable else LAST_RESORT for d in drafters]

    def _draw(self, rows: list[RowState], cap: list[int], ahead: int) -> list[int | None]:
        """Rows -> free drafter slots for their next exploration chunks, maximising the exploration
        weights. Ties go by one random order of the drafters shared by the rows: drafters run one
        after another on one device, so rows exploring the same drafter share its forwards.
        `ahead`: the chunks start that many steps after the rows' current age."""
        slots = [d for d in range(len(cap)) for _ in range(min(max(cap[d], 0), len(rows)))]
        out: list[int | None] = [None] * len(rows)
        if not rows or not slots:
            return out
        weights = np.array([self.explore_weights(r, slots, r.age + ahead) for r in rows], dtype=float)  # [R, S]
        order = self.rng.random(len(cap))  # [num_drafters] the shared tie-break
        weights += 1e-6 * order[slots][None, :] + 1e-9 * self.rng.random(
            weights.shape
        )  # ties only; the last, between rows
        for i, j in zip(*linear_sum_assignment(weights)):
            out[i] = slots[j]
        return out

    def _match(
        self, view: BatchView, rows: list[RowState], stages: list[Stage], cap: list[int], choice: list[int | None]
    ) -> None:
        """Exploitation: the rows without a choice yet -> drafter slots or plain, maximising estimated
        goodput net of switching (fills `choice`, and each row's `runner_up`). A row's step time
        depends on the others' choices (drafting rows share the padded positions): the first
        matching assumes every row drafts, each next one splits the positions as the previous one
        did, until a matching, or the split it implies, repeats (docs/lbss.md#matching)."""
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
        tokens = [
            [self.expected_tokens(rows[b], d, ks[i][d], self.rank_optimism(d)) for d in range(len(cap))]
            for i, b in enumerate(todo)
        ]  # [R][num_drafters]
        careful_tokens = [
            [self.expected_tokens(rows[b], d, ks[i][d], self.careful_optimism(d)) for d in range(len(cap))]
            for i, b in enumerate(todo)
        ]
        horizons = [min(stages[b].epoch_end - rows[b].age, self.steps_left(rows[b])) for b in todo]
        allowed = [[self.may_switch(rows[b], d) for d in range(len(cap))] for b in todo]  # [R][num_drafters]
        decided = [d for d in choice if d is not None]  # exploring rows: they draft (or not) whatever the matching does
        seconds: dict[
            tuple[int, int, int], float | None
        ] = {}  # (drafter, k, drafting) -> row_seconds: the same for every row
        guess: list[int] | None = None  # the previous matching ([R]); None: every row drafts
        counted: list[int] | None = None  # [R] the rows drafting beside each row on the previous pass
        for _ in range(len(todo) + 1):
            others = [decided + (guess[:i] + guess[i + 1 :] if guess else []) for i in range(len(todo))]
            counts = [B if guess is None else 1 + sum(e != PLAIN for e in o) for o in others]  # [R]
            if counts == counted:  # the previous pass's weights: its matching again
                break
            counted = counts
            weights = np.full((len(todo), len(slots)), NO_PLAIN)  # [R, S]
            goodputs = np.zeros((len(todo), len(cap)))  # [R, num_drafters]
            for i, b in enumerate(todo):
                drafting = counts[i]
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
            out = assign(weights, slots)
            if out == guess:
                break
            guess = out
        for i, (b, d) in enumerate(zip(todo, out)):
            choice[b] = d
            if d != PLAIN:
                others = [
                    e for e in range(len(cap)) if e != d and goodputs[i, e] >= (1 - c.prefill_margin) * goodputs[i, d]
                ]
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

    def _catch_up_plan(self, view: BatchView, rows: list[RowState], choice: list[int]) -> dict[int, list[int]]:
        """Idle model drafters -> batch rows they will likely serve next and lag on."""
        busy = set(choice)
        idle = {
            d
            for d, info in enumerate(self.drafters)
            if view.usable[d] and d not in busy and info.kind in CATCH_UP_KINDS
        }
        plan: dict[int, list[int]] = {}
        for b, r in enumerate(rows):
            if self.steps_left(r) < 2:  # no later step to switch in
                continue
            for d in {r.pending, r.runner_up}:
                if d not in idle or (d != r.pending and not self._cheap_catch_up(r, d, r.ks[d])):
                    continue
                if self.lag(r, d) >= self.config.prefill_min_tokens:
                    plan.setdefault(d, []).append(b)
        return plan

    def _cheap_catch_up(self, row: RowState, drafter: int, k: int) -> bool:
        """Whether catching up a runner-up costs at most `prefill_margin` of a step of the row, the
        most a step on it could gain: an idle drafter is not free where drafters and the target share
        the device (docs/lbss.md#prefill_margin)."""
        step = self.row_seconds(drafter, k, self.batch_size) or 0.0
        return self.catch_up_seconds(drafter) * self.lag(row, drafter) <= self.config.prefill_margin * step
