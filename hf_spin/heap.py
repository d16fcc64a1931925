"""The garbage collector's heap, frozen once the models are loaded (vLLM and SGLang do so after warm-up).

A full collection (generation 2) scans every object the collector tracks, and a process holding a model
tracks hundreds of thousands (a 1.5B target, drafters and `transformers`: ~390k): on an AMD EPYC one took
170-210 ms, in the middle of a decode whose steps take 5 ms on a GPU, and hf_spin's own long-lived objects
(policies' histories, drafts, trees) are what trigger it. `freeze_gc` collects once, then moves every object
alive to the permanent generation, which later collections skip: the same collection took 0.8 ms.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


def freeze_gc() -> int:
    """Collect, then freeze the objects alive (`gc.freeze`): call it once the models are loaded (and warm). Returns
    how many are frozen. Frozen objects that later become cyclic garbage are not freed until `gc.unfreeze()`, so
    a process that loads and drops models over its life should not call it (the server calls it once)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_gc():
    """`freeze_gc` for the block, `gc.unfreeze()` after it: a benchmark's timed runs without the collector's full
    scans, the process as it was afterwards (a test suite's, say)."""
    freeze_gc()
    try:
        yield
    finally:
        gc.unfreeze()
