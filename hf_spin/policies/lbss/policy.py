"""`LBSSPolicy`: the parts of LBSS wired into the `Policy` interface: set-up (`bind`, rows joining and
leaving), `select` (a step's choices, in order), `plan` (with shadow drafts, preemption, catch-ups)
and `update` (learning from what the step did). What it does step by step: docs/lbss.md#step-by-step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...planning.estimates import DecayedMean, DraftObservation
from ..base import BatchView, DrafterInfo, DraftLength, Plan, Policy, StepFeedback
from ..checks import check_per_drafter
from ..tokens_model import TokensModel
from .config import LBSSConfig
from .lookup import Lookup
from .matching import Matching
from .state import PLAIN, Arm, RowState

PRIOR_ROWS = 2.0  # pseudo-requests behind prior_spread in the spread estimate: a few requests override it
PRIOR_NOISE = 0.5  # prior step-to-step sd of log goodput (accepted + 1 in 1..k+1: logs spread ~0.5)


class LBSSPolicy(Matching, Lookup, Policy):
    """Learning-based drafter selection (Spin): an online bandit that learns, per request, which
    drafter gives the most goodput, under per-drafter batch capacities (docs/lbss.md)."""

    def __init__(self, draft_length: DraftLength | None = None, config: LBSSConfig | None = None):
        super().__init__(draft_length)
        self.config = config or LBSSConfig()
        self.rng = np.random.default_rng(self.config.seed)
        self.rows = {}
        self.tokens_model = self._new_model(0)
        self.shadowed = []
        self.tokens_per_step = DecayedMean()
        self.fill = []
        self.served = []
        self.by_match = []
        self.padded = True
        self.alpha = self.config.alpha or self.config.beta
        self.batch_size = 1
        self._catch_up: dict[int, list[int]] = {}  # this step's Plan.catch_up, set by select

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
        self.shadowed = [self.config.shadow and info.num_parameters == 0 for info in drafters]
        self.alpha = self.config.alpha or self.config.beta * max(1, n - sum(self.shadowed))

    def _new_model(self, num_drafters: int) -> TokensModel:
        c = self.config
        return TokensModel(num_drafters, c.prior_spread, PRIOR_ROWS, PRIOR_NOISE, c.history)

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        B = view.batch_size
        total = sum(self.capacity(d, B) for d in range(len(self.drafters)) if view.usable[d])
        if total < B:
            raise ValueError(
                f"LBSSConfig.capacities={self.config.capacities} let the drafters serve at most {total} rows "
                "in one step, "
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
        return RowState(
            row_id=view.row_ids[b],
            length=view.prompt_lengths[b] + view.generated[b],
            arms=[Arm() for _ in self.drafters],
        )

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

    # --- selection -----------------------------------------------------------------------------

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        """Each row's drafter this step: all plain on a plain probe; else exploration chunks in
        progress, new chunks, then the exploitation matching; and the next step's draws and catch-ups."""
        B = self.batch_size = view.batch_size
        rows = [self._row(view, b) for b in range(B)]
        stages = [self.stage(r.age) for r in rows]
        cap = [self.capacity(d, B) if view.usable[d] else 0 for d in range(len(self.drafters))]
        choice: list[int | None] = [None] * B
        for r in rows:
            r.runner_up = None  # set again if the row is matched this step
        if self.probes_plain(view, rows):
            self._catch_up = {}
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
            r.pending = (
                None  # drawn for this step only: a row that no longer explores drops it (else caught up for nothing)
            )
        # 3. Exploitation: maximum-weight matching, plain decoding included.
        self._match(view, rows, stages, cap, choice)
        # 4. Draw the next exploration chunks a step ahead (their drafters catch up meanwhile).
        self._draw_ahead(view, rows, choice)
        self._catch_up = self._catch_up_plan(view, rows, choice)
        for r in rows:
            r.age += 1
        return [() if d == PLAIN else (d,) for d in choice]

    def plan(self, view: BatchView) -> Plan:
        """`select`'s plan with this step's catch-ups, shadow drafts and preemptions."""
        plan = super().plan(view)
        shadow = self.shadow_plan(view, plan)
        return replace(plan, catch_up=self._catch_up, shadow=shadow, preempt=self.preempt_plan(view, plan))

    # --- learning ------------------------------------------------------------------------------

    def catch_up_tokens(self, feedback: StepFeedback) -> list[float]:
        """[num_drafters] catch-up tokens per drafter in the step (a switch or an idle catch-up), which the
        catch-up cost is learned from; records what each drafter now holds of each row."""
        plan, n = feedback.plan, len(self.drafters)
        rows = [self.rows.get(rid) for rid in feedback.row_ids]
        new_length = [r.length + a + 1 if r else 0 for r, a in zip(rows, feedback.accepted)]
        # 1. Catch-up tokens per drafter (a switch or an idle catch-up), and what each drafter now holds.
        switch = [0.0] * n
        for b, r in enumerate(rows):
            if r is not None and plan.k[b] > 0:
                for d in plan.drafters[b]:
                    switch[d] += self.lag(r, d)
                    r.arms[d].synced = new_length[b] - 1
        for d, batch_rows in plan.catch_up.items():
            for b in batch_rows:
                r = rows[b]
                if r is not None and d < n:
                    switch[d] += max(0, new_length[b] - 1 - r.arms[d].synced)
                    r.arms[d].synced = new_length[b] - 1
        return switch

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step: catch-up and draft costs (`Policy.update`, with `catch_up_tokens`), each
        row's tokens, shadow drafts' would-be tokens."""
        super().update(feedback)
        plan, n = feedback.plan, len(self.drafters)
        rows = [self.rows.get(rid) for rid in feedback.row_ids]
        # 1. Catch-up tokens and step costs: learned by super().update (`catch_up_tokens`).
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

    def _count(
        self, row: RowState, drafter: int, matched: int, proposed: int, committed: int, feedback: StepFeedback, b: int
    ) -> None:
        """A draft's per-token acceptance evidence (`Arm.count`), on the row and pooled over every row."""
        match = feedback.match_lengths[b].get(drafter) if feedback.match_lengths else None
        row.arms[drafter].count(matched, proposed, committed, match)
        self.by_match[drafter].count(matched, proposed, committed, match)
