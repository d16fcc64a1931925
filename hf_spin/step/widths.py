"""Verification at a cheaper width: a step's chunks filled out to the positions the cost profile says verify cheapest.

On a CPU a forward over 2-3 tokens can cost more than one over 8 (a slow small-M GEMM against a packed one:
whisper-base's decoder, AMD EPYC, float32: 42 / 56 / 35 ms for 2 / 3 / 8 tokens). `ForwardCost.width` picks
the positions (a measured knot); `widen` fills each row's chunk with filler tokens after its real ones to
reach them. Causal attention keeps fillers out of every real token's logits, so verification is unchanged;
the engine's rollback drops their KV with the rejected drafts'. docs/planning.md#verification-width.
"""

from __future__ import annotations

from ..cache.forward import FILLER_TOKEN


def widen(chunks: list[list[int]], positions: int, rooms: list[int], packed: bool) -> list[list[int]] | None:
    """`chunks` ([B] token lists) filled with FILLER_TOKEN to `positions` positions in all, or None where the
    rows cannot hold them: no row's chunk may outgrow its room (`rooms`, [B]: the longest chunk row b may
    still verify, `Row.draft_room` + 1), so fillers never reach past a row's length limit (a learned position
    table's end).
    Rows padded to one width (rectangular, static): every chunk to positions / B tokens. Packed rows: the
    fillers go to the rows with the most room first."""
    B, fed = len(chunks), sum(len(c) for c in chunks)
    if positions <= fed:
        return chunks
    if not packed:
        width = positions // B
        if width * B != positions or any(width > room for room in rooms):
            return None
        return [c + [FILLER_TOKEN] * (width - len(c)) for c in chunks]
    out, left = [list(c) for c in chunks], positions - fed
    for b in sorted(range(B), key=lambda b: len(chunks[b]) - rooms[b]):
        extra = min(left, max(rooms[b] - len(chunks[b]), 0))
        out[b] += [FILLER_TOKEN] * extra
        left -= extra
    return out if left == 0 else None
