"""Triton varlen attention against its pure-PyTorch reference, on ragged shapes, under the interpreter.

Error rule (flash-attention's): against a float32 reference, the kernel's max error is at most twice
the max error of a same-dtype PyTorch implementation (`varlen_attention_ref(..., upcast=False)`), plus a
small per-dtype epsilon (the table below) for cases where that implementation is exact.

Without a GPU the kernel runs under `TRITON_INTERPRET=1` on CPU tensors. Triton reads that variable
when `@triton.jit` decorates, and it decorates its own `triton.language` helpers at import: conftest.py
imports triton with the variable set, before any test module. This module sets the variable again only
while its own tests run (the dispatcher reads it at call time; the launcher re-wraps hf_spin's kernels
for the interpreter if they were decorated without it), so other modules keep the fast reference path.
If triton was imported without the variable (not through conftest.py), the tests skip with that reason.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch

triton = pytest.importorskip(
    "triton", reason="triton is not installed: the kernel cannot run (the reference is tested elsewhere)"
)

from hf_spin.kernels import (  # noqa: E402
    pack_tree_masks,
    torch_varlen_unsupported,
    use_triton,
    varlen_attention,
    varlen_attention_ref,
    varlen_attention_torch,
    warm_up,
)
from hf_spin.kernels.varlen_triton import BlockConfig, _varlen_attention_triton  # noqa: E402

va = importlib.import_module("hf_spin.kernels.varlen_attention")  # the module: the package's attribute is the function
vt = importlib.import_module("hf_spin.kernels.varlen_triton")  # the kernels and their launcher

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 (see tests/conftest.py): "
        "its language helpers cannot run on CPU",
        allow_module_level=True,
    )

# dtype -> epsilon added to the 2x bound (absolute, on outputs of unit-variance values); and the lse tolerance.
EPSILON = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
LSE_ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _inputs(q_lens, k_lens, H, H_kv, D, dtype, seed=0, D_v=None, spare=None):
    """Packed q, k, v; `spare[b]` extra key slots after row b's keys filled with huge values (seqused_k)."""
    g = torch.Generator().manual_seed(seed)
    slots = [k + (spare[b] if spare else 0) for b, k in enumerate(k_lens)]
    q = torch.randn(sum(q_lens), H, D, generator=g)
    k = torch.randn(sum(slots), H_kv, D, generator=g)
    v = torch.randn(sum(slots), H_kv, D_v or D, generator=g)
    if spare:
        start = 0
        for b, n in enumerate(k_lens):
            k[start + n : start + slots[b]] = 1e4  # would dominate any softmax they leaked into
            v[start + n : start + slots[b]] = 1e4
            start += slots[b]
    return tuple(x.to(DEVICE, dtype) for x in (q, k, v)) + (_cu(q_lens).to(DEVICE), _cu(slots).to(DEVICE))


def _check(
    q_lens,
    k_lens,
    H,
    H_kv,
    D,
    dtype,
    causal=True,
    tree=None,
    num_splits=None,
    D_v=None,
    spare=None,
    seed=0,
    window=None,
):
    q, k, v, cu_q, cu_k = _inputs(q_lens, k_lens, H, H_kv, D, dtype, seed, D_v, spare)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=DEVICE) if spare else None
    tree = tree.to(DEVICE) if tree is not None else None
    args = (cu_q, cu_k, max(q_lens), max(k_lens), causal)
    kw = dict(tree_mask=tree, seqused_k=seqused, sliding_window=window)
    assert use_triton(q.device)
    out, lse = varlen_attention(q, k, v, *args, num_splits=num_splits, return_lse=True, **kw)
    ref, ref_lse = varlen_attention_ref(q.float(), k.float(), v.float(), *args, return_lse=True, **kw)
    torch_same = varlen_attention_ref(q, k, v, *args, upcast=False, **kw)
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    err_torch = (torch_same.float() - ref).abs().max().item() if out.numel() else 0.0
    assert out.dtype == dtype and out.shape == ref.shape
    assert err <= 2 * err_torch + EPSILON[dtype], (
        f"kernel error {err:.3g} > 2 x torch {dtype} error {err_torch:.3g} + eps"
    )
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key must get lse = -inf, and only those"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=LSE_ATOL[dtype], rtol=0)
    assert (out[~finite] == 0).all(), "a query that sees no key gets a zero output"
    return out


def _random_trees(q_lens, seed=1) -> torch.Tensor:
    """Random ancestor trees (node i's parent is a random earlier node), packed."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for n in q_lens:
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        m = torch.eye(n, dtype=torch.bool)
        for i in range(n):
            j = parent[i]
            while j >= 0:
                m[i, j] = True
                j = parent[j]
        masks.append(m)
    return pack_tree_masks(masks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "q_lens, k_lens, H, H_kv, D",
    [
        ([0, 1, 3, 0, 2], [5, 1, 7, 0, 1], 2, 2, 16),  # empty rows, a 1-token row, a row with fewer keys than queries
        ([4, 2, 5], [9, 2, 33], 6, 2, 40),  # odd head dim 40, GQA 6 -> 2
        ([1, 5], [70, 5], 4, 1, 72),  # head dim 72, MQA
    ],
    ids=["empty_and_length_1_rows", "gqa_6_2_head_dim_40", "mqa_head_dim_72"],
)
def test_kernel_matches_reference_on_ragged_rows(q_lens, k_lens, H, H_kv, D, dtype):
    _check(q_lens, k_lens, H, H_kv, D, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_rows_split_into_many_blocks(dtype):
    # 517 keys in splits of 64: 9 programs per (row, head) whose partials the merge kernel combines.
    _check([5, 1, 3], [517, 300, 3], H=2, H_kv=1, D=16, dtype=dtype, num_splits=9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_masks(dtype):
    _check([4, 1, 6], [20, 3, 70], 2, 1, 16, dtype, tree=_random_trees([4, 1, 6]), num_splits=2)


def test_causal_tree_mask_equals_causal_and_any_pattern_is_honoured():
    q_lens, k_lens = [3, 5], [10, 5]
    causal_tree = pack_tree_masks([torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens])
    out_tree = _check(q_lens, k_lens, 2, 2, 16, torch.float32, tree=causal_tree)
    out_causal = _check(q_lens, k_lens, 2, 2, 16, torch.float32)
    assert torch.allclose(out_tree, out_causal, atol=1e-6)
    # a pattern that is not lower triangular (a query sees a later new token) is applied as given
    g = torch.Generator().manual_seed(2)
    arbitrary = pack_tree_masks([torch.rand(n, n, generator=g) < 0.5 for n in q_lens])
    _check(q_lens, k_lens, 2, 2, 16, torch.float32, tree=arbitrary)


def test_non_causal_and_long_query_blocks():
    # 40 and 17 queries: the prefill tile (BLOCK_M = 64) rather than the verification tile.
    _check([40, 17], [40, 100], 2, 1, 32, torch.float16)
    _check([3, 7], [12, 7], 2, 1, 32, torch.float32, causal=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_seqused_k_ignores_spare_capacity(dtype):
    # Row b's slots are [cu_seqlens_k[b], cu_seqlens_k[b + 1]); only the first seqused_k[b] hold keys.
    _check([2, 1, 4], [9, 1, 130], 2, 1, 16, dtype, spare=[3, 0, 7], num_splits=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 6, 100])
def test_sliding_windows(window, dtype):
    # rows shorter and longer than the window, several splits (whole tiles before the window skipped),
    # spare capacity, and a row with fewer keys than queries
    _check([3, 1, 6, 2, 0], [5, 300, 140, 1, 4], 2, 1, 16, dtype, num_splits=3, spare=[0, 5, 2, 0, 1], window=window)


def test_sliding_window_reference_sees_the_last_keys_only():
    """One query per row: attention with window W equals attention over the row's last W keys."""
    q, k, v, cu_q, cu_k = _inputs([1, 1], [9, 3], 2, 1, 8, torch.float32)
    out = varlen_attention_ref(q, k, v, cu_q, cu_k, 1, 9, sliding_window=4)
    last = torch.cat([k[5:9], k[9:12]]), torch.cat([v[5:9], v[9:12]])
    expected = varlen_attention_ref(q, *last, cu_q, _cu([4, 3]), 1, 4)
    assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        varlen_attention_ref(q, k, v, cu_q, cu_k, 1, 9, sliding_window=0)
    with pytest.raises(ValueError, match="tree_mask is not supported"):
        varlen_attention_ref(
            q,
            k,
            v,
            cu_q,
            cu_k,
            1,
            9,
            sliding_window=4,
            tree_mask=pack_tree_masks([torch.ones(1, 1), torch.ones(1, 1)]).to(DEVICE),
        )


def test_random_ragged_batch_with_value_head_dim():
    # lengths as a random padding mask gives them; v with its own head dim (as MLA models have)
    g = torch.Generator().manual_seed(3)
    q_lens = torch.randint(0, 6, (6,), generator=g).tolist()
    k_lens = [n + int(torch.randint(0, 150, (1,), generator=g)) for n in q_lens]
    _check(q_lens, k_lens, 4, 2, 24, torch.float16, D_v=8, num_splits=3)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU machine the dispatcher always picks the kernel")
def test_dispatcher_falls_back_to_reference_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v, cu_q, cu_k = _inputs([2, 3], [4, 3], 2, 1, 8, torch.float32)
    assert not use_triton(q.device)
    out = varlen_attention(q, k, v, cu_q, cu_k, 3, 4)
    assert torch.equal(out, varlen_attention_ref(q, k, v, cu_q, cu_k, 3, 4))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _varlen_attention_triton(q, k, v, cu_q, cu_k, 3, 4, True, 1.0, None, None, None)


def test_errors_say_what_was_given():
    q, k, v, cu_q, cu_k = _inputs([2, 3], [4, 3], 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match=r"q must be \[total, heads, head_dim\].*\(1, 5, 2, 8\)"):
        varlen_attention(q[None], k, v, cu_q, cu_k, 3, 4)
    with pytest.raises(ValueError, match="int32.*torch.int64"):
        varlen_attention(q, k, v, cu_q.long(), cu_k, 3, 4)
    with pytest.raises(TypeError, match="float64"):
        varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 3, 4)
    with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple of key/value heads \(3\)"):
        varlen_attention(q, k.repeat(1, 3, 1), v.repeat(1, 3, 1), cu_q, cu_k, 3, 4)
    with pytest.raises(ValueError, match="contiguous in its head dim"):
        _varlen_attention_triton(
            q.transpose(0, 2).contiguous().transpose(0, 2), k, v, cu_q, cu_k, 3, 4, True, 1.0, None, None, None
        )
    with pytest.raises(ValueError, match="square"):
        pack_tree_masks([torch.ones(2, 3, dtype=torch.bool)])


def test_merge_formula_eq13_in_torch():
    # Two halves of a row's keys, each softmaxed on its own, merged with their log-sum-exps, equal
    # the softmax over all keys: O = sum_s e^{lse_s - lse} O_s, lse = ln sum_s e^{lse_s}.
    q, k, v, cu_q, cu_k = _inputs([1], [10], 1, 1, 8, torch.float32)
    full, lse = varlen_attention_ref(q, k, v, cu_q, cu_k, 1, 10, causal=False, return_lse=True)
    parts = [
        varlen_attention_ref(q, k[s], v[s], cu_q, _cu([4 if s.start == 0 else 6]), 1, 6, causal=False, return_lse=True)
        for s in (slice(0, 4), slice(4, 10))
    ]
    lse_all = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    merged = sum(torch.exp(p[1] - lse_all)[..., None] * p[0] for p in parts)
    assert torch.allclose(lse_all, lse, atol=1e-6) and torch.allclose(merged, full, atol=1e-6)


# --- GQA packing: the G query heads of a KV head share one tile (rows = query x G + head in group) ---


@pytest.mark.parametrize("group", [1, 2, 4, 7])
def test_gqa_packing_with_causal_tree_and_window_masks(group):
    # verification rows (the small tile for G <= 2, the large one above), an empty row, a row with fewer
    # keys than queries; G = 7 leaves tile rows that straddle two queries
    q_lens, k_lens = [3, 0, 5, 1], [9, 2, 70, 1]
    _check(q_lens, k_lens, 2 * group, 2, 16, torch.float16)
    _check(q_lens, k_lens, 2 * group, 2, 16, torch.float32, window=4, num_splits=2)
    _check([3, 5, 1], [9, 70, 1], 2 * group, 2, 16, torch.bfloat16, tree=_random_trees([3, 5, 1]))


def test_gqa_packing_on_prefill_rows():
    # 40 queries x G = 4: 160 packed rows in large tiles of 64, a tile ending mid-query; windows skip tiles
    _check([40, 3], [40, 90], 8, 2, 32, torch.float16)
    _check([40, 3], [40, 90], 8, 2, 32, torch.float32, window=7, num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_head_dims_of_the_block_table(head_dim, dtype):
    # 80: padded to 128 and masked. Each (head dim, dtype) takes its own table entry (256 in float32: one stage).
    _check([2, 1], [5, 3], 4, 2, head_dim, dtype)


def test_block_table_and_fallback_order():
    assert vt.block_config(128, 2, rows=16) == BlockConfig(16, 64, 4, 3)  # a verification row, G = 1
    assert vt.block_config(128, 2, rows=17).block_m == 64  # wider groups and prefill
    assert vt.block_config(80, 4, rows=1) == vt.block_config(128, 4, rows=1)  # padded to 128
    assert vt.block_config(256, 4, rows=64) == BlockConfig(32, 32, 8, 1)
    assert vt._fallback_configs(BlockConfig(64, 64, 4, 3)) == [
        BlockConfig(64, 64, 4, 3),
        BlockConfig(64, 64, 4, 1),
        BlockConfig(64, 32, 4, 1),
        BlockConfig(64, 16, 4, 1),
        BlockConfig(32, 16, 4, 1),
        BlockConfig(16, 16, 4, 1),
    ]
    with pytest.raises(vt.KernelUnavailable, match="head dim 512"):
        vt.block_config(512, 2, rows=1)


# --- fallbacks: configurations that do not fit, GPUs older than sm80 ---


@pytest.fixture
def fresh_fallback_state(monkeypatch):
    monkeypatch.setattr(vt, "_TOO_BIG", set())
    monkeypatch.setattr(va, "_WARNED", set())


def test_out_of_resources_retries_with_smaller_blocks(monkeypatch, fresh_fallback_state):
    launched = []
    launch = vt._launch_split_kernel

    def too_big_once(grid, args, constexprs, config):  # the table's configuration does not fit this "GPU"
        launched.append(config)
        if config.num_stages > 1:
            raise triton.runtime.errors.OutOfResources(160_000, 101_376, "shared memory")
        launch(grid, args, constexprs, config)

    monkeypatch.setattr(vt, "_launch_split_kernel", too_big_once)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback that fits warns nothing
        _check([3, 1], [9, 40], 4, 2, 16, torch.float16)
        assert launched == [BlockConfig(16, 64, 4, 3), BlockConfig(16, 64, 4, 1)]
        _check([2, 2], [5, 40], 4, 2, 16, torch.float16)
    assert launched[2:] == [BlockConfig(16, 64, 4, 1)], "a configuration that did not fit is not tried again"


def test_nothing_fits_falls_back_to_the_reference_with_one_warning(monkeypatch, fresh_fallback_state):
    def never_fits(grid, args, constexprs, config):
        raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(vt, "_launch_split_kernel", never_fits)
    q, k, v, cu_q, cu_k = _inputs([2, 3], [4, 3], 4, 2, 16, torch.float16)
    with pytest.warns(RuntimeWarning, match="no block configuration .* fits .* runs the PyTorch reference"):
        out = varlen_attention(q, k, v, cu_q, cu_k, 3, 4)
    assert torch.equal(out, varlen_attention_ref(q, k, v, cu_q, cu_k, 3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        varlen_attention(q, k, v, cu_q, cu_k, 3, 4)


def test_gpus_older_than_sm80_get_the_reference_and_a_clear_warning(monkeypatch, fresh_fallback_state):
    monkeypatch.setattr(vt, "_is_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(vt, "_launch_split_kernel", lambda *a: pytest.fail("the kernel must not launch below sm80"))
    q, k, v, cu_q, cu_k = _inputs([2, 3], [4, 3], 4, 2, 16, torch.float16)
    with pytest.warns(RuntimeWarning, match=r"Tesla T4 has compute capability 7\.5; .* needs sm80\+"):
        out, lse = varlen_attention(q, k, v, cu_q, cu_k, 3, 4, return_lse=True)
    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, 3, 4, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


# --- compiles: nothing that changes from step to step reaches the compile key ---


def _compile_key(kernel, constexprs: dict, args: tuple, config: BlockConfig | None = None) -> tuple:
    """What Triton specialises a launch on: constexprs, launch options, argument dtypes, and the value
    of every int argument not marked do_not_specialize (conservatively: its value, not just whether it
    is 1 or a multiple of 16)."""
    names = list(inspect.signature(kernel.fn).parameters)
    unspecialised = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    ints = tuple(a for name, a in zip(names, args) if isinstance(a, int) and name not in unspecialised)
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    return kernel.fn.__name__, tuple(sorted(constexprs.items())), config, ints, dtypes


def test_varying_batch_sizes_do_not_change_the_compile_key(monkeypatch):
    if not hasattr(vt._varlen_attention_split_kernel, "do_not_specialize"):
        pytest.skip("this triton's kernel object does not expose do_not_specialize")
    keys = set()
    launch_split, launch_merge = vt._launch_split_kernel, vt._launch_merge_kernel

    def record_split(grid, args, constexprs, config):
        keys.add(_compile_key(vt._varlen_attention_split_kernel, constexprs, args, config))
        launch_split(grid, args, constexprs, config)

    def record_merge(grid, args, constexprs):
        keys.add(_compile_key(vt._merge_splits_kernel, constexprs, args))
        launch_merge(grid, args, constexprs)

    monkeypatch.setattr(vt, "_launch_split_kernel", record_split)
    monkeypatch.setattr(vt, "_launch_merge_kernel", record_merge)
    batches = [
        ([1], [3], 1),
        ([4, 2, 3], [9, 5, 17], 1),
        ([2] * 7, [33] * 7, 1),
        ([3, 1], [200, 2], 2),
        ([1, 4], [300, 9], 5),
    ]
    for q_lens, k_lens, splits in batches:
        _check(q_lens, k_lens, 4, 2, 16, torch.float16, num_splits=splits)
        _check(
            q_lens, k_lens, 4, 2, 16, torch.float16, num_splits=splits, spare=[3] * len(q_lens)
        )  # seqused_k: one more mask flag
    # the split kernel with and without seqused_k, each writing the output (1 split) or float32 partials; one merge
    assert len(keys) == 5, "\n".join(map(str, keys))


def test_warm_up_launches_every_tile_and_split_variant(monkeypatch):
    seen = []
    launch = vt._launch_split_kernel

    def record(grid, args, constexprs, config):
        seen.append((config.block_m, grid[2] > 1))
        launch(grid, args, constexprs, config)

    monkeypatch.setattr(vt, "_launch_split_kernel", record)
    assert warm_up(16, 4, 2, torch.float16, DEVICE, max_seqlen_q=9) == 4
    assert sorted(set(seen)) == [
        (16, False),
        (16, True),
        (64, False),
        (64, True),
    ]  # 1 query x G = 2: small; 9 x 2: large
    seen.clear()
    assert (
        warm_up(16, 8, 1, torch.bfloat16, DEVICE, max_seqlen_q=2, prefill=False, tree_mask=True) == 2
    )  # G = 8: small tile
    assert sorted(set(seen)) == [(16, False), (16, True)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cpu":
        assert warm_up(16, 4, 2, torch.float16, "cpu") == 0  # the reference needs no compile


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU with about 12 GB free")
def test_offsets_past_2_31_elements():
    # A K / V cache of 2^21 + 200 tokens x 8 heads x 128 dims: the last row's keys start past element 2^31.
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs about 12 GB of free GPU memory")
    H_kv, D, n = 8, 128, 2**21 + 200
    k = torch.randn(n, H_kv, D, dtype=torch.float16, device=DEVICE)
    v = torch.randn(n, H_kv, D, dtype=torch.float16, device=DEVICE)
    q = torch.randn(8, 4 * H_kv, D, dtype=torch.float16, device=DEVICE)
    cu_q, cu_k = _cu([4, 4]), _cu([n - 100, 100])
    out = varlen_attention(q, k, v, cu_q, cu_k, 4, n - 100)
    ref = varlen_attention_ref(q[4:], k[n - 100 :], v[n - 100 :], _cu([4]), _cu([100]), 4, 100)
    assert (out[4:].float() - ref.float()).abs().max().item() < 2e-3


def test_torch_varlen_wrapper_says_why_it_cannot_run():
    # It runs on CUDA only (checked against the reference on an H200 with torch 2.11: causal, windows, GQA).
    q, k, v, cu_q, cu_k = _inputs([2, 3], [4, 3], 4, 2, 64, torch.float16)
    tree = pack_tree_masks([torch.ones(2, 2, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)]).to(DEVICE)
    reason = torch_varlen_unsupported(q, k, v, tree_mask=tree)
    assert any(why in reason for why in ("no torch.nn.attention.varlen", "CUDA only", "sm80", "no tree mask")), reason
    with pytest.raises(NotImplementedError, match="varlen_attention_torch: .*use varlen_attention"):
        varlen_attention_torch(q, k, v, cu_q, cu_k, 3, 4, tree_mask=tree)
