"""Prefill groups (hf_spin/planning/prefill.py): where the cost profile prices a forward by its positions (a
CPU), a batch of one long and several short prompts is prefilled in groups of similar length instead of one
block padded to the longest; where a forward's fixed cost dominates (a GPU), as `generate` does. Lossless
(greedy identity with plain `generate`), the forwards run as priced, and the clock shows the saving: on
injected costs, so the decision is tested on machines we lack."""

from __future__ import annotations

import pytest
import torch

import hf_spin
from benchmarks.injected_costs import CostClock, profile_of, table
from hf_spin.planning.cost_profile import ForwardCost
from hf_spin.planning.prefill import prefill_groups

from .archs import ARCHS, EOS, PAD, VOCAB, tiny_model


def linear(n: float) -> float:
    """A CPU-like t(N): a plain step 0.1 s, each position 0.01 s more."""
    return 0.09 + 0.01 * n


def flat(n: float) -> float:
    """A GPU-like t(N): 64 positions cost 1.1 plain steps."""
    return 0.1 + 0.01 * (n - 1) / 63


def test_groups_split_long_prompts_from_short_ones_where_positions_cost():
    cpu, gpu = table(linear), table(flat)
    assert prefill_groups(cpu, [5, 700, 6, 40]) == [[0, 2], [3], [1]]
    assert prefill_groups(cpu, [30, 30, 30, 30]) == [[0, 1, 2, 3]]  # nothing to save: generate's block
    assert prefill_groups(gpu, [5, 40, 6, 30]) == [[0, 1, 2, 3]]  # a forward's fixed cost outweighs the padding
    assert prefill_groups(gpu, [5, 700, 6, 40]) == [[0, 2, 3], [1]]  # 2,800 positions past the grid do not


def small_gemm(n: float) -> float:
    """A t(N) whose grid misleads past its knots: 2 and 8 positions cost alike (a CPU's small-GEMM step), so
    the knots 1, 2, 8 read past 8 either flat (the last slope) or at 0.013 s a position (the mean slope);
    past 8 each position costs 0.01 s."""
    return 0.1 if n <= 1 else 0.19 + 0.01 * max(n - 8, 0)


def test_groups_split_only_where_the_cheapest_reading_past_the_grid_pays():
    """Priced past the grid by its mean slope, four similar prompts of 51-77 tokens were split into three
    forwards, dearer than one (Qwen2.5-Coder-1.5B, float32, AVX2: 0.4 s); read at the last knot's slope a split
    is taken only where it pays even so, and a 700-token prompt among short ones still goes apart."""
    grid = ForwardCost.from_table({1: 0.1, 2: 0.19, 8: 0.2})
    assert prefill_groups(grid, [51, 75, 56, 77]) == [[0, 1, 2, 3]]
    assert prefill_groups(grid, [5, 700, 6, 40]) == [[0, 2, 3], [1]]


def test_a_prefill_learned_before_the_steps_teach_the_shift_reads_what_it_took():
    """A grid read from the cache on a faster hour: today every forward takes 1.5x it. The first call's prefill,
    far past the knots, becomes a knot at what it took before any step has taught the shift; the steps then
    raise the grid's knots 1.5x, not the learned one, which was measured as the machine runs now. Raised again it
    read 1.5x what it took, its slope past it twice the truth, and four prompts of 51-77 tokens were split into
    two prefills, dearer than one (Qwen2.5-Coder-1.5B, float32, an AVX2-held Xeon: 2.4 s read for 1.6 s)."""
    cost = ForwardCost.from_table({1: 0.32, 2: 0.66, 8: 0.69})
    cost.observe(51, 1, 1.6, shared=False)  # the prefill (`CostProfile.observe_prefill`)
    assert cost.knots == [1, 2, 8, 51]
    for _ in range(200):  # the call's plain steps, 1.5x the grid
        cost.observe(1, 1, 1.5 * 0.32)
    assert cost.predict(1) == pytest.approx(0.48, rel=0.02) and cost.predict(8) == pytest.approx(1.035, rel=0.02)
    assert cost.predict(51) == pytest.approx(1.6, rel=0.02)
    assert prefill_groups(cost, [51, 75, 56, 77]) == [[0, 1, 2, 3]]


def ragged_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts `[B, max(lengths)]` and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("cache", ["rectangular", "static"])
@pytest.mark.parametrize("costs,prefills", [(linear, [(2, 4), (2, 36)]), (flat, [(4, 36)])])
def test_a_ragged_batch_prefills_in_the_groups_priced_and_commits_what_plain_generate_does(cache, costs, prefills):
    """Prompts of 3, 36, 4 and 30 tokens at batch 4. On `linear` costs the prefill runs as two forwards (the two
    short rows, the two long ones) in less clock time than `generate`'s one padded block; on `flat` costs as that
    one block. Either way the output is plain `generate`'s, rows in their order, the prompt-lookup drafts verified
    against the right rows."""
    new_tokens = 12
    target = tiny_model("llama", seed=0)
    ids, mask = ragged_prompts([3, 36, 4, 30])
    kwargs = dict(
        attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS
    )
    plain = target.generate(ids, **kwargs)
    clock, cost = CostClock(), table(costs)
    clock.hook(target, cost)
    shapes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    pool = hf_spin.AssistantPool(["prompt_lookup"], profile=profile_of(cost, [None], ["prompt_lookup"]), cache=cache)
    with clock.installed():
        out = target.generate(ids, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
    assert torch.equal(out, plain)
    assert shapes[: len(prefills)] == prefills, shapes
    assert shapes[len(prefills)][1] < 30, shapes  # then decoding
    spin_prefill = sum(cost.predict(rows * width, rows) for rows, width in prefills)
    assert spin_prefill <= cost.predict(4 * 36, 4) + 1e-9
    if costs is linear:
        assert spin_prefill < 0.7 * cost.predict(4 * 36, 4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_prefilled_in_groups_decodes_as_plain_generate(arch):
    """The same ragged batch on every tiny architecture (learned, rotary and ALiBi positions, sliding windows,
    latent attention): prefilled in the two groups `linear` prices cheapest, greedy output plain `generate`'s."""
    target = tiny_model(arch, seed=0)
    ids, mask = ragged_prompts([3, 36, 4, 30])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=EOS)
    plain = target.generate(ids, **kwargs)
    cost, shapes = table(linear), []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    pool = hf_spin.AssistantPool(["prompt_lookup"], profile=profile_of(cost, [None], ["prompt_lookup"]))
    out = target.generate(ids, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
    assert torch.equal(out, plain)
    assert shapes[:2] == [(2, 4), (2, 36)], shapes


@pytest.mark.parametrize("cache", ["rectangular", "static"])
def test_a_prefill_far_past_the_grid_teaches_the_next_calls_groups(cache):
    """A grid flat past 2 positions reads long forwards at one forward's cost, so the first call prefills a
    ragged batch as `generate` does, in one block; that forward, far past the knots, becomes a knot at what it
    took (`CostProfile.observe_prefill`), and the next call on the same prompts splits them by length, in
    less clock time. Both as plain `generate`. Not on the static layout, whose eager prefill says nothing of its
    compiled steps: there the prefill leaves no knot."""
    target = tiny_model("llama", seed=0)
    ids, mask = ragged_prompts([3, 120, 4, 30])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=EOS)
    plain = target.generate(ids, **kwargs)
    truth = table(small_gemm, knots=(1, 2, 8, 16, 64, 256, 1024))
    clock, shapes = CostClock(), []
    clock.hook(target, truth)
    target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    grid = ForwardCost.from_table({n: small_gemm(n) for n in (1, 2, 8)})
    pool = hf_spin.AssistantPool(["prompt_lookup"], profile=profile_of(grid, [None], ["prompt_lookup"]), cache=cache)
    learns = cache == "rectangular"
    seconds = []
    with clock.installed():
        for prefills in [[(4, 120)], [(2, 4), (1, 30), (1, 120)]][: 2 if learns else 1]:
            shapes.clear()
            start = clock()
            out = target.generate(ids, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
            seconds.append(clock() - start)
            assert torch.equal(out, plain)
            assert shapes[: len(prefills)] == prefills, shapes
    assert (480 in pool.profile.target.knots) == learns
    if learns:
        assert seconds[1] < 0.5 * seconds[0], seconds
