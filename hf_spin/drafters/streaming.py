"""MagicDec: drafting with a sparse StreamingLLM KV cache (Chen et al., 2024, arXiv 2408.11049).

The drafter attends only to each row's first `sink_tokens` tokens (attention sinks) and its last
`window_tokens` tokens, so a draft forward loads a fixed KV budget however long the row grows; the
verifying target keeps its full, exact cache. With the target itself as the drafter this is
MagicDec's self-speculation: the same weights, a KV budget of sink + window, and a cache of the
drafter's own (the target's `RectangularCache` is never shared or changed). The same budget applies to a
separate small drafter just as well.

    hf_spin.StreamingDrafter(target, sink_tokens=4, window_tokens=508)      # self-speculation, 512 budget
    hf_spin.StreamingDrafter(small_model, sink_tokens=4, window_tokens=252)

Positions stay true positions: evicted tokens leave the cache, not the position count, so RoPE
(or any absolute position) sees the token's real index, as in MagicDec.

Life of a row (sink 2, window 3; tokens t0 t1 ...):
    prefill t0..t7      full attention over the prompt (exact KV), then evicted to [t0 t1 | t5 t6 t7]; with
                        the target as drafter this cache is copied from the target's own prefill instead
    every other forward evicts to sink + window first, then attends [sinks | window | its chunk]: t8 (the
                        first token the target committed) sees [t0 t1 | t5 t6 t7 | t8]
    rollback            drafts rejected -> their slots become holes; if a rollback reaches into the evicted
                        middle (a window shorter than the draft), the row is rebuilt from its tokens.
KV of tokens the drafter feeds after the prefill is computed over its sparse cache, so it is itself
approximate. A separate drafter keeps it; the target drafting for itself replaces it at each catch-up
with the exact KV the verification wrote into the target's cache (MagicDec's draft cache is a sparse
view of the full one). Verification never reads the drafter's KV.
"""

from __future__ import annotations

import torch

from ..cache import RectangularCache, compaction_index, forward_ragged, gather_slots, needs_contiguous_slots, per_device
from .model import ModelDrafter

DEFAULT_SINK_TOKENS = 4  # StreamingLLM: four initial tokens hold most of the "attention sink" mass
DEFAULT_WINDOW_TOKENS = 508  # 512-token budget with the sinks, one of MagicDec's settings


class StreamingCache(RectangularCache):
    """A `RectangularCache` that keeps only sinks + a recent window of each row's tokens.

    evicted: [B] tokens dropped from the middle of each row; a row's tokens are its valid slots in
        order, and token j of the row (0-based) sits at true position j + evicted for j >= sink_tokens.
    `rollback(keep)` keeps the first keep[b] *tokens* (true positions) of row b, as `RectangularCache` does.
    """

    def __init__(self, slot_mask: torch.Tensor, sink_tokens: int, window_tokens: int, contiguous: bool = False):
        super().__init__(slot_mask, contiguous=contiguous)
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens
        self.evicted = torch.zeros(slot_mask.shape[0], dtype=torch.long, device=slot_mask.device)  # [B]

    @property
    def token_counts(self) -> torch.Tensor:
        """`[B]` tokens each row has seen (held + evicted): the true position of its next token."""
        return self.lengths + self.evicted

    def add_slots(self, chunk_lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        attention_mask, position_ids = super().add_slots(chunk_lengths, width)
        return attention_mask, position_ids + self.evicted[:, None]  # [B, S + T], [B, T] true positions

    def eviction_mask(self) -> torch.Tensor:
        """`[B, S]` valid slots outside each row's sinks + last window."""
        lengths = self.lengths  # [B]
        rank = self.slot_mask.long().cumsum(dim=1)  # [B, S] 1-based rank of each valid slot
        over = (lengths - self.sink_tokens - self.window_tokens).clamp(min=0)  # [B]
        return self.slot_mask & (rank > self.sink_tokens) & (rank <= self.sink_tokens + over[:, None])

    def evict(self) -> None:
        """Drop what lies outside the budget and pack the cache (the drafter's forwards then load only the budget)."""
        drop = self.eviction_mask()
        if not bool(drop.any()):
            return
        self.evicted += drop.sum(dim=1)
        self.slot_mask &= ~drop
        self.compact()

    def rollback(self, keep: torch.Tensor) -> None:
        """Keep the first keep[b] tokens of row b. keep[b] == 0 resets the row; otherwise it must not reach
        into the evicted middle (keep[b] >= sink + evicted[b] where anything was evicted)."""
        keep = torch.as_tensor(keep, device=self.evicted.device)  # [B] (a list from the drafter)
        reaches = (self.evicted > 0) & (keep > 0) & (keep < self.sink_tokens + self.evicted)
        assert not bool(reaches.any()), (
            f"rollback into evicted tokens: keep {keep.tolist()}, evicted {self.evicted.tolist()}"
        )
        self.evicted = torch.where(keep == 0, 0, self.evicted)
        super().rollback(keep - self.evicted)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.evicted = self.evicted[rows]

    def append_from(self, source: RectangularCache, counts: torch.Tensor) -> None:
        """Append copies of the KV of each row's last counts[b] tokens in `source` (same rows and layers)."""
        width = int(counts.max())
        rank = source.slot_mask.long().cumsum(dim=1)  # [B, S]
        take = source.slot_mask & (rank > (source.lengths - counts)[:, None])  # [B, S] the slots to copy
        cols = torch.arange(take.shape[1], device=take.device).expand_as(take)
        src = torch.argsort((~take).long() * take.shape[1] + cols, dim=1)[
            :, :width
        ]  # [B, W] those slots first, in order
        self.add_slots(counts, width)  # the first counts[b] new slots of row b valid, the rest holes
        src_on = per_device(src)
        for i, layer in enumerate(source.layers):
            self.update(
                gather_slots(layer.keys, src_on(layer.keys.device)),
                gather_slots(layer.values, src_on(layer.keys.device)),
                i,
            )

    @classmethod
    def from_cache(cls, cache: RectangularCache, sink_tokens: int, window_tokens: int) -> StreamingCache:
        """A packed copy of the sinks + last window of every row of `cache` (which is left unchanged)."""
        new = cls(cache.slot_mask.clone(), sink_tokens, window_tokens, contiguous=cache.contiguous)
        drop = new.eviction_mask()
        new.evicted = drop.sum(dim=1)
        src, new.slot_mask = compaction_index(cache.slot_mask & ~drop)  # [B, W]
        src_on = per_device(src)
        for i, layer in enumerate(cache.layers):
            new.update(
                gather_slots(layer.keys, src_on(layer.keys.device)),
                gather_slots(layer.values, src_on(layer.keys.device)),
                i,
            )
        return new


class StreamingDrafter(ModelDrafter):
    """A same-tokenizer drafter (the target itself for self-speculation) with a sink + window KV budget.

    sink_tokens: first tokens of each row always attended (attention sinks).
    window_tokens: most recent tokens attended besides the sinks; budget = sink_tokens + window_tokens.

    With the target itself as the drafter (`seeded`), the drafter's cache is a sparse view of the target's
    exact cache: the prefill KV is copied at start, and at every catch-up the exact KV of the newly
    committed tokens (accepted drafts, the previous bonus token) is copied from the target's cache, which
    the verification just filled; only the last committed token is fed. The drafter's own KV of
    drafts and of that last token comes from sparse attention and is dropped at the next catch-up.
    """

    def __init__(
        self,
        model,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        window_tokens: int = DEFAULT_WINDOW_TOKENS,
        name: str | None = None,
    ):
        if not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if not isinstance(window_tokens, int) or window_tokens < 1:
            raise ValueError(f"window_tokens must be an int >= 1, got {window_tokens!r}")
        super().__init__(model, name=name)
        self.sink_tokens, self.window_tokens = sink_tokens, window_tokens
        if name is None:
            self.name += f"-streaming{sink_tokens}+{window_tokens}"
        self.seeded = False  # whether the last start() got the target's own cache to copy exact KV from
        self.target_cache: RectangularCache | None = None  # read only, never changed
        self.rebuilds = 0  # rows rebuilt from nothing since this drafter was made (a rollback into evicted tokens)

    @property
    def budget(self) -> int:
        return self.sink_tokens + self.window_tokens

    def _new_cache(self, batch: int) -> StreamingCache:
        empty = torch.zeros(batch, 0, dtype=torch.bool, device=self.model.device)  # [B, 0]
        return StreamingCache(
            empty, self.sink_tokens, self.window_tokens, contiguous=needs_contiguous_slots(self.model.config)
        )

    def start(self, target, sequences: list[list[int]], target_cache: RectangularCache | None = None) -> None:
        super().start(target, sequences, target_cache)
        rectangular = isinstance(target_cache, RectangularCache)  # a static or packed one holds other layouts
        self.seeded = target is self.model and rectangular and _filled(target_cache, sequences)
        self.target_cache = target_cache if self.seeded else None
        if self.seeded:  # self-speculation: the target's prefill KV is exactly what our own prefill would compute
            self.cache = StreamingCache.from_cache(target_cache, self.sink_tokens, self.window_tokens)
            self.cached = [list(seq[:-1]) for seq in sequences]  # the target cache holds all but the last token
            self.exact = [len(seq) - 1 for seq in sequences]

    def finish(self) -> None:
        super().finish()
        self.target_cache = None

    def _keep(self, row: int, common: int) -> int:
        keep = super()._keep(row, common)  # seeded: no further than the KV copied from the target
        evicted = int(self.cache.evicted[row])
        if evicted and keep < self.sink_tokens + evicted:  # the tokens to keep reach into evicted ones
            self.rebuilds += 1
            return 0  # rebuild the row
        return keep

    def _forward(self, chunks: list[list[int]], keep: list[int] | None) -> torch.Tensor:
        if keep is not None:
            chunks = self._copy_exact(chunks, keep)
            # a row starting from nothing (and nothing to copy): prefill all but its last token with full attention
            prefill = [chunk[:-1] if keep[b] == 0 else [] for b, chunk in enumerate(chunks)]
            if any(prefill):
                forward_ragged(self.model, self.cache, prefill, all_logits=False)
                chunks = [chunk[len(p) :] for chunk, p in zip(chunks, prefill)]
        self.cache.evict()  # then every token that yields a draft sees sinks + window (+ its own chunk) only
        return super()._forward(chunks, keep)

    def _copy_exact(self, chunks: list[list[int]], keep: list[int]) -> list[list[int]]:
        """Seeded: append the target's KV of every chunk token but the last; returns what is left to feed."""
        if self.target_cache is None:
            return chunks
        held = self.target_cache.lengths.tolist()  # the engine keeps it at every committed token but the last
        counts = [len(c) - 1 if c and held[b] == keep[b] + len(c) - 1 else 0 for b, c in enumerate(chunks)]
        if any(counts):
            self.cache.append_from(self.target_cache, torch.tensor(counts, device=self.cache.slot_mask.device))
        for b, chunk in enumerate(chunks):
            if chunk:
                self.exact[b] = keep[b] + counts[b]
        return [chunk[n:] for chunk, n in zip(chunks, counts)]


def _filled(cache: RectangularCache, sequences: list[list[int]]) -> bool:
    """The cache holds every row's committed tokens but the last, in every layer."""
    layers_ok = len(cache.layers) > 0 and all(layer.is_initialized and layer.keys.numel() for layer in cache.layers)
    return layers_ok and cache.lengths.tolist() == [len(s) - 1 for s in sequences]
