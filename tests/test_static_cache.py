"""Static per-row cache (`StaticRowCache`) and its fixed-shape forward (`forward_static`).

The cache alone: writes at each row's own length, rollback, rows leaving and joining by slot without
reallocating, growth, checkpoint/restore, filling from a prefill's `RectangularCache`. With models: logits
equal `forward_ragged` on the rectangular cache (float32), through rollbacks and rows leaving and joining.
"""

import pytest
import torch

from hf_spin.cache import RectangularCache, forward_ragged
from hf_spin.cache.static import StaticRowCache, query_bucket
from hf_spin.cache.static_forward import check_static_support, forward_static

from .archs import tiny_model


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
    ragged = RectangularCache(torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool))  # row 0 left-padded
    keys = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])[:, None, :, None]
    ragged.update(keys, keys.clone(), 0)
    cache = _filled([1])
    cache.append_rows(ragged, min_capacity=300)
    assert cache.lengths == [1, 2, 3] and cache.capacity == 512
    assert _row(cache, 1) == [1.0, 2.0] and _row(cache, 2) == [3.0, 4.0, 5.0]


def test_query_buckets_fit_a_draft_of_a_power_of_two_plus_its_last_token():
    assert [query_bucket(n) for n in (1, 2, 3, 4, 5, 6, 9, 10, 17, 66)] == [1, 2, 3, 5, 5, 9, 9, 17, 17, 128]


# -- with models -----------------------------------------------------------------------------------------

ARCHS = {
    "llama": {},
    "qwen2": {},
    "mistral": dict(sliding_window=None),
    "gemma": {},
    "qwen3": {},
    "phi3": {},
}
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
# (chunk per row, tokens each row keeps afterwards): ragged chunks, rejections, an empty chunk.
STEPS = [
    ([[20, 21, 22, 23], [24], [25, 26]], [8, 3, 5]),
    ([[30], [31, 32, 33, 34, 35], [36, 37]], [9, 5, 7]),
    ([[40, 41], [], [42, 43, 44]], [10, 5, 8]),
]


def _prefilled(model, prompts):
    ragged = RectangularCache(torch.zeros(len(prompts), 0, dtype=torch.bool))
    forward_ragged(model, ragged, prompts)
    static = StaticRowCache()
    static.append_rows(ragged)
    return ragged, static


def _assert_rows_close(ragged_logits, static_logits, chunks):
    assert static_logits.shape == ragged_logits.shape
    for b, chunk in enumerate(chunks):
        torch.testing.assert_close(static_logits[b, : len(chunk)], ragged_logits[b, : len(chunk)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@torch.no_grad()
def test_logits_equal_the_rectangular_cache_through_rollbacks(arch, one_thread):
    model = tiny_model(arch, **ARCHS[arch])
    check_static_support(model)
    ragged, static = _prefilled(model, PROMPTS)
    for chunks, keep in STEPS:
        _assert_rows_close(forward_ragged(model, ragged, chunks), forward_static(model, static, chunks), chunks)
        ragged.rollback(keep)
        static.rollback(keep)
    assert static.lengths == ragged.host_lengths


@torch.no_grad()
def test_a_prefill_through_forward_static_equals_the_rectangular_cache(one_thread):
    model = tiny_model("llama")
    ragged = RectangularCache(torch.zeros(len(PROMPTS), 0, dtype=torch.bool))
    static = StaticRowCache()
    static.add_empty_rows(len(PROMPTS))
    _assert_rows_close(forward_ragged(model, ragged, PROMPTS), forward_static(model, static, PROMPTS), PROMPTS)
    chunks = [[20, 21], [22], [23, 24, 25]]
    _assert_rows_close(forward_ragged(model, ragged, chunks), forward_static(model, static, chunks), chunks)


@torch.no_grad()
def test_an_eager_forward_for_the_last_tokens_computes_their_logits_alone(one_thread):
    """`all_logits=False` (a drafter's catch-up): logits `[B, 1, V]` at each row's last chunk token, those of the
    full forward; an eager forward asks the model for those slots alone (`logits_to_keep`), not `[R, T, V]`."""
    model = tiny_model("llama")
    asked = []
    hook = model.register_forward_pre_hook(lambda m, a, k: asked.append(k.get("logits_to_keep")), with_kwargs=True)
    full, last = StaticRowCache(), StaticRowCache()
    for cache in (full, last):
        cache.add_empty_rows(len(PROMPTS))
    everything = forward_static(model, full, PROMPTS)  # [B, T, V]
    ends = forward_static(model, last, PROMPTS, all_logits=False)  # [B, 1, V]
    hook.remove()
    want = torch.stack([everything[b, len(p) - 1] for b, p in enumerate(PROMPTS)])[:, None]
    assert ends.shape == want.shape and torch.allclose(ends, want, atol=1e-5)
    assert asked[0] is None and sorted(asked[1].tolist()) == sorted({len(p) - 1 for p in PROMPTS})
    assert last.lengths == full.lengths == [len(p) for p in PROMPTS]


@torch.no_grad()
def test_rollback_then_continue_equals_never_feeding_the_rejected_tokens(one_thread):
    model = tiny_model("qwen2")
    _, rolled = _prefilled(model, PROMPTS)
    forward_static(model, rolled, [[20, 21, 22, 23], [24, 25], [26]])
    rolled.rollback([len(PROMPTS[0]) + 1, len(PROMPTS[1]), len(PROMPTS[2]) + 1])  # keep 20, nothing, 26
    _, clean = _prefilled(model, [PROMPTS[0] + [20], PROMPTS[1], PROMPTS[2] + [26]])
    chunks = [[30, 31], [32, 33, 34], [35]]
    _assert_rows_close(forward_static(model, clean, chunks), forward_static(model, rolled, chunks), chunks)


@torch.no_grad()
def test_rows_leaving_and_joining_keep_every_row_exact(one_thread):
    model = tiny_model("llama")
    ragged, static = _prefilled(model, PROMPTS)
    chunks = [[20, 21], [22], [23, 24, 25]]
    forward_ragged(model, ragged, chunks)
    forward_static(model, static, chunks)
    for cache in (ragged, static):
        cache.select_rows([2, 0])  # row 1 leaves, the others swap
    joining = [[50, 51, 52], [53]]
    fresh, _ = _prefilled(model, joining)
    ragged.append_rows(fresh)
    static.append_rows(fresh)
    assert static.num_slots == 4 and sorted(static.slot_of) == [0, 1, 2, 3]
    chunks = [[60], [61, 62], [63, 64, 65], [66, 67]]
    _assert_rows_close(forward_ragged(model, ragged, chunks), forward_static(model, static, chunks), chunks)


@pytest.mark.parametrize(
    "arch, overrides, reason",
    [("mistral", dict(sliding_window=6), "full attention only"), ("bloom", {}, "4D attention mask")],
)
def test_models_it_cannot_run_exactly_are_refused(arch, overrides, reason):
    with pytest.raises(ValueError, match=reason):
        check_static_support(tiny_model(arch, **overrides))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@torch.no_grad()
def test_tree_slots_score_their_own_paths_and_the_kept_path_decodes_on(compiled, one_thread, fresh_dynamo):
    """A token tree in the static layout's query slots: the logits at each slot equal a plain forward over the
    prompt and the slot's path; after keep_paths (the accepted path's KV moved down behind the root) the rows
    decode on exactly. Chains and trees run at one width in one compiled graph, with no recompilation."""
    from hf_spin.cache.static_forward import StaticOptions, StaticTarget
    from hf_spin.verify.token_tree import TokenTree

    from .archs import VOCAB
    from .test_token_trees import _random_tree

    model = tiny_model("llama")
    target = StaticTarget(model, StaticOptions(compile=compiled, backend="eager", query_slots=9))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 7)]
    trees = [_random_tree(g, 7, VOCAB), _random_tree(g, 4, VOCAB), TokenTree.chain([30, 31, 32])]
    _, cache = _prefilled(model, [p[:-1] for p in prompts])

    def plain(tokens):
        return model(torch.tensor([tokens])).logits[0, -1]

    with torch._dynamo.config.patch(error_on_recompile=True):
        first = target(model, cache, [[p[-1], 40, 41] for p in prompts])  # a chain step first: the graph
        cache.rollback([len(p) - 1 for p in prompts])  # drafts rejected, the roots fed again below
        for b, p in enumerate(prompts):
            torch.testing.assert_close(first[b, 0], plain(p), atol=1e-5, rtol=1e-5)
        logits = target.tree(model, cache, [p[-1] for p in prompts], trees)  # [3, 1 + N_max, V]
        for b, (prompt, tree) in enumerate(zip(prompts, trees)):
            torch.testing.assert_close(logits[b, 0], plain(prompt), atol=1e-5, rtol=1e-5)
            for node in range(len(tree)):
                path = [tree.tokens[n] for n in tree.path(node)]
                torch.testing.assert_close(logits[b, node + 1], plain(prompt + path), atol=1e-5, rtol=1e-5)
        deepest = max(range(len(trees[0])), key=lambda n: (len(trees[0].path(n)), n))
        paths = [trees[0].path(deepest), [], [0, 1]]
        assert paths[0] != list(range(len(paths[0])))  # its KV moves
        cache.keep_paths([len(p) - 1 for p in prompts], paths)
        after = target(model, cache, [[5, 7], [6, 8], [7, 9]])  # chains again, the tree's layout cleared
    for b, (prompt, tree, path) in enumerate(zip(prompts, trees, paths)):
        kept = prompt + [tree.tokens[n] for n in path]
        assert cache.lengths[b] == len(kept) + 2
        torch.testing.assert_close(after[b, 1], plain(kept + [5 + b, 7 + b]), atol=1e-5, rtol=1e-5)
    assert fresh_dynamo["stats"]["unique_graphs"] == (1 if compiled else 0)
