"""Fault isolation: what a fault in a drafter, the target or one row's processing costs.

`generate` keeps its contract: a drafter that raises is dropped for the call (decoding goes on,
still lossless), anything else raises. With `isolate_faults=True` (a server) a fault costs only the
rows it touched:

- a drafter that raises is rebuilt and, called over one row, banned from it; a wider call is retried
  on halves of its rows by the engine until the row at fault is alone;
- a target forward that raises is retried on halves of the batch until the row(s) at fault are
  found, which fail alone;
- a prefill, processor, sampling or stopping criterion that raises fails its row.

Every method returns what the happy path needs (a value, or None / False for a fault it absorbed),
so the engine's step reads as the happy path with one call in place of each guarded operation.
"""

from __future__ import annotations

import logging
import warnings
from time import perf_counter
from typing import Any, Callable

import torch

from .rows import Row
from ..verify.chains import Verdict

logger = logging.getLogger(__name__)


class Faults:
    """The engine's fault policy (`engine`: a SpinEngine, whose rows, drafters and stats it updates)."""

    def __init__(self, engine, isolate: bool):
        self.engine = engine
        self.isolate = isolate

    def row(self, row: Row, fn: Callable[[], Any]) -> None:
        """Run a per-row operation. Isolating, an exception fails that row only (`row.done`)."""
        try:
            fn()
        except Exception as err:
            if not self.isolate:
                raise
            logger.warning("row %d failed: %r", row.id, err)
            row.fail(err)

    def prefill_failed(self, rows: list[Row], err: Exception) -> None:
        """The prefill of `rows` raised: re-raise (not isolating) or fail a lone row; the engine then
        admits several rows one at a time, so the rows whose prefill fails alone fail."""
        if not self.isolate:
            raise err
        if len(rows) == 1:
            rows[0].fail(err)
            logger.warning("prefill of row %d failed: %r", rows[0].id, err)

    def drafter(self, d_idx: int, fn: Callable[[], Any], served: list[int], draft_seconds: list[float] | None = None, ban: bool = True) -> tuple[bool, Any]:
        """(ok, fn's value) of a drafter call; its wall time is added to `draft_seconds[d_idx]` and the
        drafter's stats. A drafter that raises is dropped for the call (generate) or, isolating,
        rebuilt and (if `ban`) banned from the batch rows `served`. Lossless either way."""
        engine = self.engine
        name = engine.names[d_idx]
        start = perf_counter()
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - any drafter fault must leave decoding lossless
            engine.drafter_stats[name].failures += 1
            if self.isolate:
                rows = [engine.rows[b] for b in served if b < len(engine.rows)]
                if ban:
                    for row in rows:
                        row.banned.add(d_idx)
                    logger.warning("drafter %r raised %r; rows %s go on without it", name, err, [r.id for r in rows])
                self._rebuild(d_idx)
            else:
                warnings.warn(f"drafter {name!r} raised {err!r}; dropped for the rest of this call", stacklevel=4)
                engine.usable[d_idx] = False
                engine.drafters[d_idx].finish()
            return False, None
        seconds = perf_counter() - start
        if draft_seconds is not None:
            draft_seconds[d_idx] += seconds
        engine.drafter_stats[name].draft_seconds += seconds
        return True, value

    def _rebuild(self, d_idx: int) -> None:
        """Fresh per-row state for a drafter that raised (it catches up on each row when next used)."""
        engine = self.engine
        drafter = engine.drafters[d_idx]
        try:
            drafter.finish()
            if engine.drafters_started:
                drafter.start(engine.model, [r.sequence for r in engine.rows])
        except Exception as err:  # noqa: BLE001
            logger.warning("drafter %r could not be rebuilt (%r); dropped", engine.names[d_idx], err)
            engine.usable[d_idx] = False

    def target_forward(self, forward: Callable[[list[list[int]]], torch.Tensor], chunks: list[list[int]]) -> torch.Tensor | None:
        """forward(chunks) -> logits [B, T, V] float32, the cache restored if it raises. Isolating, a
        forward that raises is retried on halves of the rows fed (the others get empty chunks) until
        the rows that raise alone fail; their logits stay zero. None when every row failed."""
        cache = self.engine.cache
        state = cache.checkpoint()
        try:
            return forward(chunks)
        except Exception as err:
            cache.restore(state)
            if not self.isolate:
                raise
            logger.warning("target forward over %d rows raised %r; retrying on halves of the batch", len(chunks), err)
        width = max(len(c) for c in chunks)
        out = None
        todo = [list(range(len(chunks)))]
        while todo:
            part = todo.pop()
            fed = set(part)
            state = cache.checkpoint()
            try:
                logits = forward([c if b in fed else [] for b, c in enumerate(chunks)])
            except Exception as err:  # noqa: BLE001
                cache.restore(state)
                if len(part) == 1:
                    self.engine.rows[part[0]].fail(err)
                    logger.warning("row %d failed in verification: %r", self.engine.rows[part[0]].id, err)
                else:
                    todo += [part[: len(part) // 2], part[len(part) // 2 :]]
                continue
            if out is None:
                out = logits.new_zeros(len(chunks), width, logits.shape[-1])
            out[part, : logits.shape[1]] = logits[part]
        return out

    def verdict(self, verdict_of: Callable[[list[int]], Verdict], device) -> Verdict:
        """verdict_of(batch rows) over every row; isolating, a verdict that raises is redone one row at
        a time, and the rows that raise alone fail (accepting nothing)."""
        rows = self.engine.rows
        try:
            return verdict_of(list(range(len(rows))))
        except Exception:
            if not self.isolate:
                raise
        accepted = torch.zeros(len(rows), dtype=torch.long, device=device)
        next_token = torch.zeros(len(rows), dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            if row.done:
                continue
            try:
                v = verdict_of([b])
                accepted[b], next_token[b] = v.accepted[0], v.next_token[0]
            except Exception as err:  # noqa: BLE001
                row.fail(err)
        return Verdict(accepted, next_token)
