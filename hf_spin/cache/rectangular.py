"""Ragged rows on a rectangular KV cache.

`transformers`' `DynamicCache` holds `[B, H, S, D]` tensors and `crop` cuts every row alike. After a
verification step each row keeps its own number of tokens, so `RectangularCache` keeps a slot mask beside
the tensors: a slot is *valid* (attended to) or a *hole* (attention mask 0). Rejected draft slots
become holes; explicit per-row `position_ids` keep the positions of valid tokens contiguous, so a
row with holes computes exactly what it would without them. Holes are trimmed when they form a
common tail and compacted away when they pile up.

Worked example, B = 2, after a step that fed 3 slots per row and kept 3 for row 0, 1 for row 1:

    slot_mask  [[1 1 1 | 1 1 1],      lengths [5, 3]
                [0 1 1 | 1 0 0]]      (row 1 was left-padded by one)

The model runs on it through `hf_spin.cache.forward.forward_ragged`.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache

from ..host_syncs import to_device
from .encoder_rows import EncoderRows

# Compact when holes make up more than this fraction of the slots: a gather of the whole cache
# costs about as much as attending over that many extra slots for a few steps.
COMPACT_HOLE_FRACTION = 0.5
# Models whose attention bias is computed from cache slot indices rather than positions or the mask.
# mpt: ALiBi over slot indices; the T5 family: relative position buckets between slot indices (right-aligned
# contiguous rows keep every query-key distance).
SLOT_BIAS_MODELS = {"mpt", "t5", "mt5", "umt5"}
WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}


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


class RectangularCache(DynamicCache):
    """A `DynamicCache` whose rows hold different numbers of valid tokens.

    slot_mask: `[B, S]` bool on the model's device, True where the slot holds a token the row attends to.
    contiguous: compact whenever a row has a hole after its first valid slot (see
        `needs_contiguous_slots`); otherwise only when holes exceed COMPACT_HOLE_FRACTION.
    encoder: for the decoder of an encoder-decoder model, its rows' `EncoderRows` (encoder output and
        cross-attention K/V), which retire and join with the rows (cache/encoder_rows.py); None otherwise.
    Every layer is a plain full-attention `DynamicLayer` (no config is passed), so no layer drops
    slots on its own; windows are applied by the model's own mask functions, over slots.

    The slot mask is kept twice: on the host, where every decision about slots is taken (trim,
    compact, hole fraction) without reading the device, and on the device, a copy of it sent with
    `to_device` after each change (no sync). Code that assigns `slot_mask` itself (StreamingCache)
    makes the host copy stale; it is read back from the device when next needed.
    """

    def __init__(self, slot_mask: torch.Tensor, contiguous: bool = False, encoder: EncoderRows | None = None):
        super().__init__()
        self.encoder = encoder  # an encoder-decoder model's rows: encoder output and cross K/V, following the rows
        self.slot_mask = slot_mask.bool()  # [B, S] on the device
        self._host = (
            torch.zeros(slot_mask.shape, dtype=torch.bool) if slot_mask.numel() == 0 else slot_mask.bool().cpu()
        )  # [B, S]
        self.contiguous = contiguous
        self.single_token_forward = False  # set by forward_ragged around a one-token-per-row forward

    @property
    def slot_mask(self) -> torch.Tensor:
        return self._slot_mask

    @slot_mask.setter
    def slot_mask(self, mask: torch.Tensor) -> None:
        self._slot_mask, self._host = mask, None  # the host copy is read back when next needed

    @property
    def host_mask(self) -> torch.Tensor:
        """`[B, S]` the slot mask on the host."""
        if self._host is None:
            self._host = self._slot_mask.cpu()
        return self._host

    def _set_mask(self, host: torch.Tensor) -> None:
        """The host mask changed: send the device its copy."""
        self._slot_mask, self._host = to_device(host, self._slot_mask.device), host

    @property
    def is_compileable(self) -> bool:
        """True during one-token-per-row forwards only. For a one-token query `transformers` asks whether
        its SDPA mask can be dropped, by reading the whole 2D mask on the host (a sync per draft token);
        a compileable cache is never asked, and the mask it builds instead is the same mask."""
        return self.single_token_forward

    @property
    def lengths(self) -> torch.Tensor:
        """`[B]` number of valid tokens per row (on the device)."""
        return self.slot_mask.sum(dim=1)

    @property
    def host_lengths(self) -> list[int]:
        """`[B]` number of valid tokens per row."""
        return self.host_mask.sum(dim=1).tolist()

    @property
    def num_slots(self) -> int:
        return self.slot_mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.slot_mask.device

    def has_holes(self) -> bool:
        """Any slot of any row not valid (read on the host)."""
        return not bool(self.host_mask.all())

    def hole_fraction(self) -> float:
        return 1.0 - self.host_mask.float().mean().item() if self.host_mask.numel() else 0.0

    def add_slots(self, chunk_lengths, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve `width` slots per row, the first `chunk_lengths[b]` of them valid (a list, or a tensor).

        Returns the 2D attention mask over old + new slots `[B, S + width]` and the `position_ids`
        of the new slots `[B, width]` (hole slots repeat a valid position; they are masked).
        """
        chunk_lengths = _on_host(chunk_lengths)  # [B]
        offsets = torch.arange(width)  # [T]
        new_valid = offsets[None, :] < chunk_lengths[:, None]  # [B, T]
        position_ids = self.host_mask.sum(dim=1)[:, None] + offsets[None, :]  # [B, T] from each row's length
        self._set_mask(torch.cat([self.host_mask, new_valid], dim=1))
        return self.slot_mask.long(), to_device(position_ids, self.device)

    def rollback(self, keep) -> None:
        """Keep only the first `keep[b]` valid slots of row b (a list, or a tensor); later valid slots become holes."""
        keep = _on_host(keep)  # [B]
        mask = self.host_mask
        rank = mask.long().cumsum(dim=1)  # [B, S] 1-based rank of each valid slot
        self._set_mask(mask & (rank <= keep[:, None]))
        self._dropped()

    def keep_paths(self, bases: list[int], paths: list[list[int]]) -> None:
        """After a token-tree forward (`forward_tree`): row b's valid slots are its bases[b] tokens, then
        the root and the tree's nodes in node order; keep the root and the accepted nodes paths[b]
        (holes elsewhere). They stay where they are: their positions are already the path's."""
        mask = self.host_mask
        rank = mask.long().cumsum(dim=1)  # [B, S] 1-based rank of each valid slot
        keep = mask & (rank <= torch.tensor(bases)[:, None] + 1)  # [B, S] the row's tokens and its root
        for b, (base, path) in enumerate(zip(bases, paths)):
            keep[b] |= mask[b] & torch.isin(rank[b], torch.tensor([base + 2 + node for node in path], dtype=rank.dtype))
        self._set_mask(keep)
        self._dropped()

    def keep_columns(self, start: int, columns: list[list[int]]) -> None:
        """Keep each row's valid slots before column `start` and, of those from `start` on, only the
        columns `columns[b]` (a model drafter keeping one path of the tree it grew); the rest become holes."""
        mask = self.host_mask
        keep = mask.clone()
        keep[:, start:] = False
        for b, cols in enumerate(columns):
            cols = torch.tensor(cols, dtype=torch.long)
            keep[b, cols] = mask[b, cols]
        self._set_mask(keep)
        self._dropped()

    def _dropped(self) -> None:
        """Valid slots became holes: drop trailing hole columns; compact when holes pile up (or at once
        for a cache that must stay contiguous)."""
        self._trim_tail()
        if self.hole_fraction() > COMPACT_HOLE_FRACTION or (self.contiguous and self._has_inner_holes()):
            self.compact()

    def _has_inner_holes(self) -> bool:
        """Any row with a hole after its first valid slot (left padding alone is fine)."""
        mask = self.host_mask
        seen = mask.long().cummax(dim=1).values.bool()  # [B, S] True from the first valid slot on
        return bool((seen & ~mask).any())

    def _trim_tail(self) -> None:
        """Drop trailing slots that are holes in every row (at batch 1: every rejected slot)."""
        valid_cols = self.host_mask.any(dim=0).nonzero()
        new_len = int(valid_cols[-1]) + 1 if len(valid_cols) else 0
        if new_len < self.num_slots:
            self.crop(new_len - self.num_slots)  # negative: number of slots to drop
            self._set_mask(self.host_mask[:, :new_len])

    def compact(self) -> None:
        """Move each row's valid slots to the right end of a cache of width max(lengths)."""
        src, new_mask = compaction_index(self.host_mask)
        src_on = per_device(to_device(src, self.device))
        for layer in self.layers:  # each on its layer's device (device_map)
            if layer.is_initialized and layer.keys.numel():
                index = src_on(layer.keys.device)
                layer.keys, layer.values = gather_slots(layer.keys, index), gather_slots(layer.values, index)
        self._set_mask(new_mask)

    def select_rows(self, rows) -> None:
        """Keep only `rows` (a host tensor or a list; retire the others)."""
        rows = _on_host(rows)
        rows_on = per_device(to_device(rows, self.device))
        for layer in self.layers:  # layers holding no slot too (S = 0): their batch must shrink as well
            if layer.is_initialized and layer.keys.dim() == 4:
                index = rows_on(layer.keys.device)
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self._set_mask(self.host_mask[rows])
        self._trim_tail()
        if self.encoder is not None:
            self.encoder.select_rows(rows)

    # -- rows joining a running batch (continuous batching) -------------------------------------------
    def add_empty_rows(self, n: int) -> None:
        """Append n rows that hold no token yet (every slot a hole); a later forward fills them."""
        self._set_mask(torch.cat([self.host_mask, self.host_mask.new_zeros(n, self.num_slots)], dim=0))
        for layer in self.layers:
            if layer.is_initialized and layer.keys.dim() == 4:  # [B, H, S, D], S = 0 included
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, *layer.keys.shape[1:])], dim=0)
                layer.values = torch.cat([layer.values, layer.values.new_zeros(n, *layer.values.shape[1:])], dim=0)

    def append_rows(self, other: "RectangularCache") -> None:
        """Append `other`'s rows after this cache's rows (rows prefilled apart, joining the batch).

        The narrower side is padded on the left with holes to the wider side's slots `[B + B', H, max(S, S'), D]`,
        like left padding: positions come from each row's valid slots, so no row's computation changes.
        """
        B, B2 = self.slot_mask.shape[0], other.slot_mask.shape[0]
        S, S2 = self.num_slots, other.num_slots
        W = max(S, S2)

        def widen(t: torch.Tensor, width: int) -> torch.Tensor:  # [b, H, s, D] -> [b, H, width, D], holes on the left
            return (
                torch.cat([t.new_zeros(*t.shape[:2], width - t.shape[2], t.shape[3]), t], dim=2)
                if width > t.shape[2]
                else t
            )

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
        self._set_mask(torch.cat([pad(self.host_mask, W), pad(other.host_mask, W)], dim=0))
        if self.encoder is not None:
            self.encoder = EncoderRows.cat([self.encoder, other.encoder])

    # -- undoing a forward that raised (fault isolation) ----------------------------------------------
    def checkpoint(self) -> tuple[int, torch.Tensor]:
        """What `restore` needs to undo the next forward: (slots, slot mask)."""
        return self.num_slots, self.host_mask.clone()

    def restore(self, state: tuple[int, torch.Tensor]) -> None:
        """Drop whatever a forward that raised half-way appended (some layers may have grown, others not)."""
        slots, mask = state
        for layer in self.layers:
            if layer.is_initialized and layer.keys.numel() and layer.keys.shape[-2] > slots:
                layer.keys = layer.keys[..., :slots, :]
                layer.values = layer.values[..., :slots, :]
        self._set_mask(mask)


def _on_host(values) -> torch.Tensor:
    """A [B] list or tensor of counts or indices as a long host tensor (a device tensor is read back)."""
    return values.long().cpu() if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.long)


def per_device(index: torch.Tensor) -> Callable[[torch.device], torch.Tensor]:
    """`index` on any device, copied once per device that asks: under `device_map` each layer's KV lives on
    its own device, and CUDA refuses to gather or index with a tensor from another GPU.

    Example: on = per_device(src); on(layer.keys.device) for every layer -> one copy per device, not per layer.
    """
    copies = {index.device: index}

    def on(device: torch.device) -> torch.Tensor:
        if device not in copies:
            copies[device] = index.to(device)
        return copies[device]

    return on


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
