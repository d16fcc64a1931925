"""Encoder-decoder targets (docs/design.md, "Encoder-decoder targets"): lossless, and refused where not.

Greedy: `generate(..., custom_generate=hf_spin.generate, assistant_pool=pool)` equals plain `generate`
on tiny random Whisper (its own `generate`: forced language and task tokens in the decoder prompt) and
T5 (right-padded encoder inputs of different lengths), at batch 1 and 4, rows stopping at different
steps (a second EOS id some rows meet) so that rows retire with their cross-attention K/V, with a
same-family model drafter (its own encoder), a decoder-only assistant reading the target's encoder
output (distil-whisper's layout), prompt lookup and suffix drafting, under the fixed and LBSS policies,
and through `hf_spin.enable()`. Sampled: the engine keeps a tiny Whisper's joint
distribution of three tokens (test_sampling.py's chi-square check and its lossy control).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, WhisperForCausalLM

import hf_spin
import hf_spin.verify.chains
from hf_spin.cache.encoder_rows import EncoderRows
from hf_spin.generation import SpinGenerateEncoderDecoderOutput

from .archs import EOS, PAD, WHISPER_FRAMES, encoder_inputs, tiny_encoder_decoder, tiny_model
from .speculation import assert_speculated, lookup_would_speculate_somewhere, perturb
from .speculation import pool as spin_pool
from .test_sampling import (
    ALPHA,
    LARGE_N,
    MEASURED,
    PROMPT,
    SMALL_N,
    SMALL_V,
    _sampled_counts,
    accept_after_first,
    exact_joint,
    fits,
    tv,
)

MAX_NEW_TOKENS = 24
ARCHS = ("whisper", "t5")
# what makes a tiny random model's output depend on its encoder and vary (the default inits barely do)
INIT = {"whisper": dict(init_std=0.1), "t5": dict(initializer_factor=3.0)}
# Whisper's own generate puts the forced start, language, task and no-timestamps tokens in the decoder prompt
DECODER_PROMPT = {"whisper": dict(language="en", task="transcribe"), "t5": {}}
DRAFTERS = ("model", "prompt_lookup", "suffix")

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, a noisy copy with its own encoder: the same-family drafter)."""
    return tiny_encoder_decoder(arch, **INIT[arch]), perturb(tiny_encoder_decoder(arch, **INIT[arch]))


# where generated tokens start in an output: T5's start token; Whisper's start, language, task, no-timestamps
DECODER_PROMPT_LENGTH = {"whisper": 4, "t5": 1}


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    """(generate kwargs, plain greedy output) for the first input seed where prompt lookup would draft
    several tokens, some right, some wrong, and (batch 4) rows stop at different steps: a second EOS id,
    row 0's 7th generated token where the last row never generates it (row 0 retires before the others)."""
    target = _models(arch)[0]
    for seed in range(64):
        inputs = {**encoder_inputs(arch, batch, seed), **DECODER_PROMPT[arch]}
        inputs.update(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        reference = target.generate(**inputs)
        start = DECODER_PROMPT_LENGTH[arch]
        eos = [EOS]
        if batch > 1:
            extra = int(reference[0, start + 6])
            if extra in reference[-1, start:].tolist():
                continue
            eos.append(extra)
            inputs["eos_token_id"] = eos
            reference = target.generate(**inputs)
        outputs = [row[start:].tolist() for row in reference]
        prompts = [row[:start].tolist() for row in reference]
        if lookup_would_speculate_somewhere(prompts, outputs, eos):
            return inputs, reference
    raise AssertionError(f"{arch}: no input seed where prompt lookup drafts right and wrong")


def _assert_lossless(target, inputs, reference, pool, **speculated) -> hf_spin.GenerationStats:
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"{out}\n!= plain generate's\n{reference}"
    assert_speculated(pool.last_stats, **speculated)
    return pool.last_stats


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equivalence(arch, drafter, batch):
    target, other = _models(arch)
    inputs, reference = _case(arch, batch)
    if batch > 1:  # rows of different output lengths: some retire while others run
        ends = [(row == inputs["eos_token_id"][1]).any() | (row == EOS).any() for row in reference]
        assert any(ends) and not all(ends), reference
    entry = other if drafter == "model" else drafter
    pool = spin_pool([entry])
    if drafter == "suffix":  # a second call drafts from the first's decoder outputs too (test_suffix.py's check)
        _assert_lossless(target, inputs, reference, pool, accepted=False, rejected=False, longest=0)
    _assert_lossless(target, inputs, reference, pool, rejected=drafter != "suffix")
    if drafter == "model":
        assert isinstance(hf_spin.AssistantPool([other]).drafters[0], hf_spin.EncoderDecoderDrafter)


def test_decoder_only_assistant_reads_the_targets_encoder_output():
    """distil-whisper's layout: a `WhisperForCausalLM` (here the target's decoder with noise on its weights)
    cross-attends to the target's encoder output, running no encoder of its own."""
    target = _models("whisper")[0]
    assistant = WhisperForCausalLM(copy.deepcopy(target.config)).eval()  # its init sets is_encoder_decoder=False
    weights = {"model.decoder." + k: v for k, v in target.model.decoder.state_dict().items()}
    assistant.load_state_dict({**weights, "proj_out.weight": target.proj_out.weight})
    pool = spin_pool([perturb(assistant)])
    assert isinstance(pool.drafters[0], hf_spin.EncoderDecoderDrafter) and not pool.drafters[0].own_encoder
    _assert_lossless(target, *_case("whisper", 4), pool)


def test_causal_lm_drafts_decoder_tokens():
    """A causal LM sharing the vocabulary drafts on the decoder's tokens (no encoder at all)."""
    target = _models("t5")[0]
    pool = spin_pool([tiny_model("llama")])
    _assert_lossless(target, *_case("t5", 4), pool, accepted=False, rejected=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_lbss_pool_equivalence(arch):
    target, other = _models(arch)
    pool = spin_pool([other, "prompt_lookup", "suffix"], policy="lbss")
    _assert_lossless(target, *_case(arch, 4), pool)


def test_whisper_generate_with_pool_after_enable():
    """`hf_spin.enable()`: Whisper's own `generate` (forced language and task, a logits processor over
    token ids) hands `assistant_pool=` on to hf_spin, plain and as a dict."""
    target, other = _models("whisper")
    inputs, _ = _case("whisper", 4)
    inputs = {**inputs, "repetition_penalty": 1.3}
    reference = target.generate(**inputs)
    dict_reference = target.generate(**inputs, return_dict_in_generate=True)
    pool = spin_pool([other])
    hf_spin.enable()
    try:
        out = target.generate(**inputs, assistant_pool=pool)
        assert torch.equal(out, reference), f"{out}\n{reference}"
        assert_speculated(pool.last_stats)
        as_dict = target.generate(**inputs, return_dict_in_generate=True, assistant_pool=pool)
    finally:
        hf_spin.disable()
    assert torch.equal(as_dict.sequences, dict_reference.sequences)


def test_measured_profile_and_planner(tmp_path):
    """A measured cost profile (the target's and the model drafter's decoder forwards over a random
    encoder output) and the planner sizing every step from it: still identical."""
    target, other = _models("t5")
    inputs, reference = _case("t5", 4)
    pool = spin_pool([other, "prompt_lookup"], policy="lbss", profile=tmp_path / "profile.json")
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert pool.planner is not None and pool.cost_profile.drafters[0] is not None, str(pool.cost_profile)


def _t5_requests(target):
    """(three unpadded T5 prompts [1, S_b], each one's plain greedy tokens, a function making an engine
    `Request` of a prompt with its encoder output, as a server would)."""
    text = encoder_inputs("t5", 3, seed=1)
    prompts = [ids[mask.bool()][None] for ids, mask in zip(text["input_ids"], text["attention_mask"])]  # [1, S_b]
    plain = [target.generate(input_ids=ids, max_new_tokens=12, do_sample=False)[0, 1:].tolist() for ids in prompts]

    def request(ids: torch.Tensor) -> hf_spin.Request:
        with torch.no_grad():
            hidden = target.get_encoder()(input_ids=ids).last_hidden_state  # [1, S_b, D]
        mask = torch.ones_like(ids)
        return hf_spin.Request([PAD], max_new_tokens=12, encoder=EncoderRows(hidden, mask, ids, mask))

    return prompts, plain, request


def test_rows_join_a_running_batch():
    """Continuous batching (`SpinEngine.add` with a `Request.encoder`): a row joining running rows brings
    its encoder output (of another length) and cross K/V (`RectangularCache.append_rows`), the model
    drafter encodes it on joining (`EncoderDecoderDrafter.add_rows`); every row equals its plain output."""
    target, other = _models("t5")
    prompts, plain, request = _t5_requests(target)
    engine = hf_spin.SpinEngine(target, spin_pool([other, "prompt_lookup"], policy="round_robin"))
    rows = [engine.add(request(prompts[0])), engine.add(request(prompts[1]))]
    for _ in range(3):
        engine.step()
    rows.append(engine.add(request(prompts[2])))
    while engine.has_work:
        engine.step()
    engine.close()
    assert [r.generated for r in rows] == plain
    assert all(d.failures == 0 and d.drafted > 0 for d in engine.stats.drafters.values()), str(engine.stats)


def _encoder_batches(model) -> list[int]:
    """A list that records the batch size of every call of `model`'s encoder from now on."""
    calls = []
    model.get_encoder().register_forward_hook(
        lambda module, args, kwargs, out: calls.append(len(out[0])), with_kwargs=True
    )
    return calls


def test_a_drafter_runs_its_encoder_only_when_it_first_drafts():
    """The drafter's encoder runs at its first catch-up or draft, over every row then present (a row that
    joined before it is encoded with them), and never in a call that does not draft with it."""
    target, _ = _models("whisper")
    other = perturb(tiny_encoder_decoder("whisper", **INIT["whisper"]))
    calls = _encoder_batches(other)
    inputs, reference = _case("whisper", 4)
    out = target.generate(
        **inputs, custom_generate=hf_spin.generate, assistant_pool=spin_pool(["prompt_lookup", other])
    )  # "fixed": the first drafter only
    assert torch.equal(out, reference) and calls == []

    t5, t5_other = tiny_encoder_decoder("t5", **INIT["t5"]), perturb(tiny_encoder_decoder("t5", **INIT["t5"]))
    calls = _encoder_batches(t5_other)
    prompts, plain, request = _t5_requests(t5)
    engine = hf_spin.SpinEngine(t5, spin_pool(["prompt_lookup", t5_other], policy="round_robin"))
    rows = [engine.add(request(prompts[0])), engine.add(request(prompts[1]))]
    engine.step()  # prompt lookup's turn: the drafter has not encoded
    rows.append(engine.add(request(prompts[2])))
    while engine.has_work:
        engine.step()
    engine.close()
    assert [r.generated for r in rows] == plain
    assert calls == [3], calls  # once, every row at the drafter's first turn
    assert engine.stats.drafters[engine.names[1]].drafted > 0, str(engine.stats)


@pytest.mark.parametrize("form", ("timestamps", "long_form"))
def test_whisper_timestamps_and_long_form(form):
    """Timestamp tokens (a logits processor over each row's ids) and long-form audio (Whisper's generate
    calls hf_spin once per 30-second window, here per WHISPER_FRAMES frames) stay identical."""
    target, other = _models("whisper")
    target.generation_config.max_initial_timestamp_index = 5
    frames = WHISPER_FRAMES * (3 if form == "long_form" else 1)
    features = torch.randn(2, 8, frames, generator=torch.Generator().manual_seed(0))
    inputs = dict(
        input_features=features,
        attention_mask=torch.ones(2, frames, dtype=torch.long),
        return_timestamps=True,
        max_new_tokens=10,
        **DECODER_PROMPT["whisper"],
    )
    pool = spin_pool([other])
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, target.generate(**inputs))
    assert_speculated(pool.last_stats, rejected=False)


def test_dict_output_is_generates_encoder_decoder_output():
    """`return_dict_in_generate=True`: `generate`'s encoder-decoder output (sequences: the decoder prompt,
    then the generated tokens) with the call's stats."""
    target, other = _models("t5")
    inputs, reference = _case("t5", 4)
    pool = spin_pool(["prompt_lookup"])
    out = target.generate(**inputs, return_dict_in_generate=True, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert isinstance(out, SpinGenerateEncoderDecoderOutput) and out.stats is pool.last_stats
    assert torch.equal(out.sequences, reference)


# -- refused, with what was given and what is supported ------------------------------------------------
def test_refusals():
    target, other = _models("whisper")
    features = encoder_inputs("whisper", 1)
    pool = spin_pool(["prompt_lookup"])
    with pytest.raises(ValueError, match="num_beams=2 is not supported with assistant_pool; use num_beams=1"):
        target.generate(**features, num_beams=2, custom_generate=hf_spin.generate, assistant_pool=pool)
    with pytest.raises(ValueError, match="output_scores=True is not supported with assistant_pool"):
        # Whisper's temperature fallback reads every step's scores
        target.generate(
            **features,
            temperature=(0.0, 0.2),
            logprob_threshold=-1.0,
            custom_generate=hf_spin.generate,
            assistant_pool=pool,
        )
    for cache in ("packed", "static"):
        with pytest.raises(ValueError, match=f"cache='{cache}' is not supported for the encoder-decoder target"):
            hf_spin.SpinEngine(target, spin_pool(["prompt_lookup"], cache=cache))
    with pytest.raises(ValueError, match="StreamingDrafter.*supported: an encoder-decoder model of its family"):
        hf_spin.SpinEngine(target, spin_pool([hf_spin.StreamingDrafter(target)]))
    with pytest.raises(
        ValueError,
        match=r"is an encoder-decoder model \(or reads an encoder's output\) and the target 'llama' a causal LM",
    ):
        hf_spin.SpinEngine(tiny_model("llama"), spin_pool([other]))
    with pytest.raises(ValueError, match="'whisper' is an encoder-decoder model: a Request needs its encoder side"):
        hf_spin.SpinEngine(target, pool).add(hf_spin.Request([3], max_new_tokens=2))
    bart = tiny_encoder_decoder("bart")
    text = encoder_inputs("bart", 2)
    with pytest.raises(ValueError, match="'bart' is an encoder-decoder model whose decoder reads its positions"):
        bart.generate(**text, max_new_tokens=4, custom_generate=hf_spin.generate, assistant_pool=pool)
    t5 = _models("t5")[0]
    padded = torch.tensor([[0, 5], [0, 0]])
    with pytest.raises(ValueError, match="a decoder_attention_mask with padding is not supported"):
        t5.generate(
            **encoder_inputs("t5", 2),
            decoder_input_ids=padded,
            decoder_attention_mask=torch.tensor([[1, 1], [1, 0]]),
            custom_generate=hf_spin.generate,
            assistant_pool=pool,
        )


# -- sampling: the engine keeps a tiny Whisper's distribution exactly ---------------------------------
def _peaky_whisper(seed: int) -> torch.nn.Module:
    """A tiny Whisper over SMALL_V tokens with sharp distributions (test_sampling.peaky's Whisper)."""
    model = tiny_encoder_decoder("whisper", seed=seed, vocab_size=SMALL_V, decoder_start_token_id=3, **INIT["whisper"])
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # rows must not stop: every token is counted
    return model


FEATURES = encoder_inputs("whisper", 1, seed=0)  # one audio, every sampled row transcribes it


@functools.lru_cache(maxsize=None)
def _exact_whisper() -> torch.Tensor:
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    with torch.no_grad():
        return exact_joint(_peaky_whisper(0), PROMPT, processors, MEASURED, encoder=FEATURES)


def test_whisper_sampling_matches_target_distribution():
    target, exact = _peaky_whisper(0), _exact_whisper()
    results = {}
    for n in (SMALL_N, LARGE_N):
        counts, stats = _sampled_counts(target, _peaky_whisper(1), PROMPT, n, seed=n, encoder=FEATURES)
        results[n] = (tv(counts, exact), fits(counts, exact))
        assert_speculated(stats, longest=MEASURED)
    assert results[LARGE_N][1] > ALPHA, results
    assert results[LARGE_N][0] < results[SMALL_N][0], results


def test_whisper_sampling_check_rejects_a_lossy_verifier(monkeypatch):
    monkeypatch.setattr(hf_spin.verify.chains, "verify_sampling", accept_after_first)
    counts, _ = _sampled_counts(_peaky_whisper(0), _peaky_whisper(1), PROMPT, LARGE_N, seed=LARGE_N, encoder=FEATURES)
    assert fits(counts, _exact_whisper()) < 1e-6
