"""The engine: batched, lossless speculative decoding over rows that join and leave between steps.

    engine = SpinEngine(model, pool)                          # pool=None: plain decoding, still batched
    row = engine.add(Request(prompt_ids, max_new_tokens=64))   # joins at the next step
    while engine.has_work:
        engine.step()
    row.generated, row.finish_reason, row.stats

A step either admits the rows that arrived since the last one (continuous batching: a ragged prefill
of the new rows alone, appended to the running batch's caches, their first token) or runs one
speculative step of every active row:

    policy --plan--> drafters --drafts (+ q)--> target forward on ragged rows --> verify
       ^                                                                          |
       +------ stats <-- commit tokens, stop rows, roll back the target cache ----+

Rows that stopped, were cancelled or failed leave the batch at the start of the next step. Each row
has its own parameters (`rows.Request`): processors, stopping criteria, length limit, greedy or
sampled, its own seed. A whole `generate` batch added with `add_batch` keeps the fast path of one
processor call over the whole batch. `propose` (steps 3-4) and `verify` (steps 5-7) are separate so
that a pipeline (pipeline.py) can draft one micro-batch while it verifies another.

Faults: `generate` keeps its contract (a drafter that raises is dropped for the call, anything else
raises). With `isolate_faults=True` (a server) a fault costs only the rows it touched: a drafter that
raises is rebuilt and retried on halves of the rows it was serving until the row at fault is alone,
which goes on without it (plain decoding or its other drafters); a target forward that raises is
retried on halves of the batch until the row(s) at fault are found, which fail alone; a processor,
sampling or stopping criterion that raises fails its row.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import warnings
from dataclasses import dataclass
from time import perf_counter

import torch
from transformers.generation import logits_process as lp

from .cache import CACHE_ARG, CACHE_NAMES, PackedCache, RaggedCache, forward_ragged, needs_contiguous_slots
from .drafters import Draft, Drafter, DraftRequest
from .drafters.model import common_prefix_length
from .policies import BatchView, Plan, Policy, StepFeedback
from .policies.base import shadow_lengths
from .pool import AssistantPool
from .rows import CANCELLED, LENGTH, STOPPED, Request, Row
from .stats import DrafterStats, GenerationStats
from .verification import Verdict, gumbel_noise, verify_greedy, verify_sampling, verify_seeded
from .vote_tree import heaviest_path

logger = logging.getLogger(__name__)

# Processors that read only the scores, never the token ids: a whole [B, K + 1, V] block goes through
# them at once instead of one call per row and position.
IDS_FREE_PROCESSORS = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
)
# Token id that left-pads the prompts of rows prefilled together; masked, so any valid id works.
JOIN_PAD_TOKEN = 0


def row_processors(processors, request: int):
    """The processors as they apply to one original row of a batch, called on a [1, L] view of it.

    `RepetitionPenaltyLogitsProcessor` holds one padding length per row of the batch (`transformers`
    >= 5 ignores left padding that way); the row's own copy holds that row's length as an int.
    """
    out = []
    for proc in processors:
        ignore = getattr(proc, "prompt_ignore_length", None)
        if isinstance(proc, lp.RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
            proc = copy.copy(proc)
            proc.prompt_ignore_length = int(ignore[request])
        out.append(proc)
    return lp.LogitsProcessorList(out)


def ids_free(processors) -> bool:
    return len(processors) > 0 and all(isinstance(p, IDS_FREE_PROCESSORS) for p in processors)


class _Batch:
    """Rows given together as one `generate` batch: one processor list, one padded prompt tensor."""

    def __init__(self, processors, input_ids: torch.Tensor, model_kwargs: dict, rows: list[Row]):
        self.processors = processors
        self.ids_free = ids_free(processors)
        self.input_ids = input_ids  # [B, P] as given, left padding included
        self.model_kwargs = model_kwargs  # what `generate` prepared (attention_mask, position_ids, ...)
        self.order = [r.id for r in rows]
        self.members = set(self.order)


@dataclass
class Proposal:
    """Steps 3-4 of a step (plan and drafts), handed to `verify`. Batch order as `engine.rows` then."""

    plan: Plan | None  # None without a pool
    chosen: list[tuple[int, ...]]  # [B] drafters that drafted for each row (usable, not banned)
    ks: list[int]  # [B] draft length per row, capped by the room before its length limit
    drafts: list[list[int]]  # [B] the candidates verified per row (a vote's heaviest path when voting)
    qs: list[torch.Tensor | None]  # [B] q [k_b, V] of a single model drafter when sampling, else None (one-hot)
    proposals: list[dict[int, list[int]]]  # [B] drafter -> its own draft
    draft_seconds: list[float]  # [num_drafters] wall time per drafter in this step (shadow drafts included)
    shadows: list[dict[int, list[int]]]  # [B] drafter -> its shadow draft (Plan.shadow): compared, never verified
    match_lengths: list[dict[int, int]]  # [B] drafter -> the match its draft (served or shadow) continued, where it reports one


def note_matches(draft: Draft, served: list[int], d_idx: int, match_lengths: list[dict[int, int]]) -> None:
    """Record in `match_lengths` ([B] drafter -> length) the match each of `served`'s drafts continued,
    where the drafter reports one (`Draft.match_lengths`)."""
    for b, match in zip(served, draft.match_lengths or []):
        if match is not None:
            match_lengths[b][d_idx] = match


def _prefill_kwargs(model, attention_mask: torch.Tensor) -> dict:
    """The model inputs `generate` prepares for a prefill of left-padded rows (mask, positions, logits_to_keep)."""
    kwargs = {"attention_mask": attention_mask, "use_cache": True}
    if "position_ids" in inspect.signature(model.forward).parameters:
        position_ids = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = position_ids.masked_fill(attention_mask == 0, 0)
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = 1
    return kwargs


class SpinEngine:
    """Speculative decoding over a batch that rows join and leave between steps.

    model: the target causal LM.
    pool: an `AssistantPool` (drafters + policy), or None for plain batched decoding.
    tokenizer: the target's tokenizer, for drafters with another tokenizer (else the pool's).
    isolate_faults: a fault fails only the rows it touched (see the module docstring); False keeps
        `generate`'s contract.
    drafters, policy: this engine's own drafter objects and policy instead of the pool's (the lanes
        of a pipeline each draft with their own copies, sharing the models).
    row_ids: where row ids come from (default: the pool's counter, so ids stay unique across calls and
        the policy can tell a new request from one it has seen).
    defer_idle_prefill: run step 7 (idle drafters catching up) at the start of the next `propose`
        instead of at the end of `verify`, so that in a pipeline only the drafting thread runs drafters.
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
        defer_idle_prefill: bool = False,
    ):
        self.model = model
        self.pool = pool
        if pool is not None:
            bound = pool.bind(model, tokenizer)
            self.drafters: list[Drafter] = list(drafters) if drafters is not None else bound
            self.policy: Policy | None = policy or pool.policy
            self.names: list[str] = pool.names  # unique per drafter
        else:
            self.drafters, self.policy, self.names = [], None, []
        self.ragged_attention = bool(pool is not None and pool.ragged_attention)
        self.isolate_faults = isolate_faults
        self.defer_idle_prefill = defer_idle_prefill
        self.usable = [True] * len(self.drafters)  # False: dropped after a failure (generate's contract)
        self.drafter_stats = {name: DrafterStats() for name in self.names}
        self.stats = GenerationStats(rows=[], drafters=self.drafter_stats)  # engine totals; rows stay on each Row
        self.rows: list[Row] = []  # [B] the active batch, in cache order
        self.pending: list[Row] = []  # added, joining at the next step
        self.cache: RaggedCache | PackedCache | None = None
        self.steps = 0  # verification steps so far
        self._row_ids = row_ids if row_ids is not None else pool.row_ids if pool is not None else itertools.count()
        self._drafters_started = False
        self._admitted_last = False  # the last step was an admission
        self._batch: _Batch | None = None
        self._deferred_prefill: dict[int, list[int]] = {}  # drafter -> row ids to catch up (defer_idle_prefill)

    # -- rows in, rows out ---------------------------------------------------------------------------
    def add(self, request: Request) -> Row:
        """Queue a request; it joins the batch (prefill and first token) at the next step."""
        row = Row(next(self._row_ids), request)
        self.pending.append(row)
        return row

    def add_batch(self, input_ids, attention_mask, processors, stopping_criteria, max_length: int, do_sample: bool, model_kwargs: dict) -> list[Row]:
        """A `generate` batch: left-padded rows sharing processors and criteria, prefilled exactly as
        `generate` prefills them, with the whole-batch processor fast path while they run together."""
        rows = []
        for i, (ids, keep) in enumerate(zip(input_ids.cpu(), attention_mask.cpu().bool())):
            request = Request(
                prompt=ids[keep].tolist(),
                max_length=max_length,
                processors=row_processors(processors, i),
                stopping_criteria=stopping_criteria,
                do_sample=do_sample,
                padding=ids[~keep].tolist(),
            )
            rows.append(self.add(request))
        self._batch = _Batch(processors, input_ids, model_kwargs, rows)
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
        self.retire()
        if self.pending and not (self._admitted_last and self.rows):
            self.admit()
            self._admitted_last = True
        elif self.rows:
            self.verify(self.propose())
            self._admitted_last = False

    def close(self) -> None:
        """Retire every row and free the drafters' per-call state."""
        for row in self.rows:
            if not row.done:
                row.finish_reason = CANCELLED
        self.retire()
        for d in self.drafters:
            d.finish()

    # -- 1. Admit: prefill the rows that arrived, pick their first token -------------------------------
    @torch.no_grad()
    def admit(self) -> None:
        arrived, self.pending = self.pending, []
        joining = []
        for row in arrived:
            if row.cancel_requested:
                row.finish_reason = CANCELLED
            else:
                joining.append(row)
        if not joining:
            return
        start = perf_counter()
        batch = self._batch if self._batch is not None and [r.id for r in joining] == self._batch.order else None
        try:
            logits = self._prefill(joining, batch)  # [n, V]
        except Exception as err:  # noqa: BLE001 - isolate_faults: find the row at fault
            if not self.isolate_faults:
                raise
            if len(joining) == 1:
                joining[0].fail(err)
                logger.warning("prefill of row %d failed: %r", joining[0].id, err)
                return
            for row in joining:  # one at a time: the rows whose prefill fails alone fail
                self.pending = [row]
                self.admit()
            return
        scores = self._first_scores(joining, logits, batch)  # [n, V]
        first = self._first_tokens(joining, scores)  # [n]
        self.stats.prefill_seconds += perf_counter() - start
        old = len(self.rows)
        self.rows += joining
        for i, row in enumerate(joining):
            if not row.done:
                self._commit_isolated(row, [first[i]], scores[i : i + 1])
            row.stats.add(drafted=0, accepted=0, new_tokens=1)  # the prefill forward produced one token: plain decoding scores 1.0
        sequences = [r.sequence for r in joining]
        new_positions = list(range(old, old + len(joining)))
        for d_idx, drafter in enumerate(self.drafters):
            if not self.usable[d_idx]:
                continue
            if self._drafters_started:
                self._guarded(d_idx, lambda: drafter.add_rows(sequences), None, new_positions)
            else:
                # the target's cache right after its prefill: a self-speculating drafter copies its exact KV
                self._guarded(d_idx, lambda: drafter.start(self.model, sequences, target_cache=self.cache), None, new_positions)
        self._drafters_started = True
        if self.policy is not None:
            self.policy.start_rows(self._view(), new_positions)

    def _prefill(self, rows: list[Row], batch: _Batch | None) -> torch.Tensor:
        """Target forward over the new rows' prompts, appended to the batch's cache. Returns [n, V] float32."""
        model = self.model
        if self.ragged_attention:  # packed rows: a forward over the new rows' tokens only
            old = len(self.rows)
            if self.cache is None:
                self.cache = PackedCache(0, device=model.device)
            self.cache.add_empty_rows(len(rows))
            try:
                chunks = [[] for _ in range(old)] + [r.sequence for r in rows]
                return forward_ragged(model, self.cache, chunks, all_logits=False)[old:, -1].to(dtype=torch.float32)
            except BaseException:
                self.cache.select_rows(list(range(old)))
                raise
        if batch is not None:  # exactly what `generate` prepared
            input_ids, kwargs = batch.input_ids, dict(batch.model_kwargs)
            attention_mask = kwargs.get("attention_mask")
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
        else:  # rows joining: left-pad their prompts into one block
            width = max(len(r.sequence) for r in rows)
            input_ids = torch.full((len(rows), width), JOIN_PAD_TOKEN, dtype=torch.long)  # [n, P]
            attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [n, P]
            for i, r in enumerate(rows):
                input_ids[i, width - len(r.sequence) :] = torch.tensor(r.sequence)
                attention_mask[i, width - len(r.sequence) :] = 1
            input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
            kwargs = _prefill_kwargs(model, attention_mask)
        fresh = RaggedCache(attention_mask.bool(), contiguous=needs_contiguous_slots(model.config))
        for name in CACHE_NAMES:  # generate's empty cache, under either name
            kwargs.pop(name, None)
        kwargs[CACHE_ARG] = fresh
        inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **kwargs)
        logits = model(**inputs, return_dict=True).logits[:, -1].to(dtype=torch.float32)  # [n, V]
        if self.rows and self.cache is not None:
            self.cache.append_rows(fresh)
        else:
            self.cache = fresh
        return logits

    def _first_scores(self, rows: list[Row], logits: torch.Tensor, batch: _Batch | None) -> torch.Tensor:
        """Processed scores [n, V] of the first token of each joining row."""
        if batch is not None:
            return batch.processors(batch.input_ids, logits) if len(batch.processors) else logits
        if not any(len(r.request.processors) for r in rows):
            return logits
        scores = logits.clone()
        for i, row in enumerate(rows):
            if len(row.request.processors):
                self._isolated(row, lambda: scores.__setitem__(i, row.request.processors(row.as_tensor().to(logits.device), logits[i : i + 1])[0]))
        return scores

    def _first_tokens(self, rows: list[Row], scores: torch.Tensor) -> list[int]:
        """Greedy rows take the argmax; sampled rows draw from softmax(scores), seeded rows by Gumbel-max."""
        first = scores.argmax(-1)  # [n]
        shared = [i for i, r in enumerate(rows) if r.request.do_sample and r.request.seed is None and not r.done]
        if shared and len(shared) == len(rows):
            first = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0]
        elif shared:
            idx = torch.tensor(shared, device=scores.device)
            first[idx] = torch.multinomial(torch.softmax(scores[idx], -1), 1)[:, 0]
        for i, row in enumerate(rows):
            if row.request.do_sample and row.request.seed is not None and not row.done:
                def draw(i=i, row=row):
                    noise = gumbel_noise(row.request.seed, 0, 1, scores.shape[-1], scores.device)[0]
                    first[i] = (torch.log_softmax(scores[i], -1) + noise).argmax()
                self._isolated(row, draw)
        return first.tolist()

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
        kept = [b for b, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[b] for b in kept]
        if not kept:  # an empty batch starts afresh: caches dropped, drafters restarted by the next admission
            self.cache = None
            for d in self.drafters:
                d.finish()
            self._drafters_started = False
            return
        index = torch.tensor(kept)
        self.cache.select_rows(index.to(self.cache.device))
        for d_idx, d in enumerate(self.drafters):
            if self.usable[d_idx]:
                self._guarded(d_idx, lambda: d.select_rows(index), None, [])

    # -- 3-4. Plan and draft ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self) -> Proposal:
        """Plan which drafters and how many tokens per row, and draft. Touches drafters only."""
        B, rows = len(self.rows), self.rows
        draft_seconds = [0.0] * len(self.drafters)
        if self._deferred_prefill:
            by_id = {r.id: b for b, r in enumerate(rows)}
            deferred = {d: [by_id[i] for i in ids if i in by_id] for d, ids in self._deferred_prefill.items()}
            self._deferred_prefill = {}
            self._prefill_idle(deferred, draft_seconds)
        # 3. Plan, capped by the room left before each row's length limit.
        plan = self.policy.plan(self._view()) if self.policy is not None else None
        if plan is None:
            chosen, ks = [()] * B, [0] * B
        else:
            chosen = [tuple(d for d in plan.drafters[b] if self.usable[d] and d not in rows[b].banned) for b in range(B)]
            ks = [max(0, min(plan.k[b], rows[b].room)) if chosen[b] else 0 for b in range(B)]
        # 4. Draft, one call per drafter over the rows it serves; rows with several drafters take the
        #    heaviest path of their vote tree. 4a: a preempting drafter drafts first; rows it proposes
        #    enough for verify its draft instead of their planned drafters'.
        proposals: list[dict[int, list[int]]] = [{} for _ in range(B)]
        q_of: list[dict[int, torch.Tensor | None]] = [{} for _ in range(B)]
        sequences = [r.sequence for r in rows]
        score_fn = self._score if any(len(r.request.processors) for r in rows) else None
        firsts: list[dict[int, list[int]]] = [{} for _ in range(B)]  # [B] preempting drafter -> its draft, where too short to serve
        match_lengths: list[dict[int, int]] = [{} for _ in range(B)]
        for d_idx, wanted in (plan.preempt if plan is not None else {}).items():
            eligible = [b for b in sorted(wanted) if b < B and self.usable[d_idx] and d_idx not in rows[b].banned and d_idx not in chosen[b]]
            cap = {b: k for b in eligible if (k := min(wanted[b][0], rows[b].room)) > 0}  # k capped by the room left
            for b, (tokens, q) in self._draft_rows(d_idx, list(cap), cap, sequences, score_fn, plan.min_confidence, draft_seconds, match_lengths).items():
                match = match_lengths[b].get(d_idx)
                if len(tokens) >= wanted[b][1] and (match is None or match >= wanted[b][2]):
                    chosen[b], ks[b] = (d_idx,), cap[b]
                    proposals[b][d_idx], q_of[b][d_idx] = tokens, q
                else:
                    firsts[b][d_idx] = tokens
        for d_idx in range(len(self.drafters)):
            served = [b for b in range(B) if d_idx in chosen[b] and ks[b] > 0 and d_idx not in proposals[b]]
            for b, (tokens, q) in self._draft_rows(d_idx, served, ks, sequences, score_fn, plan.min_confidence if plan else 0.0, draft_seconds, match_lengths).items():
                proposals[b][d_idx], q_of[b][d_idx] = tokens, q
        shadows = self._shadow_drafts(plan, chosen, sequences, score_fn, draft_seconds, firsts, match_lengths)
        drafts: list[list[int]] = [[] for _ in range(B)]
        qs: list[torch.Tensor | None] = [None] * B
        for b in range(B):
            if len(proposals[b]) == 1:
                ((d_idx, drafts[b]),) = proposals[b].items()
                qs[b] = q_of[b][d_idx]
            elif proposals[b]:  # vote: a deterministic merge, verified as a one-hot proposal
                weights = plan.vote_weights or [1.0] * len(self.drafters)
                drafts[b] = heaviest_path(proposals[b], weights)[: ks[b]]
        return Proposal(plan, chosen, ks, drafts, qs, proposals, draft_seconds, shadows, match_lengths)

    def _draft_rows(self, d_idx: int, served: list[int], ks, sequences, score_fn, min_confidence: float, draft_seconds: list[float], match_lengths: list[dict[int, int]]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """One drafter's drafts for the batch rows `served` (ks[b] tokens each): batch row -> (tokens,
        q); the match lengths it reports go into `match_lengths`. A call that raises is retried on
        halves to find the row(s) at fault (`isolate_faults`)."""
        rows, out = self.rows, {}
        todo = [served]
        while todo and todo[-1]:
            served = todo.pop()
            # seeded rows draft greedily: their tokens come from their own noise, whatever the draft
            sample = [rows[b].request.do_sample and rows[b].request.seed is None for b in served]
            request = DraftRequest(
                served,
                sequences,
                [ks[b] for b in served],
                any(sample),
                score_fn,
                min_confidence,
                sample if any(sample) and not all(sample) else None,  # greedy and sampled rows in one call
            )
            got: list[Draft] = []
            if self._guarded(d_idx, lambda: got.append(self.drafters[d_idx].draft(request)), draft_seconds, served, ban=len(served) == 1):
                for b, tokens, q in zip(served, got[0].tokens, got[0].q):
                    out[b] = (list(tokens), q)
                note_matches(got[0], served, d_idx, match_lengths)
            elif self.isolate_faults and self.usable[d_idx] and len(served) > 1:
                todo += [served[: len(served) // 2], served[len(served) // 2 :]]
        return out

    def _shadow_drafts(self, plan: Plan | None, chosen, sequences, score_fn, draft_seconds: list[float], firsts: list[dict[int, list[int]]], match_lengths: list[dict[int, int]]) -> list[dict[int, list[int]]]:
        """4b. Drafts the plan asks of drafters for rows they do not serve (`Plan.shadow`), greedily:
        only compared with the committed tokens after the step, so the policy measures them for free.
        A preempting drafter's draft that did not serve (`firsts`) is its shadow draft. The match
        lengths a drafter reports go into `match_lengths` ([B] drafter -> length)."""
        rows = self.rows
        shadows: list[dict[int, list[int]]] = [dict(f) for f in firsts]
        for d_idx, wanted in (plan.shadow if plan is not None else {}).items():
            if not self.usable[d_idx]:
                continue
            served = [b for b in sorted(wanted) if b < len(rows) and d_idx not in chosen[b] and d_idx not in rows[b].banned and d_idx not in shadows[b] and min(wanted[b], rows[b].room) > 0]
            if not served:
                continue
            request = DraftRequest(served, sequences, [min(wanted[b], rows[b].room) for b in served], False, score_fn, plan.min_confidence)
            out: list[Draft] = []
            if self._guarded(d_idx, lambda: out.append(self.drafters[d_idx].draft(request)), draft_seconds, served, ban=len(served) == 1):
                for b, tokens in zip(served, out[0].tokens):
                    shadows[b][d_idx] = list(tokens)
                note_matches(out[0], served, d_idx, match_lengths)
        return shadows

    # -- 5-7. Verify, commit, roll back --------------------------------------------------------------
    @torch.no_grad()
    def verify(self, p: Proposal) -> None:
        rows, B = self.rows, len(self.rows)
        # 5. Verify: one target forward over [last committed token] + drafts for every row.
        start = perf_counter()
        chunks = [[r.sequence[-1]] + p.drafts[b] for b, r in enumerate(rows)]
        target_logits = self._target_forward(chunks)  # [B, K + 1, V], or None when every row failed
        if target_logits is None:
            return
        K = target_logits.shape[1] - 1
        device = target_logits.device
        draft_lengths = torch.tensor([len(d) for d in p.drafts], device=device)  # [B]
        draft_tokens = torch.tensor([d + [0] * (K - len(d)) for d in p.drafts], device=device).view(B, K)  # [B, K]
        target_scores = self._target_scores(target_logits, p.drafts)  # [B, K + 1, V]
        verdict = self._verdict(target_scores, draft_tokens, draft_lengths, p.qs, p.drafts)
        verify_seconds = perf_counter() - start
        self.stats.verify_seconds += verify_seconds

        # 6. Commit accepted + recovered/bonus tokens, stop rows, roll the target cache back per row.
        accepted = verdict.accepted.tolist()
        next_tokens = verdict.next_token.tolist()
        matched: list[dict[int, int]] = []  # [B] drafter -> tokens of its proposal that were committed
        shadow_matched: list[dict[int, int]] = []  # [B] the same for shadow drafts
        for b, row in enumerate(rows):
            if row.done:  # failed in this step's forward, scoring or sampling
                accepted[b] = 0
                matched.append({})
                shadow_matched.append({})
                continue
            new = p.drafts[b][: accepted[b]] + [next_tokens[b]]
            self._commit_isolated(row, new, target_scores[b])
            matched.append({d: common_prefix_length(tokens, new) for d, tokens in p.proposals[b].items()})
            shadow_matched.append({d: common_prefix_length(tokens, new) for d, tokens in p.shadows[b].items()})
            row.stats.add(len(p.drafts[b]), accepted[b], len(new))
            for d_idx, tokens in p.proposals[b].items():  # a voter is credited with what its own draft got right
                row.stats.drafters[self.names[d_idx]] += 1
                own = accepted[b] if len(p.proposals[b]) == 1 else min(matched[b][d_idx], len(tokens))
                self.drafter_stats[self.names[d_idx]].add(len(tokens), own, len(new))
        for d_idx in sorted({d for prop in p.proposals for d in prop}):
            self.drafter_stats[self.names[d_idx]].steps += 1
        self.cache.rollback(torch.tensor([len(r.sequence) - 1 for r in rows], device=self.cache.device))

        # 7. Fast switching: idle drafters named by the plan catch up on rows they may serve next.
        if p.plan is not None and p.plan.prefill:
            if self.defer_idle_prefill:
                self._deferred_prefill = {d: [rows[b].id for b in bs] for d, bs in p.plan.prefill.items()}
            else:
                self._prefill_idle(p.plan.prefill, p.draft_seconds)
        self.stats.steps += 1
        if self.policy is not None:
            executed = Plan(list(p.chosen), p.ks, p.plan.min_confidence, p.plan.vote_weights, p.plan.prefill, shadow_lengths(p.plan, p.shadows))
            self.policy.update(
                StepFeedback(
                    row_ids=[r.id for r in rows],
                    plan=executed,
                    drafted=[len(d) for d in p.drafts],
                    accepted=accepted,
                    proposed=[{d: len(t) for d, t in prop.items()} for prop in p.proposals],
                    matched=matched,
                    shadow_proposed=[{d: len(t) for d, t in sh.items()} for sh in p.shadows],
                    shadow_matched=shadow_matched,
                    match_lengths=p.match_lengths,
                    draft_seconds=p.draft_seconds,
                    verify_seconds=verify_seconds,
                    padded=not isinstance(self.cache, PackedCache),
                )
            )
        self.steps += 1

    def _target_forward(self, chunks: list[list[int]]) -> torch.Tensor | None:
        state = self.cache.checkpoint()
        try:
            return forward_ragged(self.model, self.cache, chunks).to(dtype=torch.float32)
        except Exception as err:
            self.cache.restore(state)
            if not self.isolate_faults:
                raise
            logger.warning("target forward over %d rows raised %r; retrying on halves of the batch", len(chunks), err)
            return self._forward_halves(chunks)

    def _forward_halves(self, chunks: list[list[int]]) -> torch.Tensor | None:
        """Verification logits [B, T, V] for the rows whose forward succeeds, found by halving the
        rows fed (the others get empty chunks); a row that raises alone fails. None if all fail."""
        width = max(len(c) for c in chunks)
        out = None
        todo = [list(range(len(chunks)))]
        while todo:
            part = todo.pop()
            fed = set(part)
            state = self.cache.checkpoint()
            try:
                logits = forward_ragged(self.model, self.cache, [c if b in fed else [] for b, c in enumerate(chunks)])
            except Exception as err:  # noqa: BLE001
                self.cache.restore(state)
                if len(part) == 1:
                    self.rows[part[0]].fail(err)
                    logger.warning("row %d failed in verification: %r", self.rows[part[0]].id, err)
                else:
                    todo += [part[: len(part) // 2], part[len(part) // 2 :]]
                continue
            if out is None:
                out = logits.new_zeros(len(chunks), width, logits.shape[-1], dtype=torch.float32)
            out[part, : logits.shape[1]] = logits[part].to(dtype=torch.float32)
        return out

    def _target_scores(self, logits: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
        """Each row's processors applied at each of its verified positions: [B, K + 1, V]."""
        rows = self.rows
        if not any(len(r.request.processors) for r in rows):
            return logits
        batch = self._running_batch()
        if batch is not None and batch.ids_free:  # one call over the whole batch
            B, T, V = logits.shape
            return batch.processors(None, logits.reshape(-1, V)).view(B, T, V)
        scores = logits.clone()
        for b, row in enumerate(rows):
            procs = row.request.processors
            if not len(procs) or row.done:
                continue
            n = len(drafts[b]) + 1
            if ids_free(procs):
                self._isolated(row, lambda: scores.__setitem__((b, slice(0, n)), procs(None, logits[b, :n])))
            else:
                def per_position(b=b, row=row, n=n):
                    for j in range(n):
                        scores[b, j] = self._score(b, row.sequence + drafts[b][:j], logits[b, j])
                self._isolated(row, per_position)
        return scores

    def _score(self, b: int, prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Row b's processors on one position: prefix = committed + candidate ids, logits [V]."""
        row = self.rows[b]
        if not len(row.request.processors):
            return logits
        ids = torch.tensor([row.request.padding + prefix], device=logits.device)  # [1, L]
        return row.request.processors(ids, logits[None])[0]

    def _verdict(self, scores, draft_tokens, draft_lengths, qs, drafts) -> Verdict:
        """Greedy rows by argmax, sampled rows by rejection sampling (seeded rows with their own RNG)."""
        try:
            return self._verdict_of(list(range(len(self.rows))), scores, draft_tokens, draft_lengths, qs, drafts)
        except Exception:
            if not self.isolate_faults:
                raise
        B = len(self.rows)
        accepted = torch.zeros(B, dtype=torch.long, device=scores.device)
        next_token = torch.zeros(B, dtype=torch.long, device=scores.device)
        for b, row in enumerate(self.rows):  # one row at a time: the rows that raise alone fail
            if row.done:
                continue
            try:
                v = self._verdict_of([b], scores, draft_tokens, draft_lengths, qs, drafts)
                accepted[b], next_token[b] = v.accepted[0], v.next_token[0]
            except Exception as err:  # noqa: BLE001
                row.fail(err)
        return Verdict(accepted, next_token)

    def _verdict_of(self, rows: list[int], scores, draft_tokens, draft_lengths, qs, drafts) -> Verdict:
        greedy = [b for b in rows if not self.rows[b].request.do_sample]
        shared = [b for b in rows if self.rows[b].request.do_sample and self.rows[b].request.seed is None]
        seeded = [b for b in rows if self.rows[b].request.do_sample and self.rows[b].request.seed is not None]
        everyone = rows == list(range(len(self.rows)))
        if everyone and len(greedy) == len(rows):
            return verify_greedy(scores, draft_tokens, draft_lengths)
        if everyone and len(shared) == len(rows):
            return self._sample(scores, draft_tokens, draft_lengths, qs, drafts)
        B = len(self.rows)
        accepted = torch.zeros(B, dtype=torch.long, device=scores.device)
        next_token = torch.zeros(B, dtype=torch.long, device=scores.device)
        for group, kind in ((greedy, "greedy"), (shared, "sampled"), (seeded, "seeded")):
            if not group:
                continue
            idx = torch.tensor(group, device=scores.device)
            if kind == "greedy":
                v = verify_greedy(scores[idx], draft_tokens[idx], draft_lengths[idx])
            elif kind == "sampled":
                v = self._sample(scores[idx], draft_tokens[idx], draft_lengths[idx], [qs[b] for b in group], [drafts[b] for b in group])
            else:
                noise = torch.zeros(len(group), *scores.shape[1:], device=scores.device)  # [b, K + 1, V]
                for i, b in enumerate(group):  # positions past a row's drafts are never read
                    row = self.rows[b]
                    noise[i, : len(drafts[b]) + 1] = gumbel_noise(row.request.seed, len(row.generated), len(drafts[b]) + 1, scores.shape[-1], scores.device)
                v = verify_seeded(scores[idx], draft_tokens[idx], draft_lengths[idx], noise)
            accepted[idx], next_token[idx] = v.accepted, v.next_token
        return Verdict(accepted[rows], next_token[rows]) if not everyone else Verdict(accepted, next_token)

    @staticmethod
    def _sample(scores, draft_tokens, draft_lengths, qs, drafts) -> Verdict:
        K = draft_tokens.shape[1]
        p = torch.softmax(scores, dim=-1)  # [b, K + 1, V]
        q = _stack_q(qs, drafts, K, p) if any(x is not None for x in qs) else None
        return verify_sampling(p, draft_tokens, draft_lengths, q)

    def _commit(self, row: Row, tokens: list[int], scores: torch.Tensor) -> None:
        """Append tokens to the row one at a time until it stops (cutting `tokens` there)."""
        request = row.request
        for j, token in enumerate(tokens):
            row.sequence.append(token)
            row.generated.append(token)
            if request.logprobs:
                row.logprobs.append(float(torch.log_softmax(scores[j].float(), dim=-1)[token]))
            if request.stopping_criteria(row.as_tensor(), scores[j : j + 1]).any():
                row.finish_reason = STOPPED
            elif len(request.padding) + len(row.sequence) >= request.max_length:
                row.finish_reason = LENGTH
            else:
                continue
            del tokens[j + 1 :]
            return

    def _commit_isolated(self, row: Row, tokens: list[int], scores: torch.Tensor) -> None:
        self._isolated(row, lambda: self._commit(row, tokens, scores))

    def _prefill_idle(self, prefill: dict[int, list[int]], draft_seconds: list[float]) -> None:
        sequences = [r.sequence for r in self.rows]
        for d_idx, rows in prefill.items():
            rows = [b for b in rows if d_idx not in self.rows[b].banned]
            if self.usable[d_idx] and rows:
                self._guarded(d_idx, lambda: self.drafters[d_idx].prefill(rows, sequences), draft_seconds, rows)

    # -- faults ------------------------------------------------------------------------------------
    def _isolated(self, row: Row, fn) -> None:
        """Run a per-row operation; with isolate_faults an exception fails that row only."""
        try:
            fn()
        except Exception as err:
            if not self.isolate_faults:
                raise
            logger.warning("row %d failed: %r", row.id, err)
            row.fail(err)

    def _guarded(self, d_idx: int, fn, draft_seconds: list[float] | None, served: list[int], ban: bool = True) -> bool:
        """Run a drafter call. A drafter that raises is dropped for the call (generate) or, with
        isolate_faults, rebuilt and (if `ban`) banned from the rows it served. Lossless either way."""
        start = perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - any drafter fault must leave decoding lossless
            name = self.names[d_idx]
            self.drafter_stats[name].failures += 1
            if self.isolate_faults:
                # a call over one row (or a notice of joining rows) bans the drafter from those rows; a wider
                # draft call is retried on halves by `propose` until the row at fault is alone
                ids = [self.rows[b].id for b in served if b < len(self.rows)]
                if ban:
                    for b in served:
                        if b < len(self.rows):
                            self.rows[b].banned.add(d_idx)
                    logger.warning("drafter %r raised %r; rows %s go on without it", name, err, ids)
                self._rebuild(d_idx)
            else:
                warnings.warn(f"drafter {name!r} raised {err!r}; dropped for the rest of this call", stacklevel=4)
                self.usable[d_idx] = False
                self.drafters[d_idx].finish()
            return False
        seconds = perf_counter() - start
        if draft_seconds is not None:
            draft_seconds[d_idx] += seconds
        self.drafter_stats[self.names[d_idx]].draft_seconds += seconds
        return True

    def _rebuild(self, d_idx: int) -> None:
        """Fresh per-row state for a drafter that raised (it catches up on each row when next used)."""
        drafter = self.drafters[d_idx]
        try:
            drafter.finish()
            if self._drafters_started:
                drafter.start(self.model, [r.sequence for r in self.rows])
        except Exception as err:  # noqa: BLE001
            logger.warning("drafter %r could not be rebuilt (%r); dropped", self.names[d_idx], err)
            self.usable[d_idx] = False

    # -- what the policy sees --------------------------------------------------------------------------
    def _view(self) -> BatchView:
        return BatchView(
            row_ids=[r.id for r in self.rows],
            prompt_lengths=[r.prompt_length for r in self.rows],
            generated=[len(r.generated) for r in self.rows],
            usable=list(self.usable),
            step=self.steps,
            room=[r.room + 1 for r in self.rows],
        )

    def _running_batch(self) -> _Batch | None:
        """The `generate` batch, when every active row belongs to it (the whole-batch fast path)."""
        batch = self._batch
        if batch is not None and all(r.id in batch.members for r in self.rows):
            return batch
        return None


def _stack_q(qs: list[torch.Tensor | None], drafts: list[list[int]], K: int, p: torch.Tensor) -> torch.Tensor:
    """Per-row q [k_b, V] (or None: deterministic proposal) -> [B, K, V], zero rows meaning one-hot."""
    q = torch.zeros(p.shape[0], K, p.shape[2], dtype=p.dtype, device=p.device)
    for b, qb in enumerate(qs):
        if qb is not None and len(drafts[b]):
            q[b, : len(drafts[b])] = qb[: len(drafts[b])].to(device=p.device, dtype=p.dtype)
    return q
