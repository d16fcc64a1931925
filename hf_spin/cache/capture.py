"""CUDA graph capture of fixed work over static storage: `capture_graph`, and `GraphedMoves` (the static cache's
KV moves after a token tree). cuda_graphs.py captures the static layout's forwards with the same `capture_graph`.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def capture_graph(run: Callable[[], torch.Tensor], device: torch.device, pool=None):
    """(replay, output, pool): `run` captured as a CUDA graph on `device` after one eager run on a side stream (lazy
    initialisation, cuBLAS workspaces, the allocator's blocks happen outside the capture), its output a
    graph-owned tensor that every replay overwrites; graphs share the memory pool `pool` (None: a new one), which
    is safe as they never run at once and each keeps its output. A pool's id is valid only while some graph
    captured into it lives (PyTorch's allocator refuses a capture into a pool whose graphs were all freed)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads run on
            out = run()

    def replay() -> None:
        with torch.cuda.device(device):  # on the device's current stream, whichever device is current
            graph.replay()

    return replay, out, graph.pool()


class GraphedMoves:
    """`StaticRowCache.keep_paths`' KV moves replayed from a CUDA graph: eagerly, `move` (static.move_slots) is two
    indexing ops per layer and tensor, 112 launches for 28 layers, each paid on the host where a host-bound GPU
    waits for it; a replay is one launch and a copy of the moves. The moves are padded to a fixed count (the next
    power of two) by repeating the first, which writes what it writes (same source, same value), so one graph per
    (count, storage) serves every step; a capture runs with harmless self-moves (slot 0's last position onto itself),
    so its eager warm-up changes nothing, and the step's moves are then replayed."""

    def __init__(self, move: Callable[[list, torch.Tensor], None]):  # (layers with .keys and .values, index [3, P])
        self.move = move
        self.graphs: dict[tuple, tuple[Callable[[], None], torch.Tensor]] = {}  # key -> (replay, index `[3, P]`)
        self.captures = 0
        self.failed = False

    def __call__(self, layers: list, moves: list[tuple[int, int, int]], capacity: int) -> bool:
        """Run `moves` (slot, from, to) over `layers` from a graph; False (nothing moved) where none can be captured."""
        if self.failed or not layers:
            return False
        count = 1 << (len(moves) - 1).bit_length()
        padded = torch.tensor(list(zip(*moves, *moves[:1] * (count - len(moves)))), dtype=torch.long)  # [3, P]
        key = (count, tuple(t.data_ptr() for layer in layers for t in (layer.keys, layer.values)))
        if key not in self.graphs:
            index = torch.tensor([[0], [capacity - 1], [capacity - 1]], device=layers[0].keys.device).repeat(1, count)
            try:
                replay, _, _ = capture_graph(lambda: self._run(layers, index), index.device)
            except RuntimeError as e:
                self.failed = True
                said = str(e).splitlines()[0]
                warnings.warn(f"hf_spin: the static cache's KV moves run eagerly ({said})", stacklevel=4)
                return False
            for old in [k for k in self.graphs if k[0] == count]:  # the same count over storage since freed
                del self.graphs[old]
            self.graphs[key] = (replay, index)
            self.captures += 1
        replay, index = self.graphs[key]
        index.copy_(padded, non_blocking=True)
        replay()
        return True

    def _run(self, layers: list, index: torch.Tensor) -> torch.Tensor:
        self.move(layers, index)
        return index
