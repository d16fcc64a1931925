"""`generate`: batched, lossless speculative decoding behind `model.generate`.

`generate` is a `custom_generate` callable: `transformers` runs all of its own preparation (logits
processors, stopping criteria, special tokens, masks, `max_length`) and then calls it. It adds the
whole batch to a `SpinEngine` (engine.py, where the steps are) and steps it until every row stops:

    policy --plan--> drafters --drafts (+ q)--> target forward on ragged rows --> verify
       ^                                                                          |
       +------ stats <-- commit tokens, stop rows, roll back the target cache ----+

Rows are independent: each accepts its own number of tokens; a row that stops leaves the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from time import perf_counter

import torch
from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .cache import CACHE_NAMES
from .cache.encoder_rows import EncoderRows
from .cache.static_forward import StaticOptions
from .pool import AssistantPool
from .stats import GenerationStats
from .step.engine import SpinEngine

# model_kwargs that `generate`'s preparation hands over and this loop understands (the KV cache comes
# as `cache` from transformers 5.24, as `past_key_values` before).
KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position", *CACHE_NAMES}
# what an encoder-decoder target's preparation adds: the encoder's output (`attention_mask` is then the
# encoder's mask) and a decoder mask, which must be all ones (decoder prompts of one length)
ENCODER_DECODER_KWARGS = {"encoder_outputs", "decoder_attention_mask"}
# generation_config outputs this loop does not produce, with what a user gets instead.
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class SpinGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus what the call did (`stats`). `past_key_values` is None: the
    pool's cache has holes or packed rows a caller could not use."""

    stats: GenerationStats | None = None


class SpinGenerateEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """What plain `generate` returns for an encoder-decoder model (`sequences`: the decoder prompt, then
    the generated tokens), scores, attentions and caches None as in `SpinGenerateOutput`. `stats` is an
    attribute, not a field: Whisper's `generate` splits every field of the output by row."""

    stats: GenerationStats | None = None


def _validate(model, input_ids, config, pool, model_kwargs, processors) -> None:
    for proc in processors:
        if isinstance(proc, (lp.PrefixConstrainedLogitsProcessor, lp.ClassifierFreeGuidanceLogitsProcessor)):
            raise ValueError(
                f"{type(proc).__name__} is not supported with assistant_pool (it indexes rows of the whole batch); "
                "drop prefix_allowed_tokens_fn / guidance_scale or generate without a pool"
            )
    if not isinstance(pool, AssistantPool):
        raise TypeError(f"assistant_pool must be an hf_spin.AssistantPool, got {type(pool).__name__}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if (config.num_beams or 1) != 1:
        raise ValueError(f"num_beams={config.num_beams} is not supported with assistant_pool; use num_beams=1")
    for name in UNSUPPORTED_OUTPUTS:
        if getattr(config, name, False) and config.return_dict_in_generate:
            raise ValueError(f"{name}=True is not supported with assistant_pool; sequences and stats are returned")
    if config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"cache_implementation={config.cache_implementation!r} is not supported with assistant_pool; "
            "supported: 'dynamic' (the pool's layout) and 'static' (the target on hf_spin's static layout); "
            "AssistantPool(cache=...) picks the layout for every call"
        )
    if config.cache_implementation == "static" and pool.cache_layout == "packed":
        raise ValueError(
            "cache_implementation='static' with a pool on cache='packed': two layouts for the target; "
            "use AssistantPool(cache='static') or leave cache_implementation unset"
        )
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    known = KNOWN_MODEL_KWARGS | (ENCODER_DECODER_KWARGS if encoder_decoder else set())
    unknown = set(model_kwargs) - known
    if unknown:
        raise ValueError(
            f"model inputs {sorted(unknown)} are not supported with assistant_pool; supported: {sorted(known)}"
        )
    decoder_mask = model_kwargs.get("decoder_attention_mask")
    if decoder_mask is not None and not bool(decoder_mask.all()):
        raise ValueError(
            "a decoder_attention_mask with padding is not supported with assistant_pool; "
            "give every row the same decoder prompt length (the decoder_input_ids of a batch, unpadded)"
        )
    if encoder_decoder and model_kwargs.get("encoder_outputs") is None:
        raise ValueError(
            f"{model.config.model_type!r} is an encoder-decoder model but generate prepared no encoder_outputs"
        )
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"a pre-filled {name} is not supported with assistant_pool; pass the full prompt instead")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    assistant_pool: AssistantPool | None = None,
    spin_streamer=None,
    spin_tokenizer=None,
    inputs_tensor: torch.Tensor | None = None,
    **model_kwargs,
):
    """Speculative decoding with an `AssistantPool`; use as `model.generate(..., custom_generate=hf_spin.generate,
    assistant_pool=pool)` or after `hf_spin.enable()` as `model.generate(..., assistant_pool=pool)`.

    `transformers` drops `streamer` and `tokenizer` on the custom_generate path: pass them as
    `spin_streamer=` and `spin_tokenizer=` there (`hf_spin.enable()` does it for you).
    An encoder-decoder target (Whisper, T5): `input_ids` are the decoder prompts, `model_kwargs` hold the
    encoder output `generate` computed once, `inputs_tensor` what the encoder read (for drafters with
    their own encoder); docs/design.md, "Encoder-decoder targets".
    """
    if assistant_pool is None:
        raise ValueError("hf_spin.generate needs assistant_pool=hf_spin.AssistantPool([...])")
    config = generation_config or model.generation_config
    model_kwargs.pop("synced_gpus", None)
    logits_processor = logits_processor or lp.LogitsProcessorList()
    _validate(model, input_ids, config, assistant_pool, model_kwargs, logits_processor)
    streamer = spin_streamer
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer supports batch size 1 only, got batch size {input_ids.shape[0]}")
    pad_id = int(config._pad_token_tensor) if getattr(config, "_pad_token_tensor", None) is not None else 0

    # 1. Every row joins at once, prefilled exactly as `generate` prefills them.
    # `cache_implementation="static"`: the target verifies on hf_spin's static layout (compiled on CUDA)
    static = (
        StaticOptions("auto") if config.cache_implementation == "static" and assistant_pool.static is None else None
    )
    engine = SpinEngine(model, assistant_pool, spin_tokenizer, static=static)
    start = perf_counter()
    encoder = _encoder_rows(model_kwargs, inputs_tensor)
    attention_mask = model_kwargs.get("attention_mask") if encoder is None else None  # else the encoder's
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    rows = engine.add_batch(
        input_ids,
        attention_mask,
        logits_processor,
        stopping_criteria or StoppingCriteriaList(),
        config.max_length,
        bool(config.do_sample),
        model_kwargs,
        encoder,
    )
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # 2-7. Step until every row stopped (engine.py numbers the steps).
    streamed = 0
    while engine.has_work:
        engine.step()
        if streamer is not None and len(rows[0].generated) > streamed:
            streamer.put(torch.tensor(rows[0].generated[streamed:]))
            streamed = len(rows[0].generated)
    engine.close()

    # 8. Assemble the output like plain `generate`: prompt as given, then tokens, padded on the right.
    stats = engine.stats
    stats.rows = [r.stats for r in rows]
    stats.wall_seconds = perf_counter() - start
    assistant_pool.record(stats)
    if streamer is not None:
        streamer.end()
    generated = [r.generated for r in rows]
    width = max(len(g) for g in generated)
    tail = torch.full((len(generated), width), pad_id, dtype=input_ids.dtype)
    for i, g in enumerate(generated):
        tail[i, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        if encoder is None:
            return SpinGenerateOutput(sequences=sequences, stats=stats)
        output = SpinGenerateEncoderDecoderOutput(sequences=sequences)
        output.stats = stats
        return output
    return sequences


def _encoder_rows(model_kwargs: dict, inputs_tensor: torch.Tensor | None) -> EncoderRows | None:
    """An encoder-decoder batch's encoder side from what `generate` prepared; None for a causal LM."""
    outputs = model_kwargs.get("encoder_outputs")
    if outputs is None:
        return None
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]  # [B, S, D]
    mask = model_kwargs.get("attention_mask")  # [B, S_in] the encoder's mask, or None
    return EncoderRows(hidden, mask, inputs_tensor, mask)


# --- hf_spin.enable(): `model.generate(..., assistant_pool=pool)` on any model (Whisper's own generate too) ---

_original_generate = None


def _generate_with_pool(
    model, *args, assistant_pool, streamer=None, tokenizer=None, stop_strings=None, stopping_criteria=None, **kwargs
):
    for name in ("custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}= cannot be combined with assistant_pool=; put every drafter in the pool")
    if stop_strings is not None:  # transformers cannot build this criterion on the custom_generate path
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= as well (to match strings against tokens)")
        stopping_criteria = StoppingCriteriaList(
            [*(stopping_criteria or []), StopStringCriteria(tokenizer, stop_strings)]
        )
    return _original_generate(
        model,
        *args,
        custom_generate=generate,
        assistant_pool=assistant_pool,
        spin_streamer=streamer,
        spin_tokenizer=tokenizer,
        stopping_criteria=stopping_criteria,
        **kwargs,
    )


def enable() -> None:
    """Teach every `transformers` model's `generate` the `assistant_pool=` argument (idempotent). A model
    whose own `generate` ends in `GenerationMixin.generate` (Whisper's) passes it on to this one."""
    global _original_generate
    if _original_generate is not None:
        return
    _original_generate = GenerationMixin.generate

    @functools.wraps(_original_generate)
    def patched(self, *args, assistant_pool=None, **kwargs):
        if assistant_pool is None:
            return _original_generate(self, *args, **kwargs)
        return _generate_with_pool(self, *args, assistant_pool=assistant_pool, **kwargs)

    GenerationMixin.generate = patched


def disable() -> None:
    """Undo `enable()`."""
    global _original_generate
    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
        _original_generate = None
