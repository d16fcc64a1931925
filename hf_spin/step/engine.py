"""The engine: batched, lossless speculative decoding over rows that join and leave between steps.

    engine = SpinEngine(model, pool)                          # pool=None: plain decoding, still batched
    row = engine.add(Request(prompt_ids, max_new_tokens=64))   # joins at the next step
    while engine.has_work:
        engine.step()
    row.generated, row.finish_reason, row.stats

A step retires the rows that are done, then either admits the rows that arrived since the last one
(continuous batching: a ragged prefill of the new rows alone, appended to the running batch's
caches, their first token) or runs one speculative step of every active row. The steps, numbered
as in docs/design.md:

    1. admit     prefill joining rows, their first token                       (admission.py)
    2. retire    rows that stopped, were cancelled or failed leave the batch
    3. plan      the policy picks drafters and caps k; plan_k sizes k per row   (policies/, planning/)
    4. draft     each drafter drafts for the rows it serves                     (drafters/)
    5. verify    one target forward over [last token] + draft per row; accept   (verification.py)
    6. commit    accepted + recovered/bonus tokens, stops, cache rollback
    7. catch-up  idle drafters the plan names catch up; the policy hears what happened

Each row has its own parameters (`rows.Request`): processors (processors.py), stopping criteria,
length limit, greedy or sampled, its own seed. `propose` (steps 3-4) and `verify` (steps 5-7) are
separate so that a pipeline (pipeline.py) can draft one micro-batch while it verifies another. What
a fault costs (a drafter, the target, one row) is faults.py's business: each guarded call there
returns what the happy path needs. The helpers (drafting.py, faults.py, tree_step.py) get what they
read as arguments and return what happened (`DrafterCall`s); the engine alone updates its own state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from time import perf_counter

import torch

from .. import host_syncs
from ..cache import PackedCache, RectangularCache, RowCache, forward_ragged
from ..cache.encoder_rows import EncoderRows
from ..cache.forward import FILLER_TOKEN
from ..cache.static import StaticRowCache, give_back, take_cache
from ..cache.static_forward import FIRST_RUNS, StaticOptions, StaticTarget, forward_static_tokens
from ..drafters import Drafter
from ..drafters.model import ModelDrafter, common_prefix_length
from ..host_syncs import to_device
from ..planning.cost_profile import DRAFTING, PLAIN, WIDENED
from ..planning.plan import BatchView, Plan, StepFeedback, shadow_lengths
from ..planning.planner import plan_k
from ..planning.prefill import prefill_groups
from ..policies import Policy
from ..pool import AssistantPool
from ..stats import DrafterStats, GenerationStats
from ..verify.chains import RowSampling, verify_rows
from ..verify.token_tree import TokenTree
from . import admission, tree_step
from .continuations import Observed, follow, start
from .drafting import Drafting
from .faults import DrafterCall, DrafterScope, Faults
from .processors import GenerateBatch, first_scores, row_processors, target_scores
from .rows import CANCELLED, ERROR, LENGTH, STOPPED, Request, Row
from .stopping import HostStop
from .widths import widen


@dataclass
class Proposal:
    """Steps 3-4 of a step (plan and drafts), handed to `verify`. Batch order as `engine.rows` then."""

    plan: Plan | None  # None without a pool
    chosen: list[tuple[int, ...]]  # [B] drafters that drafted for each row (usable, not banned)
    ks: list[int]  # [B] draft length per row (`plan_k`: within the policy's cap and the row's room)
    drafts: list[list[int]]  # [B] the candidates verified per row (a vote's heaviest path when voting)
    qs: list[torch.Tensor | None]  # [B] q [k_b, V] of a single model drafter when sampling, else None (one-hot)
    proposals: list[dict[int, list[int]]]  # [B] drafter -> its own draft
    draft_seconds: list[float]  # [num_drafters] wall time per drafter in this step (shadow drafts included)
    shadows: list[dict[int, list[int]]]  # [B] drafter -> its shadow draft (Plan.shadow): compared, never verified
    # [B] drafter -> the match its draft (served or shadow) continued, where it reports one
    match_lengths: list[dict[int, int]]
    trees: list[TokenTree | None] | None = None  # [B] a vote's whole token tree per row (tree_step.py); None: chains
    lags: list[dict[int, int]] = field(default_factory=list)  # [B] `StepFeedback.lags`
    idle_seconds: float = 0.0  # `StepFeedback.idle_seconds`


@dataclass
class StepOutcome:
    """What step 5 decided, per row in batch order, for the commit (step 6) and the policy's feedback."""

    accepted: list[int]  # [B] draft tokens accepted
    next_tokens: list[int]  # [B] the target's token after them (recovered or bonus)
    kept: list[list[int]]  # [B] the accepted draft tokens
    row_scores: list[torch.Tensor]  # [B] [accepted + 1, V] the target's processed scores at the committed tokens
    positions: int | None  # the positions the target's forward ran over (None: as `verified_tokens` counts a tree's)
    alternatives: list[bool | None]  # [B] per token tree, whether its heaviest path's siblings earned a token
    filled: bool = False  # the forward ran over filler tokens too (a cheaper width): the rollback drops them
    filler_rows: int = 0  # rows of filler tokens the forward ran beside the batch's (`SpinEngine._filler_rows`)


class SpinEngine:
    """Speculative decoding over a batch that rows join and leave between steps.

    model: the target causal LM.
    pool: an `AssistantPool` (drafters + policy), or None for plain batched decoding.
    tokenizer: the target's tokenizer, for drafters with another tokenizer (else the pool's).
    isolate_faults: a fault fails only the rows it touched (faults.py); False keeps `generate`'s contract.
    drafters, policy: this engine's own drafter objects and policy instead of the pool's (the lanes
        of a pipeline each draft with their own copies, sharing the models).
    row_ids: where row ids come from (default: the pool's counter, so ids stay unique across calls and
        the policy can tell a new request from one it has seen).
    defer_idle_catch_up: run step 7 (idle drafters catching up) at the start of the next `propose`
        instead of at the end of `verify`, so that in a pipeline only the drafting thread runs drafters.
    faults: the fault policy (default `Faults(isolate_faults)`; a pipeline's lanes call drafters on
        its drafting stream).
    static: verify (and draft with model drafters) on the static layout with these options whatever the
        pool's layout says (`generate`'s `cache_implementation="static"` with a rectangular pool); None: the
        pool's.
    run_ahead: let a step that drafts nothing launch the next one-token forward before its tokens are read,
        where the static options say so (`StaticOptions.run_ahead`; docs/design.md, "Run-ahead"); a
        pipeline's lanes, whose steps two threads share, pass False.
    """

    def __init__(
        self,
        model,
        pool: AssistantPool | None = None,
        tokenizer=None,
        *,
        isolate_faults: bool = False,
        drafters: list[Drafter] | None = None,
        policy: Policy | None = None,
        row_ids=None,
        defer_idle_catch_up: bool = False,
        faults: Faults | None = None,
        static: StaticOptions | None = None,
        run_ahead: bool = True,
    ):
        self.model = model
        self.pool = pool
        self.cache_layout = pool.cache_layout if pool is not None else "rectangular"  # pool.CACHE_LAYOUTS
        if static is not None and self.cache_layout == "packed":
            raise ValueError("a static cache for the target and cache='packed' are two layouts; pick one")
        static = static or (pool.static if pool is not None else None)
        if pool is not None:
            bound = pool.bind(model, tokenizer, static)  # the profile is measured on this call's layout
            self.drafters: list[Drafter] = list(drafters) if drafters is not None else bound
            self.policy: Policy | None = policy or pool.policy
            self.names: list[str] = pool.names  # unique per drafter
        else:
            self.drafters, self.policy, self.names = [], None, []
        # the target's verification forward on the static layout; None: rectangular or packed
        self.static = StaticTarget(model, static) if static is not None else None
        self.run_ahead = run_ahead and static is not None and static.runs_ahead(model)
        # [B, 1, V] float32: the logits of a one-token forward a plain step ran ahead (`_launch_ahead`), its
        # token already in the target's cache; None: the cache holds every committed token but the last
        self._ahead: torch.Tensor | None = None
        for drafter in self.drafters:  # model drafters decode on the same layout, through caches of their own
            if isinstance(drafter, ModelDrafter):
                drafter.static = static
        # token trees (tree_step.usable): "auto", False, or a node cap
        self.tree = pool.tree if pool is not None else False
        self.tree_capability = tree_step.capability(model) if self.tree is not False else (False, False)
        self.planner = (
            pool.planner if pool is not None else None
        )  # sizes drafts from measured costs; None: profile "off"
        if self.planner is not None:
            self.planner.budget.begin()  # probes may lose a share of this call's plain time (exploration.py)
        self.isolate_faults = isolate_faults
        self.faults = faults if faults is not None else Faults(isolate_faults)
        self.defer_idle_catch_up = defer_idle_catch_up
        self.usable = [True] * len(self.drafters)  # False: dropped after a failure (generate's contract)
        # per drafter: model-free, its drafts followed past their steps for the planner (continuations.py)
        self._free = [self.planner is not None and d.num_parameters == 0 for d in self.drafters]
        self.drafter_stats = {name: DrafterStats() for name in self.names}
        self.stats = GenerationStats(rows=[], drafters=self.drafter_stats)  # engine totals; rows stay on each Row
        self.rows: list[Row] = []  # [B] the active batch, in cache order
        self.pending: list[Row] = []  # added, joining at the next step
        self.cache: RowCache | None = None  # the target's KV of the active rows (RectangularCache or PackedCache)
        self.steps = 0  # verification steps so far
        self.drafters_started = False  # the drafters' per-call state exists (started at the first admission)
        self._row_ids = row_ids if row_ids is not None else pool.row_ids if pool is not None else itertools.count()
        self._admitted_last = False  # the last step was an admission
        self._first_runs = FIRST_RUNS.count  # graphs set up before the step under way (`StepFeedback.cold`)
        self._batch: GenerateBatch | None = None
        self._deferred_catch_up: dict[int, list[int]] = {}  # drafter -> row ids to catch up (defer_idle_catch_up)

    # -- rows in, rows out ---------------------------------------------------------------------------
    def add(self, request: Request) -> Row:
        """Queue a request; it joins the batch (prefill and first token) at the next step."""
        seq2seq = bool(getattr(self.model.config, "is_encoder_decoder", False))
        if seq2seq != (request.encoder is not None):
            raise ValueError(
                f"the target {self.model.config.model_type!r} is "
                + (
                    "an encoder-decoder model: a Request needs its encoder side (Request.encoder)"
                    if seq2seq
                    else "a causal LM: a Request takes no encoder side (Request.encoder=None)"
                )
            )
        row = Row(next(self._row_ids), request)
        self.pending.append(row)
        return row

    def add_batch(
        self,
        input_ids,
        attention_mask,
        processors,
        stopping_criteria,
        max_length: int,
        do_sample: bool,
        model_kwargs: dict,
        encoder: EncoderRows | None = None,
    ) -> list[Row]:
        """A `generate` batch: left-padded rows sharing processors and criteria, prefilled exactly as
        `generate` prefills them, with the whole-batch processor fast path while they run together.
        encoder: an encoder-decoder target's encoder side of the batch (`input_ids` are then the decoder
        prompts); each row keeps its own."""
        rows = []
        host_stop = HostStop.of(stopping_criteria) or False  # read once for the batch (engine._stops)
        for i, (ids, keep) in enumerate(zip(input_ids.cpu(), attention_mask.cpu().bool())):
            request = Request(
                prompt=ids[keep].tolist(),
                max_length=max_length,
                processors=row_processors(processors, i),
                stopping_criteria=stopping_criteria,
                do_sample=do_sample,
                padding=ids[~keep].tolist(),
                encoder=encoder.take(torch.tensor([i])) if encoder is not None else None,
            )
            rows.append(self.add(request))
            rows[-1].host_stop = host_stop
        self._batch = GenerateBatch(processors, input_ids, model_kwargs, rows)
        return rows

    def cancel(self, row: Row) -> None:
        """The row leaves at the next step (thread-safe: only sets a flag)."""
        row.cancel_requested = True

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or any(not r.done for r in self.rows)

    @torch.no_grad()
    def step(self) -> None:
        """Retire rows that are done; then admit the rows that arrived (their first token comes at once),
        or run one speculative step. Never two admissions in a row while rows run: under a steady stream
        of arrivals the running rows still advance every other step."""
        with host_syncs.phase("retire"):  # phases: what host_syncs.count_syncs counts syncs under
            self.retire()
        if self.pending and not (self._admitted_last and self.rows):
            self._drop_ahead()  # joining rows' slots have no forward ahead
            with host_syncs.phase("admit"):
                self.admit()
            self._admitted_last = True
        elif self.rows:
            with host_syncs.phase("step"):
                start, B = perf_counter(), len(self.rows)
                self._first_runs = FIRST_RUNS.count
                proposal = self.propose()
                verified = self.verify(proposal)
                cold = FIRST_RUNS.count != self._first_runs
                if self.planner is not None and verified is not None and not cold:  # what it cost beyond its forwards
                    verify_seconds, kind = verified
                    host = perf_counter() - start - verify_seconds - sum(proposal.draft_seconds)
                    self.planner.observe_host(B, kind, host)
            self._admitted_last = False

    def close(self) -> None:
        """Retire every row and free the drafters' per-call state."""
        for row in self.rows:
            if not row.done:
                row.finish_reason = CANCELLED
        self.retire()
        self._ahead = None
        for d in self.drafters:
            d.finish()

    # -- 1. Admit: prefill the rows that arrived, pick their first token -------------------------------
    @torch.no_grad()
    def admit(self) -> None:
        arrived, self.pending = self.pending, []
        for row in arrived:
            if row.cancel_requested:
                row.finish_reason = CANCELLED
        joining = [row for row in arrived if not row.done]
        if not joining:
            return
        start = perf_counter()
        batch = self._batch if self._batch is not None and [r.id for r in joining] == self._batch.order else None
        groups = None  # rows prefilled together: all at once, unless the profile prices groups cheaper
        packed = self.cache_layout == "packed"
        if self.planner is not None and len(joining) > 1 and admission.can_group(joining, batch, packed):
            groups = prefill_groups(self.planner.profile.target, [len(r.sequence) for r in joining])
        try:
            self.cache, logits = admission.prefill(  # logits: [n, V]
                self.model,
                self.cache,
                len(self.rows),
                joining,
                batch,
                packed,
                self._new_static_cache if self.static is not None else None,
                groups,
                self.planner if self.static is None else None,  # static: an eager prefill, compiled steps
            )
        except Exception as err:  # noqa: BLE001
            self.faults.prefill_failed(joining, err)
            if len(joining) > 1:  # one at a time: the rows whose prefill fails alone fail
                for row in joining:
                    self.pending = [row]
                    self.admit()
            return
        scores = first_scores(joining, logits, batch, self.faults.row)  # [n, V]
        first = admission.first_tokens(joining, scores, self.faults.row)  # [n]
        self.stats.prefill_seconds += perf_counter() - start
        old = len(self.rows)
        self.rows += joining
        for i, row in enumerate(joining):
            if not row.done:
                self.faults.row(row, lambda: self._commit(row, [first[i]], scores[i : i + 1]))
            row.stats.add(
                drafted=0, accepted=0, new_tokens=1
            )  # the prefill forward produced one token: plain decoding scores 1.0
        sequences = [r.sequence for r in joining]
        new_positions = list(range(old, old + len(joining)))
        for d_idx, drafter in enumerate(self.drafters):
            if not self.usable[d_idx]:
                continue
            if self.drafters_started:
                self._call_drafter(d_idx, lambda: drafter.add_rows(sequences), new_positions)
            else:
                # the target's cache right after its prefill: a self-speculating drafter copies its exact KV, a
                # model drafter on the static layout sizes its own after it
                self._call_drafter(
                    d_idx, lambda: drafter.start(self.model, sequences, target_cache=self.cache), new_positions
                )
        self.drafters_started = True
        if self.policy is not None:
            self.policy.start_rows(self._view(), new_positions)

    # -- 2. Retire rows that are done ------------------------------------------------------------------
    def retire(self) -> None:
        for row in self.rows:
            if row.cancel_requested and not row.done:
                row.finish_reason = CANCELLED
        gone = [r for r in self.rows if r.done]
        if not gone:
            return
        now = perf_counter()
        for row in gone:
            row.stats.wall_seconds = now - row.added_at
        if self.policy is not None:
            self.policy.end_rows([r.id for r in gone])
        if self.planner is not None:  # how long rows run here, for the planner's catch-up spreading
            lengths = [len(r.generated) if r.finish_reason in (LENGTH, STOPPED) else None for r in gone]
            self.planner.end_rows([r.id for r in gone], lengths)
        ended = [b for b, r in enumerate(self.rows) if r.done and r.finish_reason != ERROR]
        if ended and self.drafters_started:
            outputs = [self.rows[b].generated for b in ended]
            for d_idx, d in enumerate(self.drafters):
                if self.usable[d_idx]:
                    self._call_drafter(d_idx, lambda: d.end_rows(ended, outputs), [])
        kept = [b for b, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[b] for b in kept]
        if not kept:  # an empty batch starts afresh: caches dropped, drafters restarted by the next admission
            if self.static is not None and self.static.compiled and isinstance(self.cache, StaticRowCache):
                give_back(self.model, self.cache)  # its storage, and the graphs captured over it, for the next call
            self.cache, self._ahead = None, None
            for d in self.drafters:
                d.finish()
            self.drafters_started = False
            return
        index = torch.tensor(kept)  # on the host: each cache sends its device a copy
        self.cache.select_rows(index)
        if self._ahead is not None:
            self._ahead = self._ahead[to_device(kept, self._ahead.device, torch.long)]
        for d_idx, d in enumerate(self.drafters):
            if self.usable[d_idx]:
                self._call_drafter(d_idx, lambda: d.select_rows(index), [])

    # -- 3-4. Plan and draft ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self) -> Proposal:
        """Plan which drafters and how many tokens per row, and draft. Touches drafters only."""
        B, rows = len(self.rows), self.rows
        draft_seconds, idle, lagging = [0.0] * len(self.drafters), 0.0, []
        if self._deferred_catch_up:
            by_id = {r.id: b for b, r in enumerate(rows)}
            deferred = {d: [by_id[i] for i in ids if i in by_id] for d, ids in self._deferred_catch_up.items()}
            self._deferred_catch_up = {}
            idle = self._catch_up_idle(deferred, draft_seconds)
        # 3. Plan: the policy picks drafters and caps k; `plan_k` sizes k within the cap and each row's room.
        plan = self.policy.plan(self._view()) if self.policy is not None else None
        if plan is None:
            chosen, ks = [()] * B, [0] * B
        else:
            chosen = [
                tuple(d for d in plan.drafters[b] if self.usable[d] and d not in rows[b].banned) for b in range(B)
            ]

            def lags() -> list[dict[int, int]]:  # [B] drafter -> committed tokens its state lacks (read by the planner)
                lagging[:] = [
                    {d: len(r.sequence) - n for d in chosen[b] if (n := self.drafters[d].synced(b)) is not None}
                    for b, r in enumerate(rows)
                ]
                return lagging

            def unencoded() -> list[set[int]]:  # [B] chosen drafters whose own encoder has yet to read the row
                return [{d for d in chosen[b] if self.drafters[d].unencoded(b)} for b in range(B)]

            rooms, row_ids = [r.draft_room for r in rows], [r.id for r in rows]
            closed = self._batch is not None and not self.pending  # a `generate` call's batch: no row joins it
            ks = plan_k(plan.k, rooms, chosen, self.planner, row_ids, lags, self._padded, unencoded, closed)
        # 4. Draft: a preempting drafter first (4a), then each drafter over the rows it serves (4b), shadow
        #    drafts for measurement (4c); rows with several drafters take their vote tree: whole where trees are usable
        #    (tree_step.usable), else its heaviest path.
        use_trees = tree_step.usable(self.tree, self.tree_capability, self.cache)
        drafting = Drafting(self._drafter_scope(), self.faults, self.usable, plan, draft_seconds, use_trees)
        proposals: list[dict[int, list[int]]] = [{} for _ in range(B)]  # [B] drafter -> its draft
        q_of: list[dict[int, torch.Tensor | None]] = [{} for _ in range(B)]  # [B] drafter -> its q
        firsts = drafting.preempt(chosen, ks, proposals, q_of)
        drafting.serve(chosen, ks, proposals, q_of)
        shadows = drafting.shadows(chosen, firsts)
        drafts, qs, trees = drafting.merge(proposals, q_of, ks, use_trees, None if self.tree == "auto" else self.tree)
        match_lengths = drafting.match_lengths
        self._apply(drafting.calls)
        if self.planner is not None:  # verify what pays of each draft, a tree node by node (drafting is paid for)
            keep, values = self.planner.trim([r.id for r in rows], drafts, chosen, match_lengths, self._padded, trees)
            trees = [t.pruned(k, by=v) if t is not None else None for t, k, v in zip(trees, keep, values)]
            drafts = [d[:k] if t is None else list(t.tokens) for d, t, k in zip(drafts, trees, keep)]
            qs = [q[:k] if q is not None and k > 0 else None for q, k in zip(qs, keep)]
        return Proposal(
            plan,
            chosen,
            ks,
            drafts,
            qs,
            proposals,
            draft_seconds,
            shadows,
            match_lengths,
            trees if any(t is not None for t in trees) else None,
            [{d: n for d, n in lag.items() if not self.drafters[d].unencoded(b)} for b, lag in enumerate(lagging)],
            idle,
        )

    # -- 5-7. Verify, commit, catch up ----------------------------------------------------------------
    @torch.no_grad()
    def verify(self, proposal: Proposal) -> tuple[float, str] | None:
        """Steps 5-7 of `proposal`; returns the seconds of the target's forward and verdict, and the kind of step it
        was (`CostProfile.host_seconds`: plain, widened or drafting); None: every row failed."""
        rows = self.rows
        if proposal.trees is not None:
            self._drop_ahead()  # a tree's root is fed with its nodes
        # 5. Verify: one target forward over [last committed token] + drafts (a chain, or a vote's tree) for every row;
        #    after a run-ahead, the drafts alone, the last committed token's logits already there (`_ahead`).
        start = perf_counter()
        outcome = self._verify_trees(proposal) if proposal.trees is not None else self._verify_chains(proposal)
        if outcome is None:  # every row failed
            return None
        verify_seconds = perf_counter() - start  # after the verdict's read: the forward and it have run, on any device
        self.stats.verify_seconds += verify_seconds

        # 6. Commit accepted + recovered/bonus tokens, stop rows, roll the target cache back per row.
        matched, shadow_matched, continued = self._commit_step(proposal, outcome)
        if any(proposal.drafts) or outcome.filled or any(r.finish_reason == ERROR for r in rows):
            self._ahead = None  # a forward run ahead goes with the rollback
            self.cache.rollback(
                [len(r.sequence) - 1 for r in rows]
            )  # else each row committed the one token it fed (and one more ran ahead): nothing to drop

        # 7. Fast switching: idle drafters named by the plan catch up on rows they may serve next; the
        #    policy hears what the step did.
        if proposal.plan is not None and proposal.plan.catch_up:
            if self.defer_idle_catch_up:
                self._deferred_catch_up = {d: [rows[b].id for b in bs] for d, bs in proposal.plan.catch_up.items()}
            else:
                proposal.idle_seconds += self._catch_up_idle(proposal.plan.catch_up, proposal.draft_seconds)
        self.stats.steps += 1
        if self.policy is not None:
            executed = Plan(
                list(proposal.chosen),
                proposal.ks,
                proposal.plan.min_confidence,
                proposal.plan.vote_weights,
                proposal.plan.catch_up,
                shadow_lengths(proposal.plan, proposal.shadows),
            )
            feedback = StepFeedback(
                row_ids=[r.id for r in rows],
                plan=executed,
                drafted=[len(d) for d in proposal.drafts],
                accepted=outcome.accepted,
                proposed=[{d: len(t) for d, t in prop.items()} for prop in proposal.proposals],
                matched=matched,
                shadow_proposed=[{d: len(t) for d, t in sh.items()} for sh in proposal.shadows],
                shadow_matched=shadow_matched,
                continued=continued,
                match_lengths=proposal.match_lengths,
                draft_seconds=proposal.draft_seconds,
                verify_seconds=verify_seconds,
                padded=self._padded,
                positions=outcome.positions,
                filler_rows=outcome.filler_rows,
                alternatives=outcome.alternatives,
                lags=proposal.lags,
                idle_seconds=proposal.idle_seconds,
                cold=FIRST_RUNS.count != self._first_runs,
            )
            self.policy.update(feedback)
            if self.planner is not None:
                self.planner.update(feedback)
        self.steps += 1
        return verify_seconds, DRAFTING if any(proposal.drafts) else WIDENED if outcome.filled else PLAIN

    def _verify_trees(self, proposal: Proposal) -> StepOutcome | None:
        """Step 5 over token trees (a row without one verifies its chain as a one-branch tree): tree_step.py."""
        rows = self.rows
        trees = [t if t is not None else TokenTree.chain(d) for t, d in zip(proposal.trees, proposal.drafts)]
        target = tree_step.TargetStep(rows, self.model, self.cache, self.faults, self._running_batch(), self.static)
        verified = tree_step.verify(target, trees)
        if verified is None:
            return None
        paths, next_tokens, tree_scores = verified
        return StepOutcome(
            accepted=[len(p) for p in paths],
            next_tokens=next_tokens,
            kept=[[t.tokens[n] for n in p] for t, p in zip(trees, paths)],
            row_scores=tree_step.path_scores(tree_scores, paths),
            positions=None,  # as `verified_tokens` counts them
            alternatives=[t.beside_the_heaviest(p) for t, p in zip(trees, paths)],  # a chain's: None
        )

    def _verify_chains(self, proposal: Proposal) -> StepOutcome | None:
        """Step 5 over chains: one forward over each row's last committed token and its draft (widened where the
        profile prices a wider forward cheaper; after a run-ahead, the drafts alone), the verdict read once."""
        rows = self.rows
        plain = not any(proposal.drafts)
        ahead, self._ahead = self._ahead, None
        filled = False  # the forward ran over filler tokens too (a cheaper width)
        fillers, forward = 0, self._forward_target
        if ahead is None:
            chunks = [[r.sequence[-1]] + proposal.drafts[b] for b, r in enumerate(rows)]
            fed, positions = self._widened(chunks)
            filled = fed is not chunks
            fillers = self._filler_rows() if plain and not filled else 0
            if fillers:
                positions += fillers
                forward = lambda fed: self._forward_filled(fed, fillers)  # noqa: E731
        else:
            chunks = fed = proposal.drafts  # the last committed token is in the cache
            positions = len(rows) * (1 + max(map(len, chunks)))
        # [B, K + 1, V] (fillers' slots cut off), or None when every row failed
        if plain and ahead is not None:
            target_logits = ahead
        else:
            target_logits = self.faults.target_forward(self.cache, rows, forward, fed)
            if target_logits is None:
                return None
            target_logits = target_logits[:, : max(len(c) for c in chunks)]
            if ahead is not None:
                target_logits = torch.cat([ahead, target_logits], dim=1)
        batch = self._running_batch()
        scores = target_scores(rows, batch, target_logits, proposal.drafts, self.faults.row)  # [B, K + 1, V]
        sampling = [RowSampling(r.request.do_sample, r.request.seed, len(r.generated)) for r in rows]
        verdict = self.faults.verdict(
            rows, lambda idx: verify_rows(idx, sampling, scores, proposal.drafts, proposal.qs), scores.device
        )
        read = host_syncs.read_later(torch.stack([verdict.accepted, verdict.next_token]))
        if plain and not filled and self._may_run_ahead(rows):  # fillers are dropped by a rollback
            self._ahead = self._launch_ahead(verdict.next_token)
        accepted, next_tokens = read()  # the step's one read of the device
        return StepOutcome(
            accepted=accepted,
            next_tokens=next_tokens,
            kept=[d[:a] for d, a in zip(proposal.drafts, accepted)],
            row_scores=list(scores),
            positions=positions,
            alternatives=[],
            filled=filled,
            filler_rows=fillers,
        )

    def _commit_step(self, proposal: Proposal, outcome: StepOutcome) -> tuple[list[dict], list[dict], list[dict]]:
        """Step 6 for every row: commit its accepted draft tokens and the target's next token, and count what each
        drafter's proposal (and shadow draft) got right. Returns (matched, shadow_matched, continued): [B] drafter ->
        tokens of its proposal that were committed, and what the committed tokens revealed of the model-free drafts
        followed past their steps (continuations.py). A row that failed in the step commits nothing (its accepted
        count set 0)."""
        matched: list[dict[int, int]] = []
        shadow_matched: list[dict[int, int]] = []
        continued: list[dict[int, Observed]] = []
        served: set[int] = set()  # drafters some of whose draft tokens were verified
        accepted = outcome.accepted
        for b, row in enumerate(self.rows):
            if row.done:  # failed in this step's forward, scoring or sampling
                accepted[b] = 0
                matched.append({})
                shadow_matched.append({})
                continued.append({})
                continue
            new = outcome.kept[b] + [outcome.next_tokens[b]]
            origin = len(row.sequence)
            self.faults.row(row, lambda: self._commit(row, new, outcome.row_scores[b]))
            matched.append({d: common_prefix_length(tokens, new) for d, tokens in proposal.proposals[b].items()})
            shadow_matched.append({d: common_prefix_length(tokens, new) for d, tokens in proposal.shadows[b].items()})
            continued.append(follow(row.sequence, row.continuations))
            for drafts in (proposal.proposals[b], proposal.shadows[b]):
                start(row.continuations, drafts, origin, new, self._free, proposal.match_lengths[b])
            row.stats.add(len(proposal.drafts[b]), accepted[b], len(new))
            single = len(proposal.proposals[b]) == 1
            verified = len(proposal.drafts[b])  # what `trim` kept: a chain's prefix, or a tree's nodes
            for d_idx, tokens in proposal.proposals[b].items():  # a voter is credited with what its own draft got right
                row.stats.drafters[self.names[d_idx]] += 1
                stats = self.drafter_stats[self.names[d_idx]]
                stats.proposed += len(tokens)
                drafted = verified if single else min(len(tokens), verified)
                if drafted:  # a draft cut whole was never verified: no draft tokens, no step of the drafter's
                    stats.add(drafted, accepted[b] if single else min(matched[b][d_idx], drafted), len(new))
                    served.add(d_idx)
        for d_idx in served:
            self.drafter_stats[self.names[d_idx]].steps += 1
        return matched, shadow_matched, continued

    def _new_static_cache(self, rows: int) -> StaticRowCache:
        """A new batch's StaticRowCache: where the forwards compile, the one the last call gave back (`take_cache`)."""
        return take_cache(self.model, rows) if self.static.compiled else StaticRowCache(self.model.device)

    # -- run-ahead: a plain step's next forward launched before its tokens are read ------------------------
    def _may_run_ahead(self, rows: list[Row]) -> bool:
        """Whether this plain step may feed its tokens, unread, to the next forward: on the static layout where
        the options say so, every row alive with room for a token after this step's (so no forward runs past a
        row's length limit, nor past the cache's capacity)."""
        return self.run_ahead and all(not r.done and r.draft_room >= 1 for r in rows)

    def _launch_ahead(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The one-token forward of every row over `tokens` ([B] on the device, this step's verdict), queued
        behind the verdict's read: logits [B, 1, V] float32, or None where the (guarded) forward failed."""
        forward = self.static.forward

        def run(chunks: list[list[int]]) -> torch.Tensor:  # placeholders: the tokens are not on the host yet
            fed = [bool(c) for c in chunks]  # all, unless isolating faults retries part of the rows
            part = tokens if all(fed) else tokens[to_device([b for b, f in enumerate(fed) if f], tokens.device)]
            return forward_static_tokens(self.model, self.cache, part, fed, forward).to(dtype=torch.float32)

        return self.faults.target_forward(self.cache, self.rows, run, [[0]] * len(self.rows))

    def _drop_ahead(self) -> None:
        """Undo a forward run ahead: each row's cache back to its committed tokens but the last."""
        if self._ahead is not None:
            self._ahead = None
            self.cache.rollback([len(r.sequence) - 1 for r in self.rows])

    @property
    def _padded(self) -> bool:
        """The target's verify forward pads every row to the longest draft (rectangular cache)."""
        return not isinstance(self.cache, PackedCache)

    def _widened(self, chunks: list[list[int]]) -> tuple[list[list[int]], int]:
        """(the chunks to feed, the positions the forward runs over): where the target's cost profile verifies
        cheaper at a wider knot (`ForwardCost.width`), the chunks filled out to it with filler tokens (step/widths.py;
        the rollback drops them); else as given. A plain step too, where the whole step is cheaper so, its rollback
        included (`CostProfile.plain_width`): on an AVX-512 bf16 CPU one position runs a GEMV slower than a
        two-position GEMM (AMD EPYC, bf16, 1.5B: 192 / 172 ms)."""
        packed = isinstance(self.cache, PackedCache)
        B, positions = len(chunks), sum(len(c) for c in chunks) if packed else len(chunks) * max(map(len, chunks))
        if self.planner is None:
            return chunks, positions
        profile = self.planner.profile
        wide = profile.plain_width(B) if positions == B else profile.target.width(positions, B)
        if wide == positions:  # ragged rows keep their holes
            return chunks, positions
        widened = widen(chunks, wide, [r.draft_room + 1 for r in self.rows], packed)
        return (chunks, positions) if widened is None else (widened, wide)

    def _filler_rows(self) -> int:
        """Rows of filler tokens to run a plain step's forward beside the batch's, where a plain step of that many
        rows ran cheaper (`CostProfile.plain_rows`): in float32 on an AMD EPYC a linear layer over 3 positions costs
        1.5x one over 4 (a GEMV a row against a GEMM), so after a row of four ended, three rows' steps ran 1.2 s
        against four rows' 0.85 s and the default pool 0.86x plain `generate`, which keeps every row. On the
        rectangular cache of a causal LM only (docs/planning.md, "Filler rows")."""
        cache = self.cache
        if self.planner is None or type(cache) is not RectangularCache or cache.encoder is not None:
            return 0
        return self.planner.profile.plain_rows(len(self.rows)) - len(self.rows)

    def _forward_filled(self, chunks: list[list[int]], fillers: int) -> torch.Tensor:
        """`_forward_target` with `fillers` rows beside the chunks': rows that hold no token, each fed a filler
        token that attends to itself alone; their KV is dropped after, their logits cut off: `[B, T, V]`."""
        B = len(chunks)
        self.cache.add_empty_rows(fillers)
        try:
            logits = self._forward_target(chunks + [[FILLER_TOKEN]] * fillers)
        finally:
            self.cache.select_rows(list(range(B)))
        return logits[:B]

    def _forward_target(self, chunks: list[list[int]]) -> torch.Tensor:
        """Logits [B, T, V] float32 of the target over one chunk per row, appended to its cache."""
        if self.static is not None:
            return self.static(self.model, self.cache, chunks).to(dtype=torch.float32)
        return forward_ragged(self.model, self.cache, chunks).to(dtype=torch.float32)

    def _commit(self, row: Row, tokens: list[int], scores: torch.Tensor) -> None:
        """Append tokens to the row one at a time until it stops (cutting `tokens` there)."""
        request = row.request
        for j, token in enumerate(tokens):
            row.sequence.append(token)
            row.generated.append(token)
            if request.logprobs:
                row.logprobs.append(float(torch.log_softmax(scores[j].float(), dim=-1)[token]))
            if self._stops(row, token, scores[j : j + 1]):
                row.finish_reason = STOPPED
            elif len(request.padding) + len(row.sequence) >= request.max_length:
                row.finish_reason = LENGTH
            else:
                continue
            del tokens[j + 1 :]
            return

    @staticmethod
    def _stops(row: Row, token: int, scores: torch.Tensor) -> bool:
        """Whether the row's stopping criteria stop it at `token`, its last committed token (scores [1, V]).
        Lists of max-length and EOS criteria alone are decided on the host (`stopping.HostStop`); any
        other criterion is called as `generate` calls it, on the row's [1, L] ids."""
        criteria = row.request.stopping_criteria
        if row.host_stop is None:
            row.host_stop = HostStop.of(criteria) or False
        stops = row.host_stop.stops(len(row.request.padding) + len(row.sequence), token) if row.host_stop else None
        return stops if stops is not None else bool(criteria(row.as_tensor(), scores).any())

    def _catch_up_idle(self, catch_up: dict[int, list[int]], draft_seconds: list[float]) -> float:
        """Drafter -> batch rows (indices) it catches up on; its time added to `draft_seconds`. Returns the seconds."""
        rows, spent = self.rows, 0.0
        sequences = [r.sequence for r in rows]
        for d_idx, wanted in catch_up.items():
            bs = [b for b in wanted if d_idx not in rows[b].banned]
            drafter = self.drafters[d_idx]
            lags = {b: len(rows[b].sequence) - (drafter.synced(b) or 0) for b in bs}  # b -> tokens it lacks
            padded = len(rows) if isinstance(getattr(drafter, "cache", None), RectangularCache) else 1
            if self.planner is not None and bs:  # only where the evidence says the catch-up pays for itself
                worth = self.planner.worth_catching_up(
                    [rows[b].id for b in bs],
                    d_idx,
                    [lags[b] for b in bs],
                    [rows[b].draft_room for b in bs],
                    [drafter.unencoded(b) for b in bs],
                    padded,
                )
                bs = [b for b, w in zip(bs, worth) if w]
            if self.usable[d_idx] and bs:
                fresh = any(drafter.unencoded(b) for b in bs)  # its own encoder runs too: not a forward's cost
                call = self._call_drafter(d_idx, lambda: drafter.catch_up(bs, sequences), bs)
                if call.ok:
                    draft_seconds[d_idx] += call.seconds
                    spent += call.seconds
                    if self.planner is not None and not fresh:
                        positions = padded * max(lags[b] for b in bs) if padded > 1 else sum(lags[b] for b in bs)
                        self.planner.observe_catch_up(d_idx, positions, call.seconds)
        return spent

    # -- drafter calls: guarded by the fault policy, what they did applied here ---------------------------
    def _drafter_scope(self) -> DrafterScope:
        return DrafterScope(self.drafters, self.names, self.rows, self.model, self.drafters_started)

    def _call_drafter(self, d_idx: int, fn, served: list[int]) -> DrafterCall:
        """fn(), a call of drafter d_idx over the batch rows `served`, guarded (`Faults.drafter`) and applied."""
        call = self.faults.drafter(self._drafter_scope(), d_idx, fn, served)
        self._apply([(d_idx, call)])
        return call

    def _apply(self, calls: list[tuple[int, DrafterCall]]) -> None:
        """What drafter calls did: their time or failure in the drafter's stats; a dropped drafter is
        unusable for the rest of the call."""
        for d_idx, call in calls:
            stats = self.drafter_stats[self.names[d_idx]]
            if call.ok:
                stats.draft_seconds += call.seconds
            else:
                stats.failures += 1
            if call.dropped:
                self.usable[d_idx] = False

    # -- what the policy sees --------------------------------------------------------------------------
    def _view(self) -> BatchView:
        return BatchView(
            row_ids=[r.id for r in self.rows],
            prompt_lengths=[r.prompt_length for r in self.rows],
            generated=[len(r.generated) for r in self.rows],
            usable=list(self.usable),
            step=self.steps,
            room=[r.draft_room + 1 for r in self.rows],  # tokens left: the drafts plus the one the target adds
        )

    def _running_batch(self) -> GenerateBatch | None:
        """The `generate` batch, when every active row belongs to it (the whole-batch fast path)."""
        batch = self._batch
        if batch is not None and all(r.id in batch.members for r in self.rows):
            return batch
        return None
