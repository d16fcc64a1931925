"""Ragged cache: holes must never change what a model computes.

Regression tests for models whose attention counts cache slots (short sliding windows, slot-indexed
ALiBi): a hole left inside a row by a rejected draft would push a real token out of the window.
"""

import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_spin
from hf_spin.cache import PackedCache, RectangularCache, RowCache, needs_contiguous_slots

from .archs import COMMON, ragged_batch, tiny_model
from .speculation import assert_speculated, perturb
from .speculation import pool as spin_pool


def mpt() -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mpt", d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128, **COMMON
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "make",
    [lambda: tiny_model("mistral", sliding_window=6), lambda: tiny_model("gemma2", sliding_window=6), mpt],
    ids=["mistral_window6", "gemma2_window6", "mpt_alibi"],
)
def test_slot_counting_models_stay_exact_at_batch_4(make):
    model = make()
    assert needs_contiguous_slots(model.config)
    ids, mask = ragged_batch(4, 14, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for drafters in (["prompt_lookup"], [perturb(make())]):  # a noisy copy: rejected drafts leave holes
        pool = spin_pool(drafters)
        out = model.generate(**kwargs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out, model.generate(**kwargs))
        assert_speculated(pool.last_stats, accepted=drafters != ["prompt_lookup"])


def test_full_attention_qwen2_does_not_force_compaction():
    assert not needs_contiguous_slots(tiny_model("qwen2").config)  # use_sliding_window=False by default


def test_rollback_and_compact_keep_each_rows_valid_slots():
    # [B=2, S=6] keys hold their own slot index, so a gather is visible in the values.
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    cache = RectangularCache(mask.clone())
    keys = torch.arange(6.0).view(1, 1, 6, 1).repeat(2, 1, 1, 1)
    cache.update(keys, keys.clone(), 0)
    cache.rollback(torch.tensor([2, 3]))  # row 0 keeps slots 0,1; row 1 keeps 1,2,3
    assert cache.slot_mask.tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]  # common tail of holes cropped
    cache.compact()
    assert cache.slot_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert cache.layers[0].keys[0, 0, 1:, 0].tolist() == [0.0, 1.0]
    assert cache.layers[0].keys[1, 0, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_a_cache_without_holes_forwards_without_a_mask():
    """Rows with every slot valid (batch 1, rows of one length) pass no attention mask, so SDPA keeps
    its causal kernel (a mask forces its math path); the first hole brings the mask back. Logits
    equal a plain forward's either way."""
    from hf_spin.cache.forward import forward_ragged

    model = tiny_model("llama")
    masks = []

    def spy(**kwargs):
        masks.append(kwargs["attention_mask"])
        return model(**kwargs)

    cache = RectangularCache(torch.zeros(2, 0, dtype=torch.bool))
    forward_ragged(model, cache, [[5, 6, 7], [8, 9, 10]], forward=spy)
    logits = forward_ragged(model, cache, [[11], [12, 13]], forward=spy)  # row 0 gets a hole
    assert masks[0] is None and masks[1] is not None and cache.has_holes()
    plain = model(torch.tensor([[8, 9, 10, 12, 13]])).logits
    torch.testing.assert_close(logits[1], plain[0, 3:])


def test_rows_leave_and_join_a_cache_rolled_back_to_no_slot():
    """A drafter whose cache every row rolled back to nothing (a full re-feed next time) keeps its
    layers' batch in step with the slot mask when rows leave or join (transformers' own row
    selection skips layers that hold no token)."""
    cache = RectangularCache(torch.ones(3, 2, dtype=torch.bool))
    keys = torch.randn(3, 1, 2, 4)  # [B, H, S, D]
    cache.update(keys, keys.clone(), 0)
    cache.rollback(torch.tensor([0, 0, 0]))
    assert cache.num_slots == 0 and cache.layers[0].keys.shape == (3, 1, 0, 4)
    cache.select_rows(torch.tensor([2]))
    assert cache.layers[0].keys.shape[0] == cache.slot_mask.shape[0] == 1
    cache.add_empty_rows(2)
    assert cache.layers[0].keys.shape[0] == cache.slot_mask.shape[0] == 3


def test_refuses_models_with_non_attention_layers():
    model = tiny_model("llama")
    model.config.layer_types = ["conv", "full_attention"]  # what lfm2 declares for its conv layers
    with pytest.raises(ValueError, match="stateful"):
        hf_spin.AssistantPool([model])


def test_both_caches_provide_the_row_cache_protocol():
    """`RowCache` lists what the engine and drafters call on either cache: both provide every call, with the
    protocol's parameter names (runtime_checkable's isinstance checks names only, not signatures)."""
    members = [name for name in vars(RowCache) if not name.startswith("_")]
    assert set(members) == {"device", "rollback", "select_rows", "add_empty_rows", "checkpoint", "restore"}
    for cache in (RectangularCache(torch.zeros(2, 0, dtype=torch.bool)), PackedCache(2)):
        assert isinstance(cache, RowCache)
        assert cache.device == torch.device("cpu")
        for name in members:
            if name != "device":
                wanted = list(inspect.signature(getattr(RowCache, name)).parameters)
                assert list(inspect.signature(getattr(type(cache), name)).parameters) == wanted, (
                    type(cache).__name__,
                    name,
                )
