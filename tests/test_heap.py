"""`hf_spin.freeze_gc` and the benchmarks' `frozen_gc` (hf_spin/heap.py): the objects alive move out of the
collector's scans (a full collection over a loaded model's objects paused a decode ~0.2 s), and the block gives
them back."""

import gc

from hf_spin.heap import frozen_gc


def _scanned(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # the permanent generation's objects are not listed


def test_the_objects_alive_leave_the_collectors_scans_for_the_block_and_come_back():
    alive = [[] for _ in range(1000)]  # tracked containers
    assert _scanned(alive[0])
    before = gc.get_freeze_count()
    with frozen_gc():
        assert gc.get_freeze_count() >= before + len(alive)
        assert not _scanned(alive[0])
        made = []  # made inside the block: scanned as usual
        assert _scanned(made)
    assert _scanned(alive[0]) and gc.get_freeze_count() == 0
