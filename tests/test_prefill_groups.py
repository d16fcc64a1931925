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
