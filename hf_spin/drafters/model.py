"""A causal LM drafting k tokens per row, batched over the rows it serves.

Per row the drafter remembers which token ids its KV cache holds (`cached`). Each request compares
them with the row's committed sequence (in the drafter's vocabulary): the longest common prefix
stays, the rest is rolled back (rejected drafts), and the new tail is fed in one ragged forward
(catch-up: the bonus token, or every token since this drafter last served the row). Then k - 1
single-token forwards; or, where the step verifies token trees, k - 1 forwards of a tree's frontier
(tree_expansion.py). The same code serves a drafter with another tokenizer (translation.py),
which only changes how sequences and drafts cross between the two vocabularies.

On the static layout (`AssistantPool(cache="static")`) the drafter keeps its KV in its own `StaticRowCache`
and runs every forward as the target verifies, `forward_static` (one query slot per draft token, so one
graph for all of them; chunks bucketed; a tree's depths over a sticky width), compiled when the pool's
`compile` says so; rollback lowers the rows' lengths. There, on an accelerator, a greedy draft keeps
its tokens on the device and reads them once (`_draft_on_device`; docs/design.md, "Host syncs").
Subclasses with their own forwards or caches (fuzzy.py, streaming.py) and models that
`check_static_support` refuses keep the eager path on a dynamic cache, with no error (`_static_run`).

Subclasses change the mechanism through three hooks, never by copying `draft`:
    _new_cache(B)          the cache a call starts with (a sparse one in streaming.py)
    _keep(row, common)     how many cached tokens of a row survive rollback
    _forward(chunks, keep) every forward: the catch-up (keep given) and each draft step (keep None)
and one piece of state: `exact`, per row the leading cached tokens whose KV is the drafter's exact KV.
A drafter whose forwards approximate (fuzzy.py: fuzzy layers; streaming.py: sparse attention) sets it,
and the rollback then drops every approximate entry, accepted tokens included, to be recomputed or
copied exactly (EasySpec's bonus calibration). None: all cached KV is exact (this class).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache import PackedCache, RectangularCache, forward_ragged, needs_contiguous_slots, takes_4d_masks
from ..cache.static import StaticRowCache, give_back, query_bucket, take_cache
from ..cache.static_forward import (
    StaticOptions,
    check_static_support,
    forward_static,
    forward_static_tokens,
    run_static,
    run_static_draft,
)
from ..host_syncs import to_device
from .base import Draft, Drafter, DraftRequest
from .draft_vocabulary import draft_ids, widen, with_draft_vocabulary
from .tree_expansion import grow_trees

# On the static layout, chunks of at most this many tokens run the compiled forward: a draft token (1) and
# the catch-up after a step that accepted a whole draft (its last token and the bonus, 2). Longer chunks (a
# prompt, a row this drafter did not serve for a while) run the same forward eagerly, as the target's
# prefill does, so that prompts of new lengths compile nothing: at most two graphs per row-slot bucket.
COMPILED_CHUNK = 2


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ModelDrafter(Drafter):
    """A draft model that shares the target's tokenizer (token ids mean the same thing).

    tree_width: where the step verifies token trees, each depth expands the `tree_width` heaviest
    nodes by their `tree_width` likeliest children (drafters/tree_expansion.py); 1 drafts chains.
    draft_vocabulary: None (every id), an int N (the N lowest ids) or a list of ids: the only ids this
        drafter scores and proposes, its output layer cut to them (draft_vocabulary.py); the model's
        end-of-sequence ids are always in.
    """

    shares_vocab = True  # the target's logits processors and q apply to this drafter's ids
    kind = "model"
    gives_q = True
    cache_layout = "rectangular"  # set by AssistantPool(cache=...): "packed" is a PackedCache and varlen attention
    static: StaticOptions | None = None  # set by the engine on the static layout: forwards as `_static_run` says
    # On the static layout, whether the draft loop reads each token on the host (to stop a row early) or keeps
    # them on the device and reads once (`_draft_on_device`); None: each token on a CPU, where a read costs
    # nothing and an early stop saves forwards, once on an accelerator, where each read idles the device. Trees
    # grow there only where it reads each token (each depth is read to choose the next frontier): True on an
    # accelerator trades the chain's one read for a tree's read a depth (which pays there is not yet measured).
    read_each_draft_token: bool | None = None

    def __init__(
        self, model, name: str | None = None, tree_width: int = 3, draft_vocabulary: int | Sequence[int] | None = None
    ):
        if tree_width < 1:
            raise ValueError(f"tree_width must be at least 1, got {tree_width}")
        self.name = name or getattr(model.config, "name_or_path", "") or model.config.model_type
        self.draft_ids: torch.Tensor | None = None  # [N] the ids a draft vocabulary scores; None: all
        self.draft_width = 0  # the model's own output rows (V_draft), where a draft vocabulary is set
        if draft_vocabulary is not None:
            self.draft_ids = draft_ids(model, draft_vocabulary).to(model.device)
            self.draft_width = model.get_output_embeddings().weight.shape[0]
            model = with_draft_vocabulary(model, self.draft_ids)
        self.model = model
        self.tree_width = tree_width
        self.cache: RectangularCache | PackedCache | StaticRowCache | None = None
        # this call's fixed-shape forward on a StaticRowCache (`_static_run`); None: eager, on a dynamic cache
        self.static_run = None
        self.target_static: StaticRowCache | None = None  # the target's cache on the static layout (`start`)
        self.cached: list[list[int]] = []  # per row: the draft-space ids whose KV the cache holds
        self.exact: list[int] | None = None  # per row: leading cached tokens with exact KV (None: all of them)
        self.target_vocab_size = model.config.get_text_config().vocab_size
        self.num_parameters = model.num_parameters()

    # Vocabulary crossing: identity for a shared tokenizer (overridden for token translation).
    def to_draft_space(self, sequence: list[int]) -> list[int]:
        return sequence

    def to_target_space(self, prefix: list[int], new_ids: list[int], k: int) -> list[int]:
        return new_ids[:k]

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        self.target_vocab_size = target.config.get_text_config().vocab_size
        self.static_run = self._static_run()
        # the target's StaticRowCache, sized for the rows' length limit: ours follows its capacity, so that rows
        # growing past a capacity bucket recompile none of our graphs
        on_static = self.static_run is not None and isinstance(target_cache, StaticRowCache)
        self.target_static = target_cache if on_static else None
        self.cache = self._new_cache(len(sequences))
        self.cached = [[] for _ in sequences]
        self.exact = None

    def grows_trees(self) -> bool:
        """Whether this drafter can grow token trees: `tree_width` > 1, the target's vocabulary, its own
        forwards (not a subclass's fuzzy or sparse ones) over a rectangular cache, or a static one where its
        draft loop reads each token anyway (`reads_each_draft_token`: a tree's depth is read to choose the
        next frontier, where a chain's loop on an accelerator reads its draft once), and a model that takes 4D
        masks at consecutive-or-not slots."""
        static = isinstance(self.cache, StaticRowCache) and self.reads_each_draft_token()
        return (
            self.tree_width > 1
            and self.shares_vocab
            and type(self)._forward is ModelDrafter._forward
            and (isinstance(self.cache, RectangularCache) or static)
            and takes_4d_masks(self.model)
            and not needs_contiguous_slots(self.model.config)
        )

    @property
    def drafts_on_static(self) -> bool:
        """Whether its forwards and caches are this class's, the ones the static layout runs (a fuzzy or
        streaming drafter keeps its own eager caches there)."""
        return type(self)._forward is ModelDrafter._forward and type(self)._new_cache is ModelDrafter._new_cache

    def _static_run(self):
        """The forward to draft through on a `StaticRowCache`: `run_static_draft`, compiled if `static` says so;
        None (the eager path on a dynamic cache, no error) off the static layout, for a subclass with its own
        forwards or caches, and for a model `check_static_support` refuses."""
        if self.static is None or not self.drafts_on_static:
            return None
        try:
            check_static_support(self.model, f"drafter {self.name!r}")
        except ValueError:
            return None
        return self.static.forward_for(self.model, run_static_draft)

    def _new_cache(self, batch: int) -> RectangularCache | PackedCache | StaticRowCache:
        if self.static_run is not None:  # where it compiles, the storage its last call gave back (`take_cache`)
            cache = take_cache(self.model, batch) if self.static_compiles else StaticRowCache(self.model.device)
            cache.add_empty_rows(batch)
            return cache
        if self.cache_layout == "packed":
            return PackedCache(batch, device=self.model.device)
        empty = torch.zeros(batch, 0, dtype=torch.bool, device=self.model.device)  # [B, 0]
        return RectangularCache(empty, contiguous=needs_contiguous_slots(self.model.config))

    def _keep(self, row: int, common: int) -> int:
        """Cached tokens of `row` to keep, given that its first `common` cached tokens are still committed."""
        return common if self.exact is None else min(common, self.exact[row])

    def _forward(self, chunks: list[list[int]], keep: list[int] | None) -> torch.Tensor:
        """Feed one chunk per row (B lists) through the drafter, appending to its cache; logits [B, 1, V_draft]
        at each row's last chunk token. keep: [B] tokens each row kept before a catch-up; None for a draft step."""
        if self.static_run is None:
            return forward_ragged(self.model, self.cache, chunks, all_logits=False)
        return self._forward_static(chunks, all_logits=False)  # [B, 1, V_draft] at each row's last token

    def _forward_static(self, chunks: list[list[int]], trees: list | None = None, all_logits=True) -> torch.Tensor:
        """`forward_static` on the drafter's StaticRowCache: logits `[B, T, V_draft]` (`[B, 1, V_draft]` at each row's
        last token where not `all_logits`, computed at those alone where it runs eagerly). A chunk runs compiled up to
        COMPILED_CHUNK tokens; a tree's frontier (trees: `forward_static`'s layouts, tree_expansion.py) and a
        catch-up no longer than the trees so far (accepted nodes the cache did not keep) always, over the
        cache's sticky query width, so a few graphs serve every depth."""
        longest = max(len(c) for c in chunks)
        sticky = self.static_compiles and (trees is not None or COMPILED_CHUNK < longest <= self.cache.width)
        width = self.cache.query_width(longest) if sticky else query_bucket(longest)
        self._reserve(width)
        run = self.static_run if longest <= COMPILED_CHUNK or sticky else run_static
        return forward_static(self.model, self.cache, chunks, run, width, trees, all_logits)

    def _reserve(self, width: int) -> None:
        """Room in the static cache for a forward of `width` query slots, at least the target's capacity (so that
        rows growing past a capacity bucket recompile none of our graphs)."""
        self.cache.reserve(width, self.target_static.capacity if self.target_static is not None else 0)

    def synced(self, row: int) -> int | None:
        return len(self.cached[row]) if row < len(self.cached) else 0  # draft-space tokens: about the target's

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)  # on the host: the cache sends the device its copy
        self.cached = [self.cached[i] for i in rows.tolist()]
        if self.exact is not None:
            self.exact = [self.exact[i] for i in rows.tolist()]

    def add_rows(self, sequences: list[list[int]]) -> None:
        self.cache.add_empty_rows(len(sequences))  # their first draft or catch-up feeds each whole sequence
        self.cached += [[] for _ in sequences]
        if self.exact is not None:
            self.exact += [0 for _ in sequences]

    def finish(self) -> None:
        if self.static_compiles and isinstance(self.cache, StaticRowCache):
            give_back(self.model, self.cache)
        self.cache, self.cached, self.exact, self.static_run, self.target_static = None, [], None, None, None

    @property
    def static_compiles(self) -> bool:
        """Whether this call drafts through compiled (or captured) forwards on a StaticRowCache."""
        return self.static_run is not None and self.static.compiles(self.model, drafter=True)

    def _scores(
        self, logits: torch.Tensor, rows: list[int], prefixes: list[list[int]], request: DraftRequest
    ) -> torch.Tensor:
        """Draft logits [n, V_draft] of `rows` -> scores over the target vocabulary [n, V_target], processed
        like the target's (prefixes: each row's committed + drafted ids)."""
        V = self.target_vocab_size
        logits = logits.float() if self.draft_ids is None else widen(logits.float(), self.draft_ids, self.draft_width)
        if logits.shape[-1] >= V:
            logits = logits[:, :V]
        else:  # a drafter with a smaller (unpadded) vocabulary never proposes the missing ids
            logits = torch.cat(
                [logits, logits.new_full((logits.shape[0], V - logits.shape[-1]), float("-inf"))], dim=-1
            )
        if request.score is None:
            return logits
        return request.score(rows, prefixes, logits)

    def _catch_up(self, rows: list[int], sequences: list[list[int]]) -> tuple[torch.Tensor, dict[int, list[int]]]:
        """Roll back what the committed sequences no longer contain and feed the rest, for `rows`.

        Returns the logits after each row's last token [B, 1, V_draft] (rows not in `rows` read a
        hole) and each served row's sequence in the drafter's vocabulary.
        """
        keep = [len(c) for c in self.cached]
        chunks: list[list[int]] = [[] for _ in self.cached]
        draft_seqs = {}
        for row in rows:
            seq = self.to_draft_space(sequences[row])
            draft_seqs[row] = seq
            # at least one token is fed, so the forward yields the next-token logits
            keep[row] = min(self._keep(row, common_prefix_length(self.cached[row], seq)), len(seq) - 1)
            chunks[row] = seq[keep[row] :]
            self.cached[row] = list(seq)
        self.cache.rollback(keep)
        return self._forward(chunks, keep), draft_seqs

    @torch.no_grad()
    def catch_up(self, rows: list[int], sequences: list[list[int]]) -> None:
        if rows:
            self._catch_up(rows, sequences)

    @torch.no_grad()
    def draft(self, request: DraftRequest) -> Draft:
        kmax = max(request.k, default=0)
        if kmax == 0:
            return Draft(tokens=[[] for _ in request.rows], q=[None] * len(request.rows))
        # 1. Catch up (roll back rejected drafts, feed the bonus token or any tokens since this drafter last served
        # the row).
        logits, draft_seqs = self._catch_up(request.rows, request.sequences)  # [B, 1, V_draft]
        if request.trees and self.grows_trees():
            return grow_trees(self, request, logits, draft_seqs)
        # 2. Draft up to kmax tokens, one forward per token after the first; a row stops at its k or
        #    after a token less likely than min_confidence.
        limit = dict(zip(request.rows, request.k))
        sample = dict(zip(request.rows, request.sample or [request.do_sample] * len(request.rows)))
        if self._drafts_on_device(request, sample):
            new_ids, q_rows = self._draft_on_device(request, logits, limit), {}
        else:
            new_ids, q_rows = self._draft_on_host(request, logits, limit, sample)
        # 3. Hand back the drafts in the target vocabulary.
        tokens, qs = [], []
        for row, k in zip(request.rows, request.k):
            tokens.append(self.to_target_space(draft_seqs[row], new_ids[row], k))
            qs.append(torch.stack(q_rows[row][: len(tokens[-1])]) if q_rows.get(row) and tokens[-1] else None)
        return Draft(tokens=tokens, q=qs)

    def reads_each_draft_token(self) -> bool:
        """`read_each_draft_token`, None resolved: on a CPU, where a read costs nothing."""
        reads = self.read_each_draft_token
        return self.model.device.type == "cpu" if reads is None else reads

    def _drafts_on_device(self, request: DraftRequest, sample: dict[int, bool]) -> bool:
        """Whether this draft loop keeps its tokens on the device: the static layout's one-token forwards
        (`read_each_draft_token`), greedy proposals, and no logits processor reading the drafted prefix."""
        return (
            self.static_run is not None
            and not self.reads_each_draft_token()
            and not (self.shares_vocab and (request.score is not None or any(sample.values())))
        )

    def _draft_on_device(self, request: DraftRequest, logits: torch.Tensor, limit: dict[int, int]) -> dict:
        """The draft loop with one host read: every row drafts max(k) greedy tokens, each fed back on the
        device (`forward_static_tokens`); then a row keeps its first k, up to and including its first token
        less likely than min_confidence: the tokens the host loop's stops give, for a few forwards more
        where a row stops early. Returns {row: draft-space ids}."""
        B = len(self.cached)
        active = [row for row in request.rows if limit[row] > 0]
        new_ids = {row: [] for row in request.rows}
        if not active:
            return new_ids
        kmax = max(limit[row] for row in active)
        index = None if active == list(range(B)) else to_device(active, logits.device, torch.long)  # [n]
        fed = [False] * B
        for row in active:
            fed[row] = True
        picked, confidences = [], []  # kmax x [n] on the device
        for j in range(kmax):
            at = logits[:, -1] if index is None else logits[index, -1]  # [n, V_draft]
            scores = self._scores(at, active, [], request) if self.shares_vocab else at.float()  # [n, V]
            tokens = scores.argmax(dim=-1)  # [n]
            picked.append(tokens)
            if request.min_confidence > 0:
                confidences.append(torch.softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0])
            if j + 1 < kmax:
                self._reserve(1)
                logits = forward_static_tokens(self.model, self.cache, tokens, fed, self.static_run)  # [B, 1, V]
        # the one read: ids and their q (ids are exact in float64)
        read = torch.stack([t.double() for t in picked + confidences]).tolist()  # [kmax (+ kmax), n]
        ids, confidence = read[:kmax], read[kmax:]
        for i, row in enumerate(active):
            column = [int(ids[j][i]) for j in range(kmax)]
            for j, token in enumerate(column):
                new_ids[row].append(token)
                if j + 1 >= limit[row] or (confidence and confidence[j][i] < request.min_confidence):
                    break
            self.cached[row] += column[:-1]  # every token but the last was fed
        return new_ids

    def _draft_on_host(
        self, request: DraftRequest, logits: torch.Tensor, limit: dict[int, int], sample: dict[int, bool]
    ) -> tuple[dict, dict]:
        """The draft loop that reads each position on the host, drawn for every row at once and crossing in one
        transfer, and stops each row as soon as it is done. Returns ({row: draft-space ids}, {row: [q]})."""
        B = len(self.cached)
        new_ids = {row: [] for row in request.rows}
        q_rows = {row: [] for row in request.rows}
        active = [row for row in request.rows if limit[row] > 0]
        while active:
            at = (
                logits[:, -1] if active == list(range(B)) else logits[to_device(active, logits.device, torch.long), -1]
            )  # [n, V_draft]
            if self.shares_vocab:
                scores = self._scores(
                    at, active, [request.sequences[row] + new_ids[row] for row in active], request
                )  # [n, V]
            else:  # another vocabulary: the target's processors do not apply; greedy proposal
                scores = at.float()
            drawn = [sample[row] and self.shares_vocab for row in active]  # [n]
            # q [n, V] only where it is used: a draw from it, or the confidence stop
            q = torch.softmax(scores, dim=-1) if any(drawn) or request.min_confidence > 0 else None
            tokens = scores.argmax(dim=-1)  # [n]
            if all(drawn):
                tokens = torch.multinomial(q, 1)[:, 0]
            elif any(drawn):
                picked = to_device([i for i, d in enumerate(drawn) if d], q.device, torch.long)
                tokens[picked] = torch.multinomial(q[picked], 1)[:, 0]
            if request.min_confidence > 0:  # tokens and their q in one transfer (ids are exact in float64)
                tokens_host, confidence = torch.stack(
                    [tokens.double(), q.gather(1, tokens[:, None])[:, 0].double()]
                ).tolist()
            else:
                tokens_host, confidence = tokens.tolist(), None
            next_chunks: list[list[int]] = [[] for _ in range(B)]
            still = []
            for i, row in enumerate(active):
                token = int(tokens_host[i])
                if drawn[i]:
                    q_rows[row].append(q[i])
                new_ids[row].append(token)
                if len(new_ids[row]) < limit[row] and (confidence is None or confidence[i] >= request.min_confidence):
                    next_chunks[row] = [token]
                    still.append(row)
            active = still
            if active:
                logits = self._forward(next_chunks, None)
                for row in active:
                    self.cached[row].append(new_ids[row][-1])
        return new_ids, q_rows
