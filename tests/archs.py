"""Tiny random causal LMs built offline from configs, one entry per architecture.

Every model shares VOCAB so any of them can draft for any other. Dimensions are the smallest the
architecture accepts; weights come from a seeded init, so a test is reproducible.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

VOCAB = 96  # tiny, so random models still repeat themselves and drafts get accepted sometimes
PAD, BOS, EOS = 0, 1, 2

COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)

# Field sets shared by many architectures: 2 layers, width 32, 4 heads of 8, 2 KV heads.
_LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_HEAD8 = dict(_LLAMA_LIKE, head_dim=8)  # configs whose default head_dim (128/256) ignores hidden_size
_GPT2_LIKE = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128)
# Multi-head latent attention (DeepSeek-style): compressed KV, separate rope / no-rope query parts.
_MLA = dict(
    _LLAMA_LIKE,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)

# Sliding-window / chunked-attention architectures keep windows longer than any test sequence here
# (prompt 14 + 24 new tokens); windows shorter than the sequence are covered in tests/test_cache.py,
# where the cache is compacted after every step that leaves a hole inside a row (their windows count
# cache slots, so a hole would push a real token out of the window).
#
# Left out on purpose:
#   mpt          ALiBi bias over cache slot indices: lossless through compaction, covered by its own
#                regression test in test_cache.py rather than this sweep (its config uses other field names).
#   openai-gpt   no KV cache at all (ignores past_key_values): the engine crashes inside attention.
#   lfm2 (with conv layers), mamba, rwkv, recurrent_gemma, jamba, zamba, falcon_h1, bamba, qwen3_next, ...
#                recurrent / convolutional state that cannot be rolled back per row; the engine
#                refuses models marked `_is_stateful` (lfm2 is not marked, and crashes instead).

# model_type -> config fields giving a ~2-layer, 32-64 wide model.
ARCHS: dict[str, dict] = {
    "llama": dict(_LLAMA_LIKE),
    "mistral": dict(_HEAD8),
    "qwen2": dict(_LLAMA_LIKE),
    "qwen3": dict(_HEAD8),
    "gemma": dict(_HEAD8),
    "gemma2": dict(_HEAD8, query_pre_attn_scalar=8),
    "gemma3_text": dict(_HEAD8, query_pre_attn_scalar=8),
    "phi": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "phi3": dict(_LLAMA_LIKE),
    "gpt2": dict(_GPT2_LIKE),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gptj": dict(_GPT2_LIKE, rotary_dim=4),
    "codegen": dict(_GPT2_LIKE, n_ctx=128, rotary_dim=4),
    "opt": dict(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
    ),
    "falcon": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=4,
        new_decoder_architecture=False,
        ffn_hidden_size=64,
    ),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "starcoder2": dict(_LLAMA_LIKE),
    "stablelm": dict(_LLAMA_LIKE),
    "olmo": dict(_LLAMA_LIKE),
    "olmo2": dict(_LLAMA_LIKE),
    "cohere": dict(_LLAMA_LIKE),
    "granite": dict(_LLAMA_LIKE),
    "gpt_bigcode": dict(_GPT2_LIKE),
    "gpt_neo": dict(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=256,
        max_position_embeddings=128,
    ),
    "mixtral": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _LLAMA_LIKE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": dict(_HEAD8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "olmoe": dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2),
    "smollm3": dict(_LLAMA_LIKE),
    "glm": dict(_HEAD8),
    "glm4": dict(_HEAD8),
    "helium": dict(_HEAD8),
    "cohere2": dict(_HEAD8),
    "exaone4": dict(_LLAMA_LIKE),
    "arcee": dict(_HEAD8),
    "ministral": dict(_HEAD8),
    "internlm3": dict(_HEAD8),
    "persimmon": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "nemotron": dict(_HEAD8),
    "xglm": dict(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4, max_position_embeddings=128),
    "biogpt": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128
    ),
    "diffllama": dict(_HEAD8),
    "seed_oss": dict(_HEAD8),
    "ernie4_5": dict(_HEAD8),
    "granitemoe": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "olmo3": dict(_LLAMA_LIKE),
    "vaultgemma": dict(_HEAD8, query_pre_attn_scalar=8),
    "deepseek_v3": dict(
        _MLA,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "minicpm3": dict(_MLA, dim_model_base=32),
    "gpt_oss": dict(_HEAD8, num_local_experts=4, num_experts_per_tok=2, sliding_window=128),  # attention sinks
    "llama4_text": dict(
        _HEAD8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1
    ),  # chunked attention, no-rope layers
    "gemma3n_text": dict(  # AltUp, LAuReL, per-layer inputs; layer 2 reuses layer 0's KV (KV sharing)
        _HEAD8,
        num_hidden_layers=3,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        laurel_rank=4,
        altup_num_inputs=2,
        num_kv_shared_layers=1,
        intermediate_size=[64, 64, 64],
        activation_sparsity_pattern=[0.0, 0.0, 0.0],
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=512,
    ),
    "ctrl": dict(n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=128),  # sinusoidal absolute positions
    "nanochat": dict(_LLAMA_LIKE),
    "jetmoe": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "doge": dict(_LLAMA_LIKE),  # dynamic mask attention
    "gpt_neox_japanese": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_multiple_size=2),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded tiny random model of `arch` in float32, eval mode."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **{**COMMON, **ARCHS[arch], **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager" if arch in EAGER_ONLY else None).eval()


EAGER_ONLY: set[str] = set()  # architectures whose sdpa path rejects the masks used here


def ragged_batch(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: row b has `length - 2*b` real tokens (at least 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : min(2 * b, length - 2)] = 0
    return ids.masked_fill(mask == 0, PAD), mask


# Encoder-decoder targets (docs/design.md, "Encoder-decoder targets"), ~2 layers of width 32 on VOCAB. Whisper's
# encoder reads 8 mel bins over WHISPER_FRAMES frames (short-form: at most 2 x max_source_positions); its
# generation config knows two languages and the transcribe task, so `language=` / `task=` put forced tokens
# in the decoder prompt. BART (positions from the cache length) is refused: tests/test_encoder_decoder.py.
WHISPER_FRAMES = 32
_SEQ2SEQ = dict(
    d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4
)
ENCODER_DECODER_ARCHS: dict[str, dict] = {
    "whisper": dict(
        _SEQ2SEQ,
        encoder_layers=2,
        decoder_layers=2,
        num_mel_bins=8,
        max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=64,
        decoder_start_token_id=3,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    ),
    "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=PAD),
    "bart": dict(_SEQ2SEQ, encoder_layers=2, decoder_layers=2, max_position_embeddings=64, decoder_start_token_id=EOS),
}
WHISPER_LANGUAGES = {"<|en|>": 90, "<|de|>": 91}  # generation_config.lang_to_id
WHISPER_TASKS = {"transcribe": 92, "translate": 93}
WHISPER_NO_TIMESTAMPS = 94


def tiny_encoder_decoder(arch: str = "whisper", seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded tiny random encoder-decoder model of `arch` in float32, eval mode."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **{**COMMON, **ENCODER_DECODER_ARCHS[arch], **overrides})
    model = (AutoModelForSpeechSeq2Seq if arch == "whisper" else AutoModelForSeq2SeqLM).from_config(config).eval()
    if arch == "whisper":
        gen = model.generation_config
        gen.lang_to_id, gen.task_to_id = dict(WHISPER_LANGUAGES), dict(WHISPER_TASKS)
        gen.is_multilingual, gen.no_timestamps_token_id = True, WHISPER_NO_TIMESTAMPS
    return model


def encoder_inputs(arch: str, batch: int, seed: int = 0, length: int = 12) -> dict:
    """Encoder inputs for `generate`: Whisper's random features `[B, 8, WHISPER_FRAMES]` (one length, as
    Whisper requires), or right-padded random token ids with row b holding `length - 2*b` (at least 2)."""
    g = torch.Generator().manual_seed(seed)
    if arch == "whisper":
        return {"input_features": torch.randn(batch, 8, WHISPER_FRAMES, generator=g)}
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, max(length - 2 * b, 2) :] = 0
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}
