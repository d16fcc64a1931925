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
so the engine's step reads as the happy path with one call in place of each guarded operation. The
methods get what they touch as arguments (rows, the target's cache, a `DrafterScope`); a row that
fails is failed in place (`Row.fail`), and what a drafter call did comes back as a `DrafterCall`,
which the engine applies to its drafter stats and usable flags.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable

import torch

from ..cache import RowCache
from ..drafters import Drafter
from ..verify.chains import Verdict
from .rows import Row

logger = logging.getLogger(__name__)


@dataclass
class DrafterScope:
    """What a guarded drafter call may touch: the drafters (one that raises is dropped or rebuilt), the
    active rows (banned from a drafter that raised; its restart reads their sequences) and the target
    model a rebuilt drafter restarts with, when the drafters have `started`."""

    drafters: list[Drafter]
    names: list[str]  # [num_drafters] unique names, for the log
    rows: list[Row]  # [B] the active batch, in cache order
    model: Any
    started: bool


@dataclass
class DrafterCall:
    """What one guarded drafter call did (`Faults.drafter`), for the engine to apply: the drafter's
    stats (`seconds` when `ok`, a failure otherwise) and, when `dropped`, its usable flag."""

    ok: bool
    value: Any = None  # the call's value when ok
    seconds: float = 0.0  # wall time of a call that returned
    dropped: bool = False  # the drafter is unusable for the rest of the call


class Faults:
    """The engine's fault policy: `isolate` a fault to the rows it touched, or keep `generate`'s contract."""

    def __init__(self, isolate: bool):
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

    def drafter(
        self, scope: DrafterScope, d_idx: int, fn: Callable[[], Any], served: list[int], ban: bool = True
    ) -> DrafterCall:
        """fn(), a call of drafter `d_idx`, timed. A drafter that raises is dropped for the call (generate)
        or, isolating, rebuilt and (if `ban`) banned from the batch rows `served`. Lossless either way."""
        name = scope.names[d_idx]
        start = perf_counter()
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - any drafter fault must leave decoding lossless
            if self.isolate:
                rows = [scope.rows[b] for b in served if b < len(scope.rows)]
                if ban:
                    for row in rows:
                        row.banned.add(d_idx)
                    logger.warning("drafter %r raised %r; rows %s go on without it", name, err, [r.id for r in rows])
                return DrafterCall(False, dropped=not self.rebuild(scope, d_idx))
            warnings.warn(f"drafter {name!r} raised {err!r}; dropped for the rest of this call", stacklevel=4)
            scope.drafters[d_idx].finish()
            return DrafterCall(False, dropped=True)
        return DrafterCall(True, value, perf_counter() - start)

    def rebuild(self, scope: DrafterScope, d_idx: int) -> bool:
        """Fresh per-row state for a drafter that raised (it catches up on each row when next used);
        False when it could not be rebuilt (dropped)."""
        drafter = scope.drafters[d_idx]
        try:
            drafter.finish()
            if scope.started:
                drafter.start(scope.model, [r.sequence for r in scope.rows])
        except Exception as err:  # noqa: BLE001
            logger.warning("drafter %r could not be rebuilt (%r); dropped", scope.names[d_idx], err)
            return False
        return True

    def target_forward(
        self,
        cache: RowCache,
        rows: list[Row],
        forward: Callable[[list[list[int]]], torch.Tensor],
        chunks: list[list[int]],
    ) -> torch.Tensor | None:
        """forward(chunks) -> logits [B, T, V] float32 over `rows`, `cache` restored if it raises.
        Isolating, a forward that raises is retried on halves of the rows fed (the others get empty
        chunks) until the rows that raise alone fail; their logits stay zero. None when every row failed."""
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
                    rows[part[0]].fail(err)
                    logger.warning("row %d failed in verification: %r", rows[part[0]].id, err)
                else:
                    todo += [part[: len(part) // 2], part[len(part) // 2 :]]
                continue
            if out is None:
                out = logits.new_zeros(len(chunks), width, logits.shape[-1])
            out[part, : logits.shape[1]] = logits[part]
        return out

    def verdict(self, rows: list[Row], verdict_of: Callable[[list[int]], Verdict], device) -> Verdict:
        """verdict_of(batch rows) over every row of `rows`; isolating, a verdict that raises is redone one
        row at a time, and the rows that raise alone fail (accepting nothing)."""
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
