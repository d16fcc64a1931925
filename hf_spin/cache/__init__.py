"""KV caches whose rows hold different numbers of tokens, and the model calls that fill them.

* `rectangular`: `RectangularCache`, a rectangular `DynamicCache` `[B, H, S, D]` with holes (the default path).
* `packed`: `PackedCache`, every row's tokens back to back for the varlen kernel (`AssistantPool(cache="packed")`).
* `forward`: `forward_ragged` (either cache), `forward_packed`, `forward_tree` (token trees, either cache),
  `forward_masked` (a 4D mask on a `RectangularCache`, for models that `takes_4d_masks`), `check_packed_support`,
  `CACHE_ARG`.
* `protocol`: `RowCache`, the calls the engine and the drafters make on either cache.
* `encoder_rows`: `EncoderRows`, an encoder-decoder model's per-row encoder output and cross-attention K/V,
  held by its decoder's `RectangularCache` and following its rows.

Under `device_map` each layer's KV lives on its own device: every index a cache applies to its layers goes
through `rectangular.per_device` (one copy per device).

Imports run one way: `forward` -> `packed` -> `rectangular`; `packed`, `forward` -> `hf_spin.kernels.attention`
(which imports nothing of `hf_spin.cache`); `rectangular` -> `encoder_rows`; `encoder_rows` and `protocol`
import nothing of `hf_spin`.
Tuning constants (`rectangular.COMPACT_HOLE_FRACTION`, `packed.RESERVE_TOKENS`, ...) are read, and so must be
patched, in their own module; they are not re-exported, so a patch of `hf_spin.cache.<name>` fails loudly.
"""

from .forward import (
    CACHE_ARG,
    CACHE_NAMES,
    check_packed_support,
    forward_masked,
    forward_packed,
    forward_ragged,
    forward_tree,
    takes_4d_masks,
)
from .packed import PackedCache, grow_capacity
from .protocol import RowCache
from .rectangular import RectangularCache, compaction_index, gather_slots, needs_contiguous_slots, per_device

__all__ = [
    "CACHE_ARG",
    "CACHE_NAMES",
    "PackedCache",
    "RectangularCache",
    "RowCache",
    "check_packed_support",
    "compaction_index",
    "forward_packed",
    "forward_masked",
    "forward_ragged",
    "forward_tree",
    "takes_4d_masks",
    "gather_slots",
    "grow_capacity",
    "needs_contiguous_slots",
    "per_device",
]
