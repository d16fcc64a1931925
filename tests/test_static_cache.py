"""Static per-row cache (`StaticRowCache`) and its fixed-shape forward (`forward_static`).

The cache alone: writes at each row's own length, rollback, rows leaving and joining by slot without
reallocating, growth, checkpoint/restore, filling from a prefill's `RaggedCache`.
"""

import torch

from hf_spin.cache import RaggedCache
from hf_spin.cache.static import StaticRowCache, query_bucket


def _filled(lengths: list[int], capacity: int = 8) -> StaticRowCache:
    """A cache of len(lengths) rows, one layer (H = 1, D = 1) whose key at slot j of row b is 100 b + j."""
    cache = StaticRowCache()
    cache.add_empty_rows(len(lengths))
    cache.reserve(capacity)
    width = max(lengths)
    keys = torch.tensor([[100.0 * b + j for j in range(width)] for b in range(len(lengths))])[:, None, :, None]
    cache.update(keys, keys.clone(), 0)
    cache.advance(lengths)
    return cache


def _row(cache: StaticRowCache, b: int) -> list[float]:
    """Row b's held keys."""
    s = cache.slot_of[b]
    return cache.layers[0].keys[s, 0, : cache.host_lengths[s], 0].tolist()


def test_update_writes_each_row_at_its_own_length_and_rollback_lets_the_next_write_overwrite():
    cache = _filled([3, 1])
    assert cache.lengths == [3, 1] and cache.slot_lengths.tolist() == [3, 1]
    cache.rollback([2, 1])
    new = torch.tensor([[7.0, 8.0], [9.0, 0.0]])[:, None, :, None]  # [R=2, H, T=2, D]
    cache.update(new, new.clone(), 0)
    cache.advance([2, 1])  # row 1's second query slot was padding: written, not counted
    assert _row(cache, 0) == [0.0, 1.0, 7.0, 8.0]
    assert _row(cache, 1) == [100.0, 9.0]


def test_rows_leave_and_join_by_slot_without_reallocating():
    cache = _filled([3, 2])
    storage = cache.layers[0].keys.data_ptr()
    cache.select_rows([1])  # row 0 leaves: its slot is free
    assert cache.slot_of == [1] and cache.host_lengths == [0, 2]
    cache.add_empty_rows(1)  # joins into the free slot
    assert cache.slot_of == [1, 0] and cache.lengths == [2, 0]
    assert cache.layers[0].keys.data_ptr() == storage
    cache.add_empty_rows(1)  # no free slot: row slots grow to the next bucket, contents kept
    assert cache.num_slots == 4 and cache.slot_of == [1, 0, 2]
    assert _row(cache, 0) == [100.0, 101.0]


def test_capacity_grows_in_buckets_keeping_the_rows():
    cache = _filled([3, 2])
    capacity = cache.capacity
    cache.reserve(capacity)  # longest (3) + capacity slots do not fit
    assert cache.capacity > capacity and cache.capacity % 256 == 0
    assert _row(cache, 0) == [0.0, 1.0, 2.0] and _row(cache, 1) == [100.0, 101.0]


def test_restore_undoes_a_forward_that_raised():
    cache = _filled([3, 2])
    state = cache.checkpoint()
    cache.advance([2, 2])
    cache.restore(state)
    assert cache.lengths == [3, 2] and cache.slot_lengths.tolist() == [3, 2]


def test_append_rows_copies_a_prefills_valid_slots_to_the_start_of_free_slots():
    ragged = RaggedCache(torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool))  # row 0 left-padded
    keys = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])[:, None, :, None]
    ragged.update(keys, keys.clone(), 0)
    cache = _filled([1])
    cache.append_rows(ragged, min_capacity=300)
    assert cache.lengths == [1, 2, 3] and cache.capacity == 512
    assert _row(cache, 1) == [1.0, 2.0] and _row(cache, 2) == [3.0, 4.0, 5.0]


def test_query_buckets_fit_a_draft_of_a_power_of_two_plus_its_last_token():
    assert [query_bucket(n) for n in (1, 2, 3, 4, 5, 6, 9, 10, 17, 66)] == [1, 2, 3, 5, 5, 9, 9, 17, 17, 128]
