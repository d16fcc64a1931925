"""The packed per-row cache and the engine path on it (`AssistantPool(cache="packed")`).

Greedy output with `AssistantPool(..., cache="packed")` must equal plain `generate` (float32,
ragged left-padded batches of 4 and 8) on llama, qwen2, mistral and gpt2 with drafts mostly rejected
(another seed: rollback), all accepted (the target itself), prompt lookup, and a round robin of a model
drafter and prompt lookup (catch-up forwards). Plus hand-built cache cases and memory accounting.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from transformers import DynamicCache

import hf_spin
import hf_spin.kernels.attention as varlen_attention_module
from hf_spin.cache import CACHE_ARG, PackedCache, RectangularCache, forward_ragged, grow_capacity
from hf_spin.step.engine import SpinEngine
from hf_spin.step.rows import Request

from .archs import ragged_batch, tiny_model
from .speculation import assert_speculated, greedy_case, multi_token, perturbed
from .speculation import pool as spin_pool

ARCHS_CHECKED = ("llama", "qwen2", "mistral", "gpt2")
PROMPT_LENGTH, MAX_NEW_TOKENS = 14, 24


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch):
    return tiny_model(arch, seed=0), perturbed(arch)


@functools.lru_cache(maxsize=None)
def _case(arch, batch):
    return greedy_case(_models(arch)[0], batch, PROMPT_LENGTH, MAX_NEW_TOKENS)


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts attention calls that took the packed (spin_varlen) path."""
    calls = []
    original = varlen_attention_module._packed

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(varlen_attention_module, "_packed", counting)
    return calls


@pytest.mark.parametrize("batch", [4, 8])
@pytest.mark.parametrize("arch", ARCHS_CHECKED)
@pytest.mark.parametrize("drafter", ["other", "self", "prompt_lookup", "round_robin"])
def test_greedy_output_equals_plain_generate(arch, batch, drafter, packed_calls):
    target, other = _models(arch)
    inputs, reference = _case(arch, batch)
    drafters = {
        "other": [other],
        "self": [target],
        "prompt_lookup": ["prompt_lookup"],
        "round_robin": [other, "prompt_lookup"],
    }[drafter]
    pool = spin_pool(drafters, policy="round_robin" if drafter == "round_robin" else "fixed", cache="packed")
    implementation = target.config._attn_implementation
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert target.config._attn_implementation == implementation  # switched for our forwards only
    assert len(packed_calls) > 0 and all(shape[0] == 1 for shape in packed_calls)  # packed [1, H, total_q, D]
    assert_speculated(pool.last_stats, rejected=drafter != "self")


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_windows_shorter_than_the_rows(arch, packed_calls):
    """A 6-token window on rows of 8-38 tokens, in the target and in the drafter (Gemma-3-270M's 512
    on Spec-Bench's long prompts): packed, its output equals plain generate's."""
    target, other = tiny_model(arch, seed=0, sliding_window=6), tiny_model(arch, seed=1, sliding_window=6)
    ids, mask = ragged_batch(4, PROMPT_LENGTH, seed=0)
    inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    reference = target.generate(**inputs)
    pool = spin_pool([other, "prompt_lookup"], policy="round_robin", cache="packed")
    assert torch.equal(target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool), reference)
    assert len(packed_calls) > 0
    assert_speculated(pool.last_stats)


def test_refuses_models_without_attention_interface():
    model = tiny_model("falcon")
    with pytest.raises(ValueError, match="AttentionInterface.*falcon"):
        model.generate(
            input_ids=torch.tensor([[3, 4, 5]]),
            max_new_tokens=2,
            custom_generate=hf_spin.generate,
            assistant_pool=spin_pool(["prompt_lookup"], cache="packed"),
        )


def _fill(cache: PackedCache, chunks: list[list[float]]) -> None:
    """Append tokens whose key and value are their own id (1 layer, 1 head, head dim 1)."""
    cache.begin([len(c) for c in chunks])
    states = torch.tensor([t for c in chunks for t in c], dtype=torch.float32).view(1, 1, -1, 1)
    cache.update(states, states.clone(), 0)
    cache.commit()


def _rows(cache: PackedCache) -> list[list[float]]:
    keys = cache.layers[0].keys[:, 0, 0].tolist()
    return [keys[s : s + n] for s, n in zip(cache.starts, cache.lengths)]


def test_append_rollback_and_retire_rows_by_hand():
    cache = PackedCache(3)
    _fill(cache, [[1, 2, 3], [10], []])
    assert cache.lengths == [3, 1, 0] and _rows(cache) == [[1, 2, 3], [10], []]
    assert cache.capacity == [grow_capacity(3), grow_capacity(1), 0]
    _fill(cache, [[4, 5], [], [20, 21]])  # row 2 outgrows its 0 slots: every row is moved, in order
    assert _rows(cache) == [[1, 2, 3, 4, 5], [10], [20, 21]]
    cache.rollback(torch.tensor([4, 1, 1]))  # reject 5 and 21: no copy, the slots are reused
    assert _rows(cache) == [[1, 2, 3, 4], [10], [20]]
    _fill(cache, [[6], [11, 12], [22]])
    assert _rows(cache) == [[1, 2, 3, 4, 6], [10, 11, 12], [20, 22]]
    cache.select_rows(torch.tensor([2, 0]))  # retire row 1, reorder
    assert _rows(cache) == [[20, 22], [1, 2, 3, 4, 6]]
    assert cache.total_slots == grow_capacity(2) + grow_capacity(5)


def test_memory_accounting_against_a_padded_cache():
    cache = PackedCache(4)
    _fill(cache, [[1] * 200, [1] * 3, [1] * 3, [1] * 3])
    per_token = 2 * 4  # key + value, float32, 1 head of dim 1
    assert cache.bytes_per_token() == per_token
    assert cache.bytes_used() == 209 * per_token
    assert cache.padded_bytes() == 4 * 200 * per_token
    assert cache.bytes_held() == (grow_capacity(200) + 3 * grow_capacity(3)) * per_token
    assert cache.bytes_held() < cache.padded_bytes() / 2


@torch.no_grad()
def test_forward_packed_matches_a_dynamic_cache_row_by_row():
    model = _models("llama")[0]
    prompts, steps = [[5, 6, 7, 8], [9], [10, 11, 12]], [[13, 14], [15, 16, 17], [18]]
    cache = PackedCache(3)
    forward_ragged(model, cache, prompts, all_logits=False)
    packed = forward_ragged(model, cache, steps)  # [B, T, V] right-padded with zeros
    for b in range(3):
        alone = model(input_ids=torch.tensor([prompts[b] + steps[b]]), **{CACHE_ARG: DynamicCache()}).logits[0]
        assert torch.allclose(packed[b, : len(steps[b])], alone[len(prompts[b]) :], atol=1e-5)
        assert (packed[b, len(steps[b]) :] == 0).all()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_engine_with_the_triton_kernel_under_the_interpreter(monkeypatch):
    import triton.language

    if not torch.cuda.is_available() and type(triton.language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (see tests/conftest.py)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    target, other = _models("qwen2")
    ids, mask = ragged_batch(3, 8, seed=5)
    inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    reference = target.generate(**inputs)
    pool = spin_pool([target], cache="packed", draft_length=multi_token(3))
    assert torch.equal(target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool), reference)
    assert_speculated(pool.last_stats, rejected=False)


def test_sampling_runs_on_the_packed_path(packed_calls):
    # distribution checks live in test_sampling.py (default path); here: the packed path samples, keeps
    # the prompts and the target's attention implementation
    target, other = _models("llama")
    inputs, _ = _case("llama", 4)
    torch.manual_seed(0)
    pool = spin_pool([other], cache="packed")
    out = target.generate(
        **{**inputs, "do_sample": True, "temperature": 0.8}, custom_generate=hf_spin.generate, assistant_pool=pool
    )
    assert torch.equal(out[:, :PROMPT_LENGTH], inputs["input_ids"]) and out.shape[1] <= PROMPT_LENGTH + MAX_NEW_TOKENS
    assert len(packed_calls) > 0
    assert_speculated(pool.last_stats)


@pytest.mark.parametrize(
    "cache, layout", [(None, RectangularCache), ("rectangular", RectangularCache), ("packed", PackedCache)]
)
def test_cache_parameter_picks_the_layout(cache, layout):
    """`AssistantPool(cache=...)` picks the KV layout of the target and of the model drafters
    (rectangular by default)."""
    target, other = _models("llama")
    pool = spin_pool([other]) if cache is None else spin_pool([other], cache=cache)
    assert pool.cache_layout == (cache or "rectangular")
    engine = SpinEngine(target, pool)
    assert engine.cache_layout == pool.cache_layout
    engine.add(Request(prompt=list(range(3, 3 + PROMPT_LENGTH)), max_new_tokens=8))
    engine.step()  # admission
    engine.step()  # a draft and a verification
    assert type(engine.cache) is layout and type(pool.drafters[0].cache) is layout
    assert pool.drafters[0].cache_layout == pool.cache_layout
    engine.close()


@pytest.mark.parametrize("ragged_attention, layout", [(True, "packed"), (False, "rectangular")])
def test_ragged_attention_keyword_warns_and_still_picks_the_layout(ragged_attention, layout):
    target, other = _models("llama")
    with pytest.warns(FutureWarning, match=r'ragged_attention=\.\.\.\) is deprecated; use cache="packed"'):
        pool = spin_pool([other], ragged_attention=ragged_attention)
    assert pool.cache_layout == layout
    with pytest.warns(FutureWarning):  # both, agreeing: no conflict
        assert spin_pool([other], cache=layout, ragged_attention=ragged_attention).cache_layout == layout
    batch = {"input_ids": torch.tensor([list(range(3, 3 + PROMPT_LENGTH))]), "max_new_tokens": 6, "do_sample": False}
    out = target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, target.generate(**batch))


def test_conflicting_or_unknown_cache_layouts_are_refused():
    for cache, ragged_attention in (("rectangular", True), ("packed", False)):
        conflict = f"cache={cache!r} and ragged_attention={ragged_attention} conflict"
        with pytest.warns(FutureWarning), pytest.raises(ValueError, match=conflict):
            hf_spin.AssistantPool(["prompt_lookup"], cache=cache, ragged_attention=ragged_attention)
    with pytest.raises(
        ValueError, match=r"^cache='ragged' is not supported; give one of 'rectangular', 'packed', 'static'$"
    ):
        hf_spin.AssistantPool(["prompt_lookup"], cache="ragged")
    with pytest.raises(ValueError, match="cache=True is not supported"):
        hf_spin.AssistantPool(["prompt_lookup"], cache=True)
