"""Step 4 of a step: the drafters' calls for one plan (preempting drafts, served drafts, shadow drafts)
and the merge of several drafters' drafts into the candidates each row verifies.

    drafting = Drafting(scope, faults, usable, plan, draft_seconds, use_trees)
    firsts = drafting.preempt(chosen, ks, proposals, q_of)             # 4a: a preempting drafter drafts first
    drafting.serve(chosen, ks, proposals, q_of)                        # 4b: each drafter over the rows it serves
    shadows = drafting.shadows(chosen, firsts)                         # 4c: unverified drafts, for measurement
    drafts, qs, trees = drafting.merge(proposals, q_of, ks, use_trees)  # per row: candidates, q, a vote's tree
    drafting.calls                                                     # what each drafter call did, for the engine

Every drafter call goes through `Faults.drafter`, which times it and absorbs its faults; what it did
(`DrafterCall`) is kept in `calls` for the engine to apply to its drafter stats and usable flags.
"""

from __future__ import annotations

import torch

from ..drafters import Draft, DraftRequest
from ..planning.plan import Plan
from ..verify.token_tree import TokenTree
from ..verify.vote_tree import heaviest_path
from .faults import DrafterCall, DrafterScope, Faults
from .processors import score_rows

Proposals = list[dict[int, list[int]]]  # [B] drafter -> its draft for the row


def note_matches(draft: Draft, served: list[int], d_idx: int, match_lengths: list[dict[int, int]]) -> None:
    """Record in `match_lengths` ([B] drafter -> length) the match each of `served`'s drafts continued,
    where the drafter reports one (`Draft.match_lengths`)."""
    for b, match in zip(served, draft.match_lengths or []):
        if match is not None:
            match_lengths[b][d_idx] = match


class Drafting:
    """The drafters' calls of one step (scope: the drafters, the active rows and the target model;
    faults: the fault policy of each call; usable: [num_drafters] the drafters not dropped, copied;
    plan: the step's plan, or None without a pool; draft_seconds: [num_drafters] wall time per drafter
    this step, added to; trees: drafters may propose token trees)."""

    def __init__(
        self,
        scope: DrafterScope,
        faults: Faults,
        usable: list[bool],
        plan: Plan | None,
        draft_seconds: list[float],
        trees: bool = False,
    ):
        self.scope, self.faults, self.plan, self.draft_seconds, self.trees = scope, faults, plan, draft_seconds, trees
        self.usable = list(usable)  # a drafter dropped in this step is unusable for the rest of it
        self.calls: list[tuple[int, DrafterCall]] = []  # (drafter, what its call did), in call order
        self.rows = scope.rows
        self.sequences = [r.sequence for r in self.rows]
        self.score_fn = self._score if any(len(r.request.processors) for r in self.rows) else None
        self.device = getattr(scope.model, "device", None)  # the target's: where its processors hold their tensors
        self.min_confidence = plan.min_confidence if plan is not None else 0.0
        self.match_lengths: list[dict[int, int]] = [
            {} for _ in self.rows
        ]  # [B] drafter -> the match its draft continued
        self.tree_of: list[dict[int, TokenTree]] = [
            {} for _ in self.rows
        ]  # [B] drafter -> the tree it proposed (`trees`)

    def _score(self, bs: list[int], prefixes: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        """Rows bs' processors on one draft position each, logits [n, V]: drafters score like the target
        (`ScoreFn`). The draft logits move to the target's device first: the processors hold tensors
        there (eos ids, suppressed tokens), and a drafter on another device would otherwise raise and be
        dropped. The scores stay there: the drafter reads its tokens from them, and q is verified there."""
        if self.device is not None and logits.device != self.device:
            logits = logits.to(self.device)
        return score_rows([self.rows[b] for b in bs], prefixes, logits)

    def _draft(self, d_idx: int, request: DraftRequest) -> DrafterCall:
        """Drafter d_idx's draft for `request`, guarded; its time added to `draft_seconds`, the call kept
        in `calls`. A drafter that raises over one row is banned from it."""
        served = request.rows
        drafter = self.scope.drafters[d_idx]
        call = self.faults.drafter(self.scope, d_idx, lambda: drafter.draft(request), served, ban=len(served) == 1)
        self.calls.append((d_idx, call))
        if call.ok:
            self.draft_seconds[d_idx] += call.seconds
        if call.dropped:
            self.usable[d_idx] = False
        return call

    def preempt(
        self, chosen: list[tuple[int, ...]], ks: list[int], proposals: Proposals, q_of: list[dict]
    ) -> Proposals:
        """4a. A preempting drafter (`Plan.preempt`) drafts first; a row it proposes at least the plan's
        minimum tokens for, continuing a long enough match, verifies that draft instead of its planned
        drafters' (`chosen`, `ks` and `proposals` updated). Returns [B] the drafts too short to serve."""
        rows, firsts = self.rows, [{} for _ in self.rows]
        for d_idx, wanted in (self.plan.preempt if self.plan is not None else {}).items():
            eligible = [
                b
                for b in sorted(wanted)
                if b < len(rows) and self.usable[d_idx] and d_idx not in rows[b].banned and d_idx not in chosen[b]
            ]
            cap = {
                b: k for b in eligible if (k := min(wanted[b].k, rows[b].draft_room)) > 0
            }  # k capped by the room left
            for b, (tokens, q) in self.draft_rows(d_idx, list(cap), cap).items():
                match = self.match_lengths[b].get(d_idx)
                if len(tokens) >= wanted[b].min_tokens and (match is None or match >= wanted[b].min_match):
                    chosen[b], ks[b] = (d_idx,), cap[b]
                    proposals[b][d_idx], q_of[b][d_idx] = tokens, q
                else:
                    firsts[b][d_idx] = tokens
        return firsts

    def serve(self, chosen: list[tuple[int, ...]], ks: list[int], proposals: Proposals, q_of: list[dict]) -> None:
        """4b. One call per drafter over the rows it serves and has not drafted for yet."""
        for d_idx in range(len(self.scope.drafters)):
            served = [
                b for b in range(len(self.rows)) if d_idx in chosen[b] and ks[b] > 0 and d_idx not in proposals[b]
            ]
            for b, (tokens, q) in self.draft_rows(d_idx, served, ks).items():
                proposals[b][d_idx], q_of[b][d_idx] = tokens, q

    def draft_rows(self, d_idx: int, served: list[int], ks) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """One drafter's drafts for the batch rows `served` (ks[b] tokens each): batch row -> (tokens,
        q). Isolating faults, a call that raises is retried on halves to find the row(s) at fault."""
        rows, out = self.rows, {}
        todo = [served]
        while todo and todo[-1]:
            served = todo.pop()
            # seeded rows draft greedily: their tokens come from their own noise, whatever the draft
            sample = [rows[b].request.do_sample and rows[b].request.seed is None for b in served]
            request = DraftRequest(
                served,
                self.sequences,
                [ks[b] for b in served],
                any(sample),
                self.score_fn,
                self.min_confidence,
                sample if any(sample) and not all(sample) else None,  # greedy and sampled rows in one call
                self.trees,
            )
            call = self._draft(d_idx, request)
            if call.ok:
                draft = call.value
                for b, tokens, q in zip(served, draft.tokens, draft.q):
                    out[b] = (list(tokens), q)
                for b, tree in zip(served, draft.trees or []):
                    if tree is not None and len(tree):
                        tree.drafters = [d_idx] * len(tree)  # the pool's index of the drafter that proposed it
                        self.tree_of[b][d_idx] = tree
                note_matches(draft, served, d_idx, self.match_lengths)
            elif self.faults.isolate and self.usable[d_idx] and len(served) > 1:
                todo += [served[: len(served) // 2], served[len(served) // 2 :]]
        return out

    def shadows(self, chosen: list[tuple[int, ...]], firsts: Proposals) -> Proposals:
        """4c. Drafts the plan asks of drafters for rows they do not serve (`Plan.shadow`), greedily:
        only compared with the committed tokens after the step, so the policy measures them for free.
        A preempting drafter's draft that did not serve (`firsts`) is its shadow draft."""
        rows, plan = self.rows, self.plan
        shadows: Proposals = [dict(f) for f in firsts]
        for d_idx, wanted in (plan.shadow if plan is not None else {}).items():
            if not self.usable[d_idx]:
                continue
            served = [
                b
                for b in sorted(wanted)
                if b < len(rows)
                and d_idx not in chosen[b]
                and d_idx not in rows[b].banned
                and d_idx not in shadows[b]
                and min(wanted[b], rows[b].draft_room) > 0
            ]
            if not served:
                continue
            request = DraftRequest(
                served,
                self.sequences,
                [min(wanted[b], rows[b].draft_room) for b in served],
                False,
                self.score_fn,
                plan.min_confidence,
            )
            call = self._draft(d_idx, request)
            if call.ok:
                draft = call.value
                for b, tokens in zip(served, draft.tokens):
                    shadows[b][d_idx] = list(tokens)
                note_matches(draft, served, d_idx, self.match_lengths)
        return shadows

    def merge(
        self, proposals: Proposals, q_of: list[dict], ks: list[int], trees: bool = False, max_nodes: int | None = None
    ):
        """([B] the candidates each row verifies, [B] their q or None, [B] token trees or None): a single
        drafter's draft and q, or several drafters' vote tree (a deterministic merge: one-hot q): with
        `trees` the whole tree (its `max_nodes` heaviest nodes), else its heaviest path."""
        drafts: list[list[int]] = [[] for _ in proposals]
        qs: list[torch.Tensor | None] = [None] * len(proposals)
        merged: list[TokenTree | None] = [None] * len(proposals)
        weights = (self.plan.vote_weights if self.plan is not None else None) or [1.0] * len(self.scope.drafters)
        for b, proposal in enumerate(proposals):
            own = (
                {d: self.tree_of[b][d] for d in proposal if d in self.tree_of[b]} if trees else {}
            )  # drafters' own trees
            if len(proposal) == 1 and not own:
                ((d_idx, drafts[b]),) = proposal.items()
                qs[b] = q_of[b][d_idx]
            elif proposal and trees:
                parts = [own.get(d) or TokenTree.chain(tokens, drafter=d) for d, tokens in proposal.items()]
                tree = TokenTree.merge(parts, [weights[d] for d in proposal])
                merged[b] = tree.pruned(max_nodes) if max_nodes else tree
                drafts[b] = list(merged[b].tokens)
            elif proposal:
                drafts[b] = heaviest_path(proposal, weights)[: ks[b]]
        return drafts, qs, merged
