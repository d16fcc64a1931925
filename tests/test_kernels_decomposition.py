"""Spin's request-decomposition planner: hand-built cases, the pruned search against brute force, and
the decomposed (padded-blocks + Eq. 13 merge) attention against the varlen reference."""

import random

import pytest
import torch

from hf_spin.kernels import varlen_attention_ref
from hf_spin.kernels.decomposition import brute_force_block_width, decomposed_attention, make_plan, plan_decomposition


def test_worked_example_from_the_docstring():
    plan = plan_decomposition([4, 8, 13])
    assert (plan.block_width, plan.num_blocks, plan.padded_tokens, plan.padded_tokens_unsplit) == (4, 7, 3, 14)
    assert plan.block_row == [0, 1, 1, 2, 2, 2, 2]
    assert plan.block_start == [0, 0, 4, 0, 4, 8, 12]
    assert plan.block_length == [4, 4, 4, 4, 4, 4, 1]


def test_equal_lengths_are_not_split():
    plan = plan_decomposition([64, 64, 64])
    assert (plan.block_width, plan.num_blocks, plan.padded_tokens) == (64, 3, 0)


def test_one_long_row_is_cut_to_the_short_rows_width():
    # [100, 100, 1000]: width 100 -> 12 blocks, no padding; unsplit pads 1800 tokens
    plan = plan_decomposition([100, 100, 1000])
    assert (plan.block_width, plan.num_blocks, plan.padded_tokens, plan.padded_tokens_unsplit) == (100, 12, 0, 1800)


def test_block_overhead_trades_padding_for_fewer_blocks():
    # [5, 1000]: width 5 pads nothing but makes 201 blocks; at 20 tokens per block a wider block
    # that pads some tokens costs less (objective = padded + 20 * blocks)
    free = plan_decomposition([5, 1000])
    assert (free.block_width, free.num_blocks, free.padded_tokens) == (5, 201, 0)
    priced = plan_decomposition([5, 1000], block_overhead=20)
    assert priced.block_width == brute_force_block_width([5, 1000], block_overhead=20)
    assert priced.padded_tokens + 20 * priced.num_blocks < 20 * 201


def test_multiple_of_and_empty_rows():
    plan = plan_decomposition([0, 30, 70], multiple_of=16)
    assert plan.block_width % 16 == 0 and plan.block_row.count(0) == 0
    assert plan.block_width == brute_force_block_width([0, 30, 70], multiple_of=16)
    assert plan_decomposition([0, 0]).num_blocks == 0


def test_pruned_search_equals_brute_force_on_random_batches():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(0, 300) for _ in range(rng.randint(1, 8))]
        if not any(lengths):
            continue
        kw = dict(multiple_of=rng.choice([1, 1, 16]), block_overhead=rng.choice([0, 0, 8, 64]))
        plan = plan_decomposition(lengths, **kw)
        best = brute_force_block_width(lengths, **kw)
        assert plan.block_width == best, (lengths, kw)
        assert plan.padded_tokens == make_plan(lengths, best).padded_tokens >= 0


def test_errors():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        plan_decomposition([3, -1])
    with pytest.raises(ValueError, match="block width"):
        make_plan([3], 0)


@pytest.mark.parametrize("width", [None, 3, 16])
def test_decomposed_attention_matches_reference(width):
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = [3, 0, 1, 5], [40, 7, 1, 5]
    H, H_kv, D = 4, 2, 8
    q = torch.randn(sum(q_lens), H, D, generator=g)
    k = torch.randn(sum(k_lens), H_kv, D, generator=g)
    v = torch.randn(sum(k_lens), H_kv, D, generator=g)
    cu_q = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 47, 48, 53], dtype=torch.int32)
    plan = make_plan(k_lens, width) if width else None
    out = decomposed_attention(q, k, v, cu_q, cu_k, 5, 40, plan=plan)
    assert torch.allclose(out, varlen_attention_ref(q, k, v, cu_q, cu_k, 5, 40), atol=1e-5)
