"""`attn_implementation="hf_spin_varlen"` inside real model forwards: same logits as eager / sdpa.

Padded slots get zeros from the varlen path (as with flash-attention) and masked garbage from eager /
sdpa, so logits are compared at real tokens only. On CPU these run the PyTorch reference (the
dispatcher's fallback); one test runs the Triton kernel under the interpreter inside a model.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_spin.kernels
from hf_spin.kernels import ATTENTION_NAME, VarlenMetadata, varlen_attention_mask

from .archs import ARCHS, COMMON, ragged_batch

ARCHS_CHECKED = ("llama", "qwen2", "mistral", "gpt2")
ATOL = 1e-5  # float32 logits of a 2-layer random model


pytestmark = pytest.mark.usefixtures("one_thread")


def _models(arch: str, impls=(ATTENTION_NAME, "eager", "sdpa"), **overrides) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{**COMMON, **ARCHS[arch], **overrides})
    models = {}
    for impl in impls:
        models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        models[impl].load_state_dict(models[ATTENTION_NAME].state_dict())
    assert models[ATTENTION_NAME].config._attn_implementation == ATTENTION_NAME
    return models


@pytest.mark.parametrize("arch", ARCHS_CHECKED)
@torch.no_grad()
def test_padded_ragged_batch_logits_and_greedy_output_match_eager_and_sdpa(arch):
    models = _models(arch)
    ids, mask = ragged_batch(4, 12, seed=1)  # rows of 12, 10, 8, 6 real tokens, left-padded
    logits = {impl: m(input_ids=ids, attention_mask=mask).logits for impl, m in models.items()}
    real = mask.bool()
    for impl in ("eager", "sdpa"):
        assert torch.allclose(logits[ATTENTION_NAME][real], logits[impl][real], atol=ATOL), impl
    # decoding steps go through the cache: one query per row against keys with left padding
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(models[ATTENTION_NAME].generate(**kwargs), models["sdpa"].generate(**kwargs))


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
@torch.no_grad()
def test_sliding_windows_shorter_than_the_rows_match_eager_and_sdpa(arch):
    """Mistral (every layer) and Gemma-3 (local layers between global ones) with a 4-token window,
    on rows of 6-12 tokens: the window is applied, not refused."""
    models = _models(arch, sliding_window=4)
    ids, mask = ragged_batch(4, 12, seed=1)
    logits = {impl: m(input_ids=ids, attention_mask=mask).logits for impl, m in models.items()}
    real = mask.bool()
    for impl in ("eager", "sdpa"):
        assert torch.allclose(logits[ATTENTION_NAME][real], logits[impl][real], atol=ATOL), impl
    windowless = _models(arch, impls=(ATTENTION_NAME,))[ATTENTION_NAME](input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(windowless[real], logits[ATTENTION_NAME][real], atol=ATOL)  # the window matters here


@torch.no_grad()
def test_packed_rows_with_metadata_match_separate_rows():
    # transformers' padding-free format: input_ids [1, total] + position_ids restarting per row.
    model = _models("llama")[ATTENTION_NAME]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 96, (n,), generator=g) for n in (5, 1, 9)]
    packed = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    meta = VarlenMetadata.make_dummy([len(r) for r in rows], [len(r) for r in rows])
    out = model(input_ids=packed, position_ids=positions, spin_varlen=meta, use_cache=False).logits[0]
    start = 0
    for r in rows:
        alone = model(input_ids=r[None], use_cache=False).logits[0]
        assert torch.allclose(out[start : start + len(r)], alone, atol=ATOL)
        start += len(r)


def test_mask_builder_returns_padding_mask_or_none():
    full = torch.ones(2, 5, dtype=torch.bool)
    assert varlen_attention_mask(2, 5, 5, attention_mask=None) is None
    assert varlen_attention_mask(2, 5, 5, attention_mask=full) is None
    padded = full.clone()
    padded[1, :2] = False
    assert torch.equal(varlen_attention_mask(2, 1, 5, attention_mask=padded), padded)


def test_refuses_soft_capping_with_a_clear_error():
    model = _models("gemma2", impls=(ATTENTION_NAME,), attn_logit_softcapping=50.0)[ATTENTION_NAME]
    with pytest.raises(NotImplementedError, match="soft-capping.*gemma2"):
        model(input_ids=torch.tensor([[3, 4, 5]]))


def test_names_transformers_special_cases_are_refused():
    with pytest.raises(ValueError, match="flash"):
        hf_spin.kernels.register("my_flash_varlen")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@torch.no_grad()
def test_triton_kernel_inside_a_model_forward(monkeypatch):
    import triton.language

    if not torch.cuda.is_available() and type(triton.language.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (see tests/conftest.py)")
    models = _models("qwen2")
    ids, mask = ragged_batch(3, 8, seed=2)
    reference = models["eager"](input_ids=ids, attention_mask=mask).logits
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hf_spin.kernels.use_triton(ids.device)
    out = models[ATTENTION_NAME](input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(out[mask.bool()], reference[mask.bool()], atol=ATOL)
