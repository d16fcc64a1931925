"""Tiny random causal LMs built offline from configs, one entry per architecture.

Every model shares VOCAB so any of them can draft for any other. Dimensions are the smallest the
architecture accepts; weights come from a seeded init, so a test is reproducible.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96  # tiny, so random models still repeat themselves and drafts get accepted sometimes
PAD, BOS, EOS = 0, 1, 2

COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)

# model_type -> config fields giving a ~2-layer, 32-64 wide model.
ARCHS: dict[str, dict] = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
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
