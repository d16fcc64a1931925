"""Static per-row KV cache: storage allocated once, rows at their own lengths, fixed-shape forwards.

`StaticRowCache` holds, per layer, keys `[R, H, C, D]` and values `[R, H, C, D_v]` for R row slots of
capacity C. Each engine row lives in one slot (`slot_of`); its tokens fill slots `0 .. length - 1`
contiguously (no holes), so a committed token's position is its slot index. A forward
(`static_forward.forward_static`) feeds every slot the same number T of query slots and writes them at
`length .. length + T - 1` with a scatter whose shapes never depend on the lengths. Where the T new tokens
sit and what they see is the query layout, device buffers of fixed shape: each query slot's depth (position
length + depth) and which of the T new slots it sees; a chain's (depth t, causal) unless a token tree's is
written there (`use_layout`). A key before the row's length is visible to every query. The 4D mask is built
on the device from the lengths and the layout, so the lengths, acceptance, trees and the rows present change
no shape: the forward can be compiled once per (R, T, C).

Rollback lowers lengths (rejected slots are overwritten by the next write); after a tree, `keep_paths` moves
the accepted path's KV down to the slots after the root, so the row stays contiguous. Rows leave by freeing
their slot and join into a free one. Capacity and row slots grow in buckets, by reallocation, outside any
compiled region (`reserve`, `add_empty_rows`). gpt-fast's batch-1 static cache, per row.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..host_syncs import to_device
from .capture import GraphedMoves
from .rectangular import RectangularCache, per_device

# Capacity grows in multiples of this many tokens: every growth reallocates the storage (and, compiled,
# recompiles the forward), so it should be rare; memory wasted is below one bucket per row slot.
CAPACITY_BUCKET = 256


def capacity_bucket(tokens: int) -> int:
    """Slots per row to allocate for `tokens` tokens: the next multiple of CAPACITY_BUCKET."""
    return max(1, -(-tokens // CAPACITY_BUCKET)) * CAPACITY_BUCKET


def row_bucket(rows: int) -> int:
    """Row slots to allocate for `rows` rows: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, rows - 1).bit_length()


def query_bucket(tokens: int) -> int:
    """Query slots of a forward over chunks of at most `tokens` tokens: 1, 2, 3, 5, 9, 17, ... (2^i + 1,
    so [last token] + a draft of k = 2^i tokens needs no padding), or the next multiple of 64 past 65."""
    if tokens <= 2:
        return max(tokens, 1)
    if tokens > 65:
        return -(-tokens // 64) * 64
    return (1 << (tokens - 2).bit_length()) + 1


class _StaticLayer:
    """One layer's keys `[R, H, C, D]` and values `[R, H, C, D_v]`, allocated once (static addresses)."""

    is_sliding = False
    is_compileable = True

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def allocate(self, rows: int, capacity: int, keys_like: torch.Tensor, values_like: torch.Tensor) -> None:
        """Zeros for `rows` x `capacity` slots shaped after `keys_like` `[*, H, *, D]` (and `values_like`)."""
        self.keys = keys_like.new_zeros(rows, keys_like.shape[1], capacity, keys_like.shape[3])
        self.values = values_like.new_zeros(rows, values_like.shape[1], capacity, values_like.shape[3])
        self.is_initialized = True
        _mark_static(self.keys, self.values)

    def resize(self, rows: int, capacity: int) -> None:
        """New storage of `rows` x `capacity` slots keeping what the old one holds (rows and slots that fit)."""
        old_keys, old_values = self.keys, self.values
        self.allocate(rows, capacity, old_keys, old_values)
        r, c = min(rows, old_keys.shape[0]), min(capacity, old_keys.shape[2])
        self.keys[:r, :, :c] = old_keys[:r, :, :c]
        self.values[:r, :, :c] = old_values[:r, :, :c]


def move_slots(layers: list[_StaticLayer], index: torch.Tensor) -> None:
    """index `[3, P]` (slot, from, to): each layer's keys and values at (slot, from) copied to (slot, to), every
    move read before any is written (a layer's KV may live on another device than `index`)."""
    on = per_device(index)
    for layer in layers:
        r, a, b = on(layer.keys.device)
        for kv in (layer.keys, layer.values):
            kv[r, :, b] = kv[r, :, a]  # [P, H, D]


def captures_moves(device: torch.device) -> bool:
    """Whether `keep_paths` on `device` replays its KV moves from a captured graph: on CUDA, where each eager
    op costs a launch (a test's stand-in capture turns it on off CUDA)."""
    return device.type == "cuda"


def _chain_layout(rows: int, width: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A chain's query layout for `rows` slots of `width` query slots: depths `[R, T]` (query t at depth t) and
    which new slots each query sees `[R, T, T]` bool (u <= t)."""
    depths = torch.arange(width, device=device).repeat(rows, 1)
    visible = torch.ones(width, width, dtype=torch.bool, device=device).tril().repeat(rows, 1, 1)
    return depths, visible


def _mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these tensors keep their address (in-place updates only), so CUDA graphs need not copy
    them into graph-owned buffers at every replay; a no-op while tracing."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class StaticRowCache(Cache):
    """A static KV cache of row slots, each row at its own length; see the module docstring.

    slot_of: `[B]` the storage slot of each engine row (batch order), on the host.
    host_lengths: `[R]` tokens held per slot (0 for a free slot), on the host: every decision is taken there.
    slot_lengths: `[R]` the same on the device, updated in place (a static address) after each change.
    width: query slots of the forwards so far; it only grows (`query_width`), so that a step with shorter
        drafts reuses the compiled forward of the longest.
    query_depths, query_visible: `[R, T]` long and `[R, T, T]` bool, the layout of the next forward's T query
        slots (`use_layout`): one pair of static-address buffers per width, a chain's unless a tree's is written.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        self._device = torch.device(device)
        self.capacity = 0
        self.slot_of: list[int] = []
        self.host_lengths: list[int] = []
        self.slot_lengths = torch.zeros(0, dtype=torch.long, device=self._device)  # [R]
        self.width = 0
        # width -> [depths, visible, holds a tree, the chain's layout on the host]; per row-slot count
        self._layouts: dict[int, list] = {}
        self.query_depths = self.query_visible = None
        self._moves: GraphedMoves | None = None  # keep_paths' captured moves, on CUDA

    # -- layout ---------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_slots(self) -> int:
        """R: row slots allocated (the batch of every forward)."""
        return len(self.host_lengths)

    @property
    def lengths(self) -> list[int]:
        """`[B]` tokens held per engine row."""
        return [self.host_lengths[s] for s in self.slot_of]

    @property
    def is_compileable(self) -> bool:
        return True

    def _push(self) -> None:
        """The host lengths changed: copy them into the device tensor (no wait; same address)."""
        host = torch.tensor(self.host_lengths, dtype=torch.long)
        if self.slot_lengths.shape[0] != host.shape[0]:
            self.slot_lengths = torch.zeros(host.shape[0], dtype=torch.long, device=self._device)
            _mark_static(self.slot_lengths)
        self.slot_lengths.copy_(to_device(host, self._device), non_blocking=True)

    def _resize(self, rows: int, capacity: int) -> None:
        if rows != self.num_slots:
            self._layouts.clear()  # sized per row slot
        for layer in self.layers:
            if layer.is_initialized:
                layer.resize(rows, capacity)
        self.host_lengths += [0] * (rows - len(self.host_lengths))
        self.capacity = capacity
        self._push()

    def reserve(self, width: int, capacity: int = 0) -> None:
        """Make room for a forward of `width` query slots in every slot (free ones included: they are fed
        too): capacity >= longest + width and >= `capacity`, grown by CAPACITY_BUCKET (a reallocation, never
        compiled)."""
        need = max(max(self.host_lengths, default=0) + width, capacity)
        if need > self.capacity:
            self._resize(self.num_slots, capacity_bucket(need))

    def query_width(self, longest: int) -> int:
        """Query slots for a forward whose longest chunk has `longest` tokens (sticky, bucketed)."""
        self.width = max(self.width, query_bucket(longest))
        return self.width

    # -- the Cache API the model calls ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states `[R, H, T, D]` -> all keys `[R, H, C, D]`: slot s's T new keys are written at
        slots `slot_lengths[s] + t` by a scatter of fixed shape. The model masks what a query may see."""
        while len(self.layers) <= layer_idx:
            self.layers.append(_StaticLayer())
        layer = self.layers[layer_idx]
        if not layer.is_initialized:  # a first forward with no prefilled KV (never compiled: see forward_static)
            layer.allocate(self.num_slots, self.capacity, key_states, value_states)
        R, _, T, _ = key_states.shape
        if R != layer.keys.shape[0]:
            raise ValueError(f"StaticRowCache.update got {R} rows for a cache of {layer.keys.shape[0]} row slots")
        write = self.slot_lengths[:, None] + torch.arange(T, device=self.slot_lengths.device)  # [R, T]
        index = write.to(layer.keys.device)[:, None, :, None]  # [R, 1, T, 1]
        layer.keys.scatter_(2, index.expand(-1, key_states.shape[1], -1, key_states.shape[3]), key_states)
        layer.values.scatter_(2, index.expand(-1, value_states.shape[1], -1, value_states.shape[3]), value_states)
        return layer.keys, layer.values

    def use_layout(self, width: int, trees: dict[int, tuple[list[int], torch.Tensor]] | None = None) -> None:
        """Set the layout of the next forward's `width` query slots (outside any compiled region): a chain's
        (query t at depth t, seeing new slots u <= t), or for the slots in `trees` (slot -> (depths `[n]`,
        visible `[n, n]` bool, n <= width), a token tree's (`TokenTree.ancestor_mask`); the slots past a
        tree's n keep a chain's. Writes the device buffers only when a tree is written or cleared."""
        if width not in self._layouts:
            depths, visible = _chain_layout(self.num_slots, width, self._device)
            _mark_static(depths, visible)
            self._layouts[width] = [depths, visible, False, None]
        layout = self._layouts[width]
        if trees or layout[2]:
            if layout[3] is None:  # the chain's layout on the host, copied for each tree step (not rebuilt)
                layout[3] = _chain_layout(self.num_slots, width)
            depths, visible = (t.clone() for t in layout[3])  # the trees written in
            for slot, (depth, mask) in (trees or {}).items():
                n = len(depth)
                depths[slot, :n] = torch.tensor(depth)
                visible[slot, :n, :n] = mask
            layout[0].copy_(to_device(depths, self._device), non_blocking=True)
            layout[1].copy_(to_device(visible, self._device), non_blocking=True)
            layout[2] = bool(trees)
        self.query_depths, self.query_visible = layout[0], layout[1]

    def query_inputs(self, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(position_ids `[R, T]`, additive 4D mask `[R, 1, T, C]` in `dtype`) of a forward of `width`
        query slots, from the device lengths and the layout (`use_layout`) alone: query t of slot s sits at
        position length[s] + depth[s, t] and sees every key before length[s] and the new slots
        length[s] + u that the layout lets it (a chain: u <= t, so keys j <= length[s] + t)."""
        depths, seen = self.query_depths, self.query_visible  # [R, T], [R, T, T]
        assert depths.shape == (self.num_slots, width), f"a layout of {tuple(depths.shape)} for {width} query slots"
        positions = self.slot_lengths[:, None] + depths  # [R, T]
        rel = torch.arange(self.capacity, device=self._device)[None, :] - self.slot_lengths[:, None]  # [R, C]
        new = seen.gather(2, rel.clamp(0, width - 1)[:, None, :].expand(-1, width, -1))  # [R, T, C]
        visible = (rel < 0)[:, None, :] | (new & (rel < width)[:, None, :])  # [R, T, C]
        zero, lowest = (torch.full((), v, dtype=dtype, device=self._device) for v in (0, torch.finfo(dtype).min))
        return positions, torch.where(visible, zero, lowest)[:, None]  # one pass: a prefill's [R, T, C] is large

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row (host). Forwards on this cache pass explicit positions and masks, never this."""
        return max(self.host_lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    # -- per-row operations the engine uses (RowCache) ----------------------------------------------------
    def advance(self, counts: list[int]) -> None:
        """After a forward: row b's first counts[b] query slots become its tokens (the rest, padding, are
        overwritten by the next write)."""
        for s, n in zip(self.slot_of, counts):
            self.host_lengths[s] += n
        self._push()

    def rollback(self, keep) -> None:
        """Keep only the first keep[b] tokens of row b (a list, or a tensor; the slots are reused)."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        for s, k in zip(self.slot_of, keep):
            self.host_lengths[s] = min(self.host_lengths[s], int(k))
        self._push()

    def keep_paths(self, bases: list[int], paths: list[list[int]]) -> None:
        """After a token-tree forward: row b holds bases[b] tokens, its root, then the tree's nodes in node
        order; keep the root and the accepted nodes paths[b], moved down to the slots after the root (the
        path's node j at position base + 1 + j already: only its KV moves). A row fed nothing keeps its base."""
        moves = []  # [P] (slot, from, to)
        for s, base, path in zip(self.slot_of, bases, paths):
            moves += [(s, base + 1 + node, base + 1 + j) for j, node in enumerate(path) if node != j]
            self.host_lengths[s] = min(self.host_lengths[s], base + 1 + len(path))
        if moves:
            self._move(moves)
        self._push()

    def _move(self, moves: list[tuple[int, int, int]]) -> None:
        """Each (slot, from, to) of `moves`: every layer's KV at `from` copied to `to` (all read before any is
        written). On CUDA from one captured graph (`GraphedMoves`): eagerly they are two indexing ops per layer and
        tensor, a launch each, most likely what a tree step cost more than a chain's on a host-bound H200."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        here = self.slot_lengths.device  # the cache's device with its index ("cuda" is "cuda:0" there)
        if captures_moves(here) and all(layer.keys.device == here for layer in layers):
            if self._moves is None:
                self._moves = GraphedMoves(move_slots)
            if self._moves(layers, moves, self.capacity):
                return
        move_slots(layers, to_device(list(zip(*moves)), self._device, torch.long))

    def select_rows(self, rows) -> None:
        """Keep only `rows` (host; in their new order); the others' slots become free. No copy."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        kept = [self.slot_of[r] for r in rows]
        for s in set(self.slot_of) - set(kept):
            self.host_lengths[s] = 0
        self.slot_of = kept
        self._push()

    def add_empty_rows(self, n: int) -> None:
        """Append n rows holding no token, in free slots; with too few, row slots grow to the next
        `row_bucket` (a reallocation)."""
        free = sorted(set(range(self.num_slots)) - set(self.slot_of))
        if len(free) < n:
            rows = row_bucket(len(self.slot_of) + n)
            self._resize(rows, self.capacity)
            free = sorted(set(range(rows)) - set(self.slot_of))
        for s in free[:n]:
            self.host_lengths[s] = 0
        self.slot_of += free[:n]
        self._push()

    def append_rows(self, other: RectangularCache, min_capacity: int = 0) -> None:
        """Append `other`'s rows (a prefill's `RectangularCache`, left holes allowed) as new rows: each row's
        valid slots are copied, in order, to the start of a free slot. Capacity grows to hold
        `min_capacity` tokens per row (the rows' length limit, say) if it does not already."""
        mask = other.host_mask  # [n, S]
        n, S = mask.shape
        lengths = mask.sum(dim=1).tolist()  # [n]
        self.add_empty_rows(n)
        slots = self.slot_of[len(self.slot_of) - n :]
        need = max([min_capacity, *lengths])
        if need > self.capacity:
            self._resize(self.num_slots, capacity_bucket(need))
        W = max(lengths, default=0)
        cols = torch.arange(S).expand(n, S)
        order = torch.argsort((~mask).long() * S + cols, dim=1)[:, :W]  # [n, W] each row's valid slots first
        src_on = per_device(to_device(order, self._device))
        dst_on = per_device(to_device(slots, self._device, torch.long))
        while len(self.layers) < len(other.layers):
            self.layers.append(_StaticLayer())
        for mine, theirs in zip(self.layers, other.layers):
            if not (theirs.is_initialized and theirs.keys.numel()):
                continue
            if not mine.is_initialized:
                mine.allocate(self.num_slots, self.capacity, theirs.keys, theirs.values)
            device = mine.keys.device
            for name in ("keys", "values"):
                kv = getattr(theirs, name).to(device)  # [n, H, S, D]
                src = src_on(device)[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3])
                getattr(mine, name)[dst_on(device), :, :W] = kv.gather(2, src)  # [n, H, W, D]
        for s, length in zip(slots, lengths):
            self.host_lengths[s] = length
        self._push()

    # -- undoing a forward that raised (fault isolation) ------------------------------------------------
    def checkpoint(self) -> tuple[list[int], list[int]]:
        """What `restore` needs: (host lengths, slot map). A forward writes only past the lengths."""
        return list(self.host_lengths), list(self.slot_of)

    def restore(self, state: tuple[list[int], list[int]]) -> None:
        lengths, slot_of = state
        self.host_lengths = lengths + [0] * (self.num_slots - len(lengths))
        self.slot_of = slot_of
        self._push()


# Per model, the StaticRowCache its last call gave back (`give_back`): the next call with the same row-slot bucket
# takes it (`take_cache`), so the storage keeps its addresses and the forwards captured over it (inductor's CUDA
# graphs, cuda_graphs.py's) replay without recording again, as `transformers` keeps its static cache on the model
# between `generate` calls. Only where the forwards compile: an eager forward gains nothing from the addresses.
_SPARE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def take_cache(model, rows: int) -> StaticRowCache:
    """An empty StaticRowCache for a new batch of `rows` rows of `model`: the one its last call gave back where it
    has `row_bucket(rows)` slots (its capacity as it was), else a new one."""
    spare = _SPARE.pop(model, None)
    if spare is not None and spare.num_slots == row_bucket(rows):
        return spare
    return StaticRowCache(model.device)


def give_back(model, cache: StaticRowCache) -> None:
    """Keep `cache`, whose call has ended, for `model`'s next call (`take_cache`): every slot freed, the sticky
    query width reset (a call's widths are its own)."""
    cache.select_rows([])
    cache.width = 0
    _SPARE[model] = cache
