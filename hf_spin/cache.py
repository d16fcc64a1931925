"""Ragged rows on a rectangular KV cache.

`transformers`' `DynamicCache` holds `[B, H, S, D]` tensors and `crop` cuts every row alike. After a
verification step each row keeps its own number of tokens, so `RaggedCache` keeps a slot mask beside
the tensors: a slot is *valid* (attended to) or a *hole* (attention mask 0). Rejected draft slots
become holes; explicit per-row `position_ids` keep the positions of valid tokens contiguous, so a
row with holes computes exactly what it would without them. Holes are trimmed when they form a
common tail and compacted away when they pile up.

Worked example, B = 2, after a step that fed 3 slots per row and kept 3 for row 0, 1 for row 1:

    slot_mask  [[1 1 1 | 1 1 1],      lengths [5, 3]
                [0 1 1 | 1 0 0]]      (row 1 was left-padded by one)

`forward_ragged` runs a model on per-row chunks of new tokens of different lengths (right-padded
with holes) and returns the logits of every chunk slot.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask

# Compact when holes make up more than this fraction of the slots: a gather of the whole cache
# costs about as much as attending over that many extra slots for a few steps.
COMPACT_HOLE_FRACTION = 0.5
# Token fed into hole slots of a right-padded chunk; masked, so any valid id works.
FILLER_TOKEN = 0
# Models whose attention bias is computed from cache slot indices rather than positions or the mask.
SLOT_BIAS_MODELS = {"mpt"}  # ALiBi over slot indices
WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}
# The keyword models, decoder layers, attention modules and mask functions take the KV cache under:
# transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and both at once raise).
CACHE_NAMES = ("cache", "past_key_values")  # what `generate` may hand a custom loop the cache as, either version
CACHE_ARG = CACHE_NAMES[0] if CACHE_NAMES[0] in inspect.signature(create_causal_mask).parameters else CACHE_NAMES[1]


def needs_contiguous_slots(config) -> bool:
    """True when a hole inside a row would change what the model computes.

    Sliding-window and chunked attention count cache slots (key slot > query slot - window), so a
    hole inside the window pushes a real token out of it; so does a slot-indexed ALiBi bias. Such
    caches are compacted after every step that leaves a hole inside a row.
    """
    c = config.get_text_config()
    windowed = getattr(c, "sliding_window", None) is not None and getattr(c, "use_sliding_window", True) is not False
    layer_types = set(getattr(c, "layer_types", None) or [])
    return (
        c.model_type in SLOT_BIAS_MODELS
        or windowed
        or bool(layer_types & WINDOWED_LAYER_TYPES)
        or getattr(c, "attention_chunk_size", None) is not None
    )


class RaggedCache(DynamicCache):
    """A `DynamicCache` whose rows hold different numbers of valid tokens.

    slot_mask: `[B, S]` bool, True where the slot holds a token the row attends to.
    contiguous: compact whenever a row has a hole after its first valid slot (see
        `needs_contiguous_slots`); otherwise only when holes exceed COMPACT_HOLE_FRACTION.
    Every layer is a plain full-attention `DynamicLayer` (no config is passed), so no layer drops
    slots on its own; windows are applied by the model's own mask functions, over slots.
    """

    def __init__(self, slot_mask: torch.Tensor, contiguous: bool = False):
        super().__init__()
        self.slot_mask = slot_mask.bool()  # [B, S]
        self.contiguous = contiguous

    @property
    def lengths(self) -> torch.Tensor:
        """`[B]` number of valid tokens per row."""
        return self.slot_mask.sum(dim=1)

    @property
    def num_slots(self) -> int:
        return self.slot_mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.slot_mask.device

    def hole_fraction(self) -> float:
        return 1.0 - self.slot_mask.float().mean().item() if self.slot_mask.numel() else 0.0

    def add_slots(self, chunk_lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve `width` slots per row, the first `chunk_lengths[b]` of them valid.

        Returns the 2D attention mask over old + new slots `[B, S + width]` and the `position_ids`
        of the new slots `[B, width]` (hole slots repeat a valid position; they are masked).
        """
        start = self.lengths  # [B]
        offsets = torch.arange(width, device=start.device)  # [T]
        new_valid = offsets[None, :] < chunk_lengths[:, None]  # [B, T]
        self.slot_mask = torch.cat([self.slot_mask, new_valid], dim=1)
        position_ids = start[:, None] + offsets[None, :]  # [B, T]
        return self.slot_mask.long(), position_ids

    def rollback(self, keep: torch.Tensor) -> None:
        """Keep only the first `keep[b]` valid slots of row b; later valid slots become holes."""
        rank = self.slot_mask.long().cumsum(dim=1)  # [B, S] 1-based rank of each valid slot
        self.slot_mask &= rank <= keep[:, None]
        self._trim_tail()
        if self.hole_fraction() > COMPACT_HOLE_FRACTION or (self.contiguous and self._has_inner_holes()):
            self.compact()

    def _has_inner_holes(self) -> bool:
        """Any row with a hole after its first valid slot (left padding alone is fine)."""
        seen = self.slot_mask.long().cummax(dim=1).values.bool()  # [B, S] True from the first valid slot on
        return bool((seen & ~self.slot_mask).any())

    def _trim_tail(self) -> None:
        """Drop trailing slots that are holes in every row (at batch 1: every rejected slot)."""
        valid_cols = self.slot_mask.any(dim=0).nonzero()
        new_len = int(valid_cols[-1]) + 1 if len(valid_cols) else 0
        if new_len < self.num_slots:
            self.crop(new_len - self.num_slots)  # negative: number of slots to drop
            self.slot_mask = self.slot_mask[:, :new_len]

    def compact(self) -> None:
        """Move each row's valid slots to the right end of a cache of width max(lengths)."""
        src, new_mask = compaction_index(self.slot_mask)
        for layer in self.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = gather_slots(layer.keys, src), gather_slots(layer.values, src)
        self.slot_mask = new_mask

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (retire the others)."""
        self.batch_select_indices(rows)
        for layer in self.layers:  # transformers skips layers holding no slot: their batch must shrink too
            if layer.is_initialized and layer.keys.dim() == 4 and layer.keys.shape[0] != len(rows):
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.slot_mask = self.slot_mask[rows]
        self._trim_tail()

    # -- rows joining a running batch (continuous batching) -------------------------------------------
    def add_empty_rows(self, n: int) -> None:
        """Append n rows that hold no token yet (every slot a hole); a later forward fills them."""
        self.slot_mask = torch.cat([self.slot_mask, self.slot_mask.new_zeros(n, self.num_slots)], dim=0)
        for layer in self.layers:
            if layer.is_initialized and layer.keys.dim() == 4:  # [B, H, S, D], S = 0 included
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, *layer.keys.shape[1:])], dim=0)
                layer.values = torch.cat([layer.values, layer.values.new_zeros(n, *layer.values.shape[1:])], dim=0)

    def append_rows(self, other: "RaggedCache") -> None:
        """Append `other`'s rows after this cache's rows (rows prefilled apart, joining the batch).

        The narrower side is padded on the left with holes to the wider side's slots `[B + B', H, max(S, S'), D]`,
        like left padding: positions come from each row's valid slots, so no row's computation changes.
        """
        B, B2 = self.slot_mask.shape[0], other.slot_mask.shape[0]
        S, S2 = self.num_slots, other.num_slots
        W = max(S, S2)

        def widen(t: torch.Tensor, width: int) -> torch.Tensor:  # [b, H, s, D] -> [b, H, width, D], holes on the left
            return torch.cat([t.new_zeros(*t.shape[:2], width - t.shape[2], t.shape[3]), t], dim=2) if width > t.shape[2] else t

        while len(self.layers) < len(other.layers):
            self.layers.append(type(other.layers[len(self.layers)])())
        for mine, theirs in zip(self.layers, other.layers):
            mine_ok = mine.is_initialized and mine.keys.numel() > 0
            theirs_ok = theirs.is_initialized and theirs.keys.numel() > 0
            if not theirs_ok and not mine_ok:
                continue
            like = theirs if theirs_ok else mine  # shapes [*, H, *, D] and dtype for the side with no data
            for name in ("keys", "values"):
                ref = getattr(like, name)
                a = widen(getattr(mine, name), W) if mine_ok else ref.new_zeros(B, ref.shape[1], W, ref.shape[3])
                b = widen(getattr(theirs, name), W) if theirs_ok else ref.new_zeros(B2, ref.shape[1], W, ref.shape[3])
                setattr(mine, name, torch.cat([a, b.to(a.device)], dim=0))
            if not mine_ok:
                mine.dtype, mine.device, mine.is_initialized = like.keys.dtype, like.keys.device, True
        pad = lambda m, width: torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1)  # noqa: E731
        self.slot_mask = torch.cat([pad(self.slot_mask, W), pad(other.slot_mask.to(self.device), W)], dim=0)

    # -- undoing a forward that raised (fault isolation) ----------------------------------------------
    def checkpoint(self) -> tuple[int, torch.Tensor]:
        """What `restore` needs to undo the next forward: (slots, slot mask)."""
        return self.num_slots, self.slot_mask.clone()

    def restore(self, state: tuple[int, torch.Tensor]) -> None:
        """Drop whatever a forward that raised half-way appended (some layers may have grown, others not)."""
        slots, mask = state
        for layer in self.layers:
            if layer.is_initialized and layer.keys.numel() and layer.keys.shape[-2] > slots:
                layer.keys = layer.keys[..., :slots, :]
                layer.values = layer.values[..., :slots, :]
        self.slot_mask = mask


def _col_index(mask: torch.Tensor) -> torch.Tensor:
    return torch.arange(mask.shape[1], device=mask.device).expand_as(mask)


def compaction_index(slot_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's valid slots go when packed to the right end of a cache of width max(lengths).

    slot_mask: [B, S]. Returns src [B, W], the old slot of every new slot (0 under a hole), and the new
    slot mask [B, W] (left holes, like left padding). Example: [[1 0 1 1], [0 0 1 0]] -> src
    [[0 2 3], [0 0 2]], mask [[1 1 1], [0 0 1]].
    """
    lengths = slot_mask.sum(dim=1)  # [B]
    width = int(lengths.max()) if lengths.numel() else 0
    # Source index of every valid slot, in order.
    order = torch.argsort((~slot_mask).long() * slot_mask.shape[1] + _col_index(slot_mask), dim=1)
    dest = torch.arange(width, device=slot_mask.device)[None, :]  # [1, W]
    first = width - lengths[:, None]  # [B, 1] first valid column after compaction
    new_mask = dest >= first  # [B, W]
    src = torch.where(new_mask, order.gather(1, (dest - first).clamp(min=0)), 0)  # [B, W]
    return src, new_mask


def gather_slots(kv: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """kv [B, H, S, D], src [B, W] slot indices -> [B, H, W, D] (a new tensor)."""
    return kv.gather(2, src[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3]))


def forward_ragged(model, cache: RaggedCache, chunks: list[list[int]], all_logits: bool = True, forward=None) -> torch.Tensor:
    """Run `model` on one chunk of new tokens per row, appending them to `cache`.

    chunks: B lists of token ids, any lengths (an empty chunk adds only holes).
    forward: called instead of `model` with the same keyword arguments (e.g. the layer-parallel forward
        of drafters/fuzzy.py); it must return an object with `.logits`.
    Returns logits `[B, T, V]` for every slot of the right-padded chunk (T = longest chunk), or
    `[B, 1, V]` at each row's last chunk token when `all_logits` is False.
    A `PackedCache` goes through `forward_packed` (no padding, no holes).
    """
    if isinstance(cache, PackedCache):
        return forward_packed(model, cache, chunks, all_logits)
    device = model.device
    width = max(len(c) for c in chunks)
    lengths = torch.tensor([len(c) for c in chunks], device=device)  # [B]
    input_ids = torch.full((len(chunks), width), FILLER_TOKEN, dtype=torch.long, device=device)  # [B, T]
    for b, chunk in enumerate(chunks):
        input_ids[b, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    attention_mask, position_ids = cache.add_slots(lengths, width)
    past = cache.get_seq_length()
    cache_position = torch.arange(past, past + width, device=device)  # [T]
    last = (lengths - 1).clamp(min=0)  # [B] each row's last chunk slot (an empty row reads a hole)
    extra = {CACHE_ARG: cache}
    if not all_logits and model._supports_logits_to_keep():
        # Only the slots some row ends on: a prefill of L tokens computes U <= B rows of logits, not L.
        keep, last = torch.unique(last, return_inverse=True)  # [U], [B] index into keep
        extra["logits_to_keep"] = keep
    out = (forward or model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache_position=cache_position,
        use_cache=True,
        return_dict=True,
        **extra,
    )
    logits = out.logits  # [B, T, V], or [B, U, V] with logits_to_keep
    if all_logits:
        return logits
    return logits[torch.arange(len(chunks), device=device), last][:, None]  # [B, 1, V]


# --- Packed per-row cache: no padding, no holes (the ragged_attention path) ------------------------

# Spare slots a row gets when it outgrows its capacity: at least RESERVE_TOKENS, or GROWTH of its length
# (geometric growth: a row of length L is re-laid out O(log L) times, each copy amortised over L / 8 tokens).
RESERVE_TOKENS = 32
GROWTH = 0.125


def grow_capacity(length: int) -> int:
    """Slots given to a row that needs `length` slots and has too few."""
    return length + max(RESERVE_TOKENS, int(length * GROWTH))


class _PackedLayer:
    """One layer's keys `[total_slots, H_kv, D]` and values `[total_slots, H_kv, D_v]`, rows back to back."""

    is_sliding = False

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def move(self, src: torch.Tensor, dst: torch.Tensor, total: int) -> None:
        """New storage of `total` slots; slot src[i] of the old one goes to slot dst[i]."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(total, *old.shape[1:])
            new[dst] = old[src]
            setattr(self, name, new)


class PackedCache(Cache):
    """A KV cache that stores each row's tokens back to back, each row with its own length.

    Layout, per layer: keys `[total_slots, H_kv, D]` in flash-attention's varlen layout. Row b owns slots
    `starts[b] : starts[b] + capacity[b]` and uses the first `lengths[b]`; the rest is spare room for the
    next drafts (see `grow_capacity`). So

    * append (a forward through `forward_packed`) writes each row's new tokens after its own length;
    * rollback only lowers `lengths[b]` (rejected drafts are overwritten by the next append);
    * a row that outgrows its capacity re-lays out every layer (one copy, amortised by the spare room);
    * `select_rows` retires rows and compacts the rest, giving their memory back.

    Worked example: lengths [3, 1], capacity [4, 33] -> starts [0, 4], 37 slots; `cu_seqlens_k` [0, 4, 37]
    with `seqused_k` [3, 1] is what the attention kernel reads. No slot is padding for another row, so
    nothing grows with the longest row: memory is sum_b capacity[b], not B * max_b length[b].

    Only models whose attention goes through `transformers`' AttentionInterface can use it: the attention
    implementation `hf_spin_varlen` reads the metadata `forward_packed` passes (`spin_varlen=`).
    """

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        self.lengths: list[int] = [0] * batch_size  # [B] tokens held per row
        self.capacity: list[int] = [0] * batch_size  # [B] slots owned per row
        self._device = torch.device(device)
        self._write: torch.Tensor | None = None  # [total_q] slot of every new token of the running forward
        self._pending: list[int] | None = None  # lengths after the running forward

    # -- layout ------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def starts(self) -> list[int]:
        out, s = [], 0
        for c in self.capacity:
            out.append(s)
            s += c
        return out

    @property
    def total_slots(self) -> int:
        return sum(self.capacity)

    def _relayout(self, rows: list[int], capacity: list[int]) -> None:
        """Keep `rows` (in this order) with these capacities; move every initialised layer."""
        old_starts = self.starts
        new_starts = [sum(capacity[:i]) for i in range(len(rows))]
        src = [old_starts[r] + t for r in rows for t in range(self.lengths[r])]
        dst = [new_starts[i] + t for i, r in enumerate(rows) for t in range(self.lengths[r])]
        src_t = torch.tensor(src, dtype=torch.long, device=self._device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self._device)
        for layer in self.layers:
            if layer.is_initialized:
                layer.move(src_t, dst_t, sum(capacity))
        self.lengths = [self.lengths[r] for r in rows]
        self.capacity = list(capacity)

    def begin(self, q_lens: list[int]):
        """Plan one forward that appends q_lens[b] tokens to row b. Returns (`VarlenMetadata`,
        position_ids `[1, total_q]`); `commit` makes the new lengths current once the forward ran."""
        from .kernels.attention import VarlenMetadata

        if len(q_lens) != len(self.lengths):
            raise ValueError(f"{len(q_lens)} chunks for a cache of {len(self.lengths)} rows")
        new = [n + q for n, q in zip(self.lengths, q_lens)]
        if any(n > c for n, c in zip(new, self.capacity)):
            grown = [grow_capacity(n) if n > c else c for n, c in zip(new, self.capacity)]
            self._relayout(list(range(len(new))), grown)
        starts = self.starts
        write = [starts[b] + self.lengths[b] + t for b, q in enumerate(q_lens) for t in range(q)]
        positions = [self.lengths[b] + t for b, q in enumerate(q_lens) for t in range(q)]
        dev = self._device
        self._write = torch.tensor(write, dtype=torch.long, device=dev)
        self._pending = new
        cu_q = [0]
        for q in q_lens:
            cu_q.append(cu_q[-1] + q)
        meta = VarlenMetadata(
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.tensor(starts + [self.total_slots], dtype=torch.int32, device=dev),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(new, default=0),
            seqused_k=torch.tensor(new, dtype=torch.int32, device=dev),
        )
        return meta, torch.tensor(positions, dtype=torch.long, device=dev)[None]

    def commit(self) -> None:
        self.lengths, self._pending, self._write = self._pending, None, None

    # -- the Cache API the model calls -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states `[1, H_kv, total_q, D]` (the packed new tokens) -> all keys `[1, H_kv, total_slots, D]`
        (a view of the layer's `[total_slots, H_kv, D]` storage, which the attention function views back)."""
        if self._write is None:
            raise RuntimeError("PackedCache.update outside forward_packed: run the model through hf_spin.cache.forward_ragged")
        while len(self.layers) <= layer_idx:
            self.layers.append(_PackedLayer())
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            H_kv, D, D_v = key_states.shape[1], key_states.shape[3], value_states.shape[3]
            layer.keys = key_states.new_zeros(self.total_slots, H_kv, D)
            layer.values = value_states.new_zeros(self.total_slots, H_kv, D_v)
            layer.is_initialized = True
        layer.keys[self._write] = key_states[0].transpose(0, 1)  # [total_q, H_kv, D]
        layer.values[self._write] = value_states[0].transpose(0, 1)
        return layer.keys.permute(1, 0, 2).unsqueeze(0), layer.values.permute(1, 0, 2).unsqueeze(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    # -- per-row operations the engine uses ----------------------------------------------------------
    def rollback(self, keep) -> None:
        """Keep only the first keep[b] tokens of row b (no copy: the slots are reused by the next append)."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        self.lengths = [min(n, int(k)) for n, k in zip(self.lengths, keep)]

    def select_rows(self, rows) -> None:
        """Keep only `rows` (retire the others) and compact: retired rows' memory is given back."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        self._relayout(rows, [grow_capacity(self.lengths[r]) for r in rows])

    def add_empty_rows(self, n: int) -> None:
        """Append n rows holding no token (no slots yet: their first forward gives them capacity)."""
        self.lengths += [0] * n
        self.capacity += [0] * n

    def checkpoint(self) -> None:
        """Nothing to save: `forward_packed` leaves the lengths as they were when a forward raises."""

    def restore(self, state) -> None:
        self._write = self._pending = None

    # -- memory accounting -------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers (keys + values)."""
        return sum(
            (layer.keys[0].numel() * layer.keys.element_size() + layer.values[0].numel() * layer.values.element_size())
            for layer in self.layers
            if layer.is_initialized
        )

    def bytes_held(self) -> int:
        """Bytes this cache holds: every owned slot, spare room included."""
        return self.total_slots * self.bytes_per_token()

    def bytes_used(self) -> int:
        """Bytes of the tokens rows hold."""
        return sum(self.lengths) * self.bytes_per_token()

    def padded_bytes(self) -> int:
        """Bytes a rectangular cache `[B, H_kv, max_b length, D]` of the same rows would hold (a lower
        bound for `RaggedCache`, which also keeps holes)."""
        return len(self.lengths) * max(self.lengths, default=0) * self.bytes_per_token()


class _use_attention:
    """Run the model with `attn_implementation` = name for the duration of one forward."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        if self.previous != self.name:
            self.model.config._attn_implementation = self.name

    def __exit__(self, *exc):
        if self.previous != self.name:
            self.model.config._attn_implementation = self.previous


def check_packed_support(model, role: str = "model") -> None:
    """Refuse, with the reason, a model the packed path cannot run."""
    if not model._can_set_attn_implementation() or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"ragged_attention=True needs a model whose attention goes through transformers' AttentionInterface; "
            f"{role} {model.config.model_type!r} ({type(model).__name__}) has its own attention code. Use ragged_attention=False."
        )


def forward_packed(model, cache: PackedCache, chunks: list[list[int]], all_logits: bool = True) -> torch.Tensor:
    """`forward_ragged` on a `PackedCache`: one forward over the packed chunks `[1, total_q]`, no padding.

    Attention runs through `hf_spin_varlen` (switched on for this forward only) with the cache's
    `VarlenMetadata`. Returns logits like `forward_ragged`: `[B, T, V]` right-padded with zeros, or
    `[B, 1, V]` at each row's last chunk token (zeros for an empty chunk) when `all_logits` is False.
    """
    from .kernels.attention import ATTENTION_NAME

    device = model.device
    q_lens = [len(c) for c in chunks]
    total = sum(q_lens)
    if total == 0:
        raise ValueError("forward_packed needs at least one token in some chunk")
    meta, position_ids = cache.begin(q_lens)
    input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device)[None]  # [1, total_q]
    ends = meta.cu_seqlens_q[1:].long() - 1  # [B] packed index of each row's last token
    fed = torch.tensor(q_lens, device=cache.device) > 0  # [B]
    extra = {CACHE_ARG: cache}
    if not all_logits and model._supports_logits_to_keep():
        extra["logits_to_keep"] = ends[fed].to(device)  # [U]: one row of logits per non-empty row
    try:
        with _use_attention(model, ATTENTION_NAME):
            out = model(
                input_ids=input_ids,
                position_ids=position_ids.to(device),
                use_cache=True,
                return_dict=True,
                spin_varlen=meta,
                **extra,
            )
    except BaseException:
        cache._write = cache._pending = None  # the lengths stay as they were
        raise
    cache.commit()
    logits = out.logits[0]  # [total_q, V], or [U, V] with logits_to_keep
    B, V = len(chunks), logits.shape[-1]
    if all_logits:
        row = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens)).to(logits.device)  # [total_q]
        col = torch.cat([torch.arange(q) for q in q_lens]).to(logits.device)  # [total_q]
        padded = logits.new_zeros(B, max(q_lens), V)
        padded[row, col] = logits
        return padded
    result = logits.new_zeros(B, 1, V)
    fed = fed.to(logits.device)
    result[fed, 0] = logits if "logits_to_keep" in extra else logits[ends[fed].to(logits.device)]
    return result
