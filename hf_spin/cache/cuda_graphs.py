"""The static layout's fixed-shape forward captured as CUDA graphs, without `torch.compile`.

`StaticOptions(compile=True, backend="cuda_graphs")`: the eager `run_static` (or `run_static_draft`) is run once
and captured into a `torch.cuda.CUDAGraph` per shape and storage, then replayed: the step costs the eager
kernels' device time without their launches, and a new shape costs one eager forward and a capture (a fraction
of a second) where inductor compiles for half a minute (docs/design.md, "CUDA graphs without torch.compile").
SGLang and vLLM capture their decode this way; gpt-fast and `transformers`' static cache compile with inductor.
`backend="inductor+cuda_graphs"` captures the same way the forward inductor compiled (mode None: no graph trees of
torch's), its fused kernels in place of the eager ones.

A graph reads and writes fixed addresses. Everything the forward reads that is not made inside it is either
copied into the graph's own input buffer (the token ids) or a static-address tensor that changes in place
(the cache's lengths, layout buffers and KV storage, the model's weights): `GraphedForward` keys a graph by the
shapes and by the addresses of those tensors, so a cache that reallocates (capacity or row slots grown, a new
call's cache) gets a new capture, never a stale replay. A model whose forward cannot be captured (it reads the
device on the host, say) runs eagerly, said once.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .capture import capture_graph
from .static import StaticRowCache


@dataclass
class _Graph:
    replay: Callable[[], None]
    input_ids: torch.Tensor  # [R, T] the graph's input buffer
    logits: torch.Tensor  # [R, T, V] the graph's output, overwritten by each replay


def storage_key(cache: StaticRowCache, input_ids: torch.Tensor, dtype: torch.dtype) -> tuple:
    """What a captured forward's validity depends on besides the model: the shapes, the dtype and the address
    of every cache tensor it reads (lengths, the width's layout buffers, each layer's keys and values)."""
    kv = tuple(t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values))
    layout = (cache.slot_lengths.data_ptr(), cache.query_depths.data_ptr(), cache.query_visible.data_ptr())
    return tuple(input_ids.shape), dtype, cache.capacity, layout, kv


class _ModelGraphs:
    """One model's graphs, by `storage_key`, and the memory pool they share: it lives as long as they do (a
    graph is only ever replaced after its successor was captured into the pool), and goes with the model."""

    def __init__(self):
        self.by_key: dict[tuple, _Graph] = {}
        self.pool = None


class GraphedForward:
    """`forward` (`run_static` or `run_static_draft`, same arguments and result) replayed from CUDA graphs:
    per model, one graph per `storage_key`; a capture for a shape replaces the model's graph of that shape
    over older storage (a reallocated cache's). The logits it returns are the graph's output buffer: the
    caller copies what it keeps before the next call (`static_forward._run` does)."""

    def __init__(self, forward):
        self.forward = forward
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelGraphs
        self.uncapturable: weakref.WeakSet = weakref.WeakSet()
        self.captures = 0  # graphs captured so far (what warm-up paid)

    def __call__(self, model, cache: StaticRowCache, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if model in self.uncapturable:
            return self.forward(model, cache, input_ids, dtype)
        key = storage_key(cache, input_ids, dtype)
        graphs = self.graphs.setdefault(model, _ModelGraphs())
        graph = graphs.by_key.get(key)
        if graph is None:
            try:
                graph = self._capture(model, cache, input_ids, dtype, graphs)
            except torch._dynamo.exc.Unsupported:  # a compiled forward that cannot trace the model: the caller's
                raise  # to handle (static_forward._run runs it eagerly)
            except RuntimeError as e:  # a host read or a blocking copy inside the forward: no graph
                self.uncapturable.add(model)
                warnings.warn(
                    f"hf_spin: the static forward of {model.config.model_type!r} ({type(model).__name__}) cannot "
                    f"be captured as a CUDA graph; it runs uncaptured ({str(e).splitlines()[0]})",
                    stacklevel=3,
                )
                return self.forward(model, cache, input_ids, dtype)
            for old in [k for k in graphs.by_key if k[:3] == key[:3]]:  # the same shape over storage since freed
                del graphs.by_key[old]
            graphs.by_key[key] = graph
        graph.input_ids.copy_(input_ids)
        graph.replay()
        return graph.logits

    def _capture(self, model, cache: StaticRowCache, input_ids: torch.Tensor, dtype: torch.dtype, graphs) -> _Graph:
        ids = input_ids.clone()  # [R, T] the graph's own input buffer
        run = lambda: self.forward(model, cache, ids, dtype)  # noqa: E731
        replay, logits, graphs.pool = capture_graph(run, ids.device, graphs.pool)
        self.captures += 1
        return _Graph(replay, ids, logits)
