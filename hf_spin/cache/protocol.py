"""`RowCache`: what the engine and the drafters call on a target or drafter KV cache, whichever layout.

Both `RectangularCache` (rectangular, with holes) and `PackedCache` (rows back to back) provide it; the model
itself runs on either through `forward_ragged`. Layout-specific calls stay on the concrete classes:
`RectangularCache.append_rows` (rows prefilled apart, on the rectangular path only) and `RectangularCache.slot_mask`
/ `lengths` (`StreamingDrafter`, which copies from the target's `RectangularCache`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class RowCache(Protocol):
    """A KV cache of B rows, each holding its own number of tokens; rows are addressed by batch index."""

    @property
    def device(self) -> torch.device:
        """Where the cache's tensors live."""
        ...

    def rollback(self, keep: list[int] | torch.Tensor) -> None:
        """keep: `[B]` tokens row b keeps (its first keep[b]), on the host (a list or a CPU tensor: the
        cache decides on the host and sends the device what it needs); later tokens are dropped."""
        ...

    def select_rows(self, rows: list[int] | torch.Tensor) -> None:
        """rows: `[B']` the rows to keep, in their new order, on the host (the others retire)."""
        ...

    def add_empty_rows(self, n: int) -> None:
        """Append n rows holding no token; the next forward that feeds them fills them."""
        ...

    def checkpoint(self) -> Any:
        """An opaque state that `restore` takes to undo the next forward if it raises."""
        ...

    def restore(self, state: Any) -> None:
        """Undo a forward that raised half-way; state: what `checkpoint` returned just before it."""
        ...
