"""Packed per-row KV cache: no padding, no holes (the `AssistantPool(cache="packed")` path).

Each row's tokens lie back to back in flash-attention's varlen layout; the model runs on it through
`hf_spin.cache.forward.forward_packed` and the `hf_spin_varlen` attention implementation
(`hf_spin.kernels.attention`), which reads the `VarlenMetadata` that `PackedCache.begin` plans.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..host_syncs import to_device
from ..kernels.attention import VarlenMetadata
from .rectangular import per_device

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
        self._write = None  # per_device([total_q] slot of every new token of the running forward)
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
        src_on = per_device(to_device(src, self._device, torch.long))
        dst_on = per_device(to_device(dst, self._device, torch.long))
        for layer in self.layers:  # each on its layer's device (device_map)
            if layer.is_initialized:
                layer.move(src_on(layer.keys.device), dst_on(layer.keys.device), sum(capacity))
        self.lengths = [self.lengths[r] for r in rows]
        self.capacity = list(capacity)

    def begin(self, q_lens: list[int], depths: list[list[int]] | None = None):
        """Plan one forward that appends q_lens[b] tokens to row b. Returns (`VarlenMetadata`,
        position_ids `[1, total_q]`); `commit` makes the new lengths current once the forward ran.
        depths: per row, each new token's position after the row's length (default 0, 1, ...; a token
        tree's slots: 0 for the root, each node's depth after it)."""
        if len(q_lens) != len(self.lengths):
            raise ValueError(f"{len(q_lens)} chunks for a cache of {len(self.lengths)} rows")
        new = [n + q for n, q in zip(self.lengths, q_lens)]
        if any(n > c for n, c in zip(new, self.capacity)):
            grown = [grow_capacity(n) if n > c else c for n, c in zip(new, self.capacity)]
            self._relayout(list(range(len(new))), grown)
        starts = self.starts
        write = [starts[b] + self.lengths[b] + t for b, q in enumerate(q_lens) for t in range(q)]
        depths = depths if depths is not None else [range(q) for q in q_lens]
        positions = [self.lengths[b] + d for b in range(len(q_lens)) for d in depths[b]]
        dev = self._device
        self._write = per_device(to_device(write, dev, torch.long))
        self._pending = new
        cu_q = [0]
        for q in q_lens:
            cu_q.append(cu_q[-1] + q)
        meta = VarlenMetadata(
            cu_seqlens_q=to_device(cu_q, dev, torch.int32),
            cu_seqlens_k=to_device(starts + [self.total_slots], dev, torch.int32),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(new, default=0),
            seqused_k=to_device(new, dev, torch.int32),
        )
        return meta, to_device(positions, dev, torch.long)[None]

    def commit(self) -> None:
        """The planned forward ran: its new lengths become current."""
        self.lengths, self._pending, self._write = self._pending, None, None

    def abort(self) -> None:
        """The planned forward raised: forget the plan (the lengths stay as they were)."""
        self._write = self._pending = None

    # -- the Cache API the model calls -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states `[1, H_kv, total_q, D]` (the packed new tokens) -> all keys `[1, H_kv, total_slots, D]`
        (a view of the layer's `[total_slots, H_kv, D]` storage, which the attention function views back)."""
        if self._write is None:
            raise RuntimeError(
                "PackedCache.update outside forward_packed: run the model through hf_spin.cache.forward_ragged"
            )
        while len(self.layers) <= layer_idx:
            self.layers.append(_PackedLayer())
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            H_kv, D, D_v = key_states.shape[1], key_states.shape[3], value_states.shape[3]
            layer.keys = key_states.new_zeros(self.total_slots, H_kv, D)
            layer.values = value_states.new_zeros(self.total_slots, H_kv, D_v)
            layer.is_initialized = True
        write = self._write(layer.keys.device)  # [total_q] on this layer's device
        layer.keys[write] = key_states[0].transpose(0, 1)  # [total_q, H_kv, D]
        layer.values[write] = value_states[0].transpose(0, 1)
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
        """Keep only the first keep[b] tokens of row b (a list, or a tensor; no copy: the slots are reused
        by the next append)."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        self.lengths = [min(n, int(k)) for n, k in zip(self.lengths, keep)]

    def keep_paths(self, bases: list[int], paths: list[list[int]]) -> None:
        """After a token-tree forward (`forward_tree`): row b held bases[b] tokens before it, then the
        root and the tree's nodes; keep the root and the accepted nodes paths[b] (node indices, root's
        child first), moved down to follow the root contiguously. One gather and scatter per layer."""
        starts = self.starts
        src = [starts[b] + base + 1 + node for b, (base, path) in enumerate(zip(bases, paths)) for node in path]
        dst = [starts[b] + base + 1 + i for b, (base, path) in enumerate(zip(bases, paths)) for i in range(len(path))]
        self.lengths = [base + 1 + len(path) for base, path in zip(bases, paths)]
        if src == dst:
            return
        src_on = per_device(to_device(src, self._device, torch.long))
        dst_on = per_device(to_device(dst, self._device, torch.long))
        for layer in self.layers:
            if layer.is_initialized:
                device = layer.keys.device
                layer.keys[dst_on(device)] = layer.keys[src_on(device)]  # the right side is gathered first
                layer.values[dst_on(device)] = layer.values[src_on(device)]

    def select_rows(self, rows) -> None:
        """Keep only `rows` (a host tensor or a list; retire the others) and compact: retired rows' memory is given
        back."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        self._relayout(rows, [grow_capacity(self.lengths[r]) for r in rows])

    def add_empty_rows(self, n: int) -> None:
        """Append n rows holding no token (no slots yet: their first forward gives them capacity)."""
        self.lengths += [0] * n
        self.capacity += [0] * n

    def checkpoint(self) -> None:
        """Nothing to save: `forward_packed` leaves the lengths as they were when a forward raises."""

    def restore(self, state) -> None:
        self.abort()

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
        bound for `RectangularCache`, which also keeps holes)."""
        return len(self.lengths) * max(self.lengths, default=0) * self.bytes_per_token()
