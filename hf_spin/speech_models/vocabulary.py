"""A same-vocabulary drafter made from a checkpoint with another vocabulary (tiny.en for base): the drafter's
token rows looked up by string in the target's vocabulary."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from .packaged import cached_path, load

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration


def vocabulary_map(target_tokenizer: dict, drafter_tokenizer: dict, target_vocab: int) -> torch.Tensor:
    """For each target token id, the drafter's id of the same token string, or -1 where it has none.

    Both arguments are tokenizer.json contents. Text tokens and special tokens match by string; the
    timestamp tokens, which an English-only tokenizer.json does not list, match by their offset after
    ``<|notimestamps|>``. Whisper base's 50257 text tokens: 29380 have a twin in tiny.en's GPT-2 BPE.
    """

    def ids(tokenizer: dict) -> dict[str, int]:
        out = dict(tokenizer["model"]["vocab"])
        out.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
        return out

    target, drafter = ids(target_tokenizer), ids(drafter_tokenizer)
    source = torch.full((target_vocab,), -1, dtype=torch.long)
    for token, i in target.items():
        if token in drafter and i < target_vocab:
            source[i] = drafter[token]
    t0, d0 = target["<|notimestamps|>"] + 1, drafter["<|notimestamps|>"] + 1
    timestamps = max(0, target_vocab - t0)
    source[t0 : t0 + timestamps] = torch.arange(d0, d0 + timestamps)
    return source


def remap_vocabulary(drafter, source: torch.Tensor, target_config, target_generation):
    """A copy of Whisper `drafter` whose token embedding (tied to its output layer) is indexed by the
    target's vocabulary: row i is the drafter's row ``source[i]``, zero where ``source[i] == -1`` (a zero
    row scores a logit of 0, below the tokens a model picks). Everything else is the drafter's own weights.
    The result drafts in the target's token ids, so `transformers`' plain assisted generation takes it."""
    from transformers import WhisperForConditionalGeneration

    config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    config.vocab_size = target_config.vocab_size
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        setattr(config, key, getattr(target_config, key))
    remapped = WhisperForConditionalGeneration(config).eval().to(drafter.dtype)
    state = drafter.state_dict()
    embed = state.pop("model.decoder.embed_tokens.weight")
    state.pop("proj_out.weight", None)
    rows = torch.zeros(config.vocab_size, embed.shape[1], dtype=embed.dtype)
    mapped = source >= 0
    if mapped.any() and int(source.max()) >= embed.shape[0]:
        raise ValueError(f"vocabulary map points past the drafter's {embed.shape[0]} rows")
    rows[mapped] = embed[source[mapped]]
    state["model.decoder.embed_tokens.weight"] = rows
    missing, unexpected = remapped.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"proj_out.weight"}:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    remapped.tie_weights()
    remapped.generation_config = target_generation.__class__.from_dict(target_generation.to_dict())
    return remapped


def load_remapped_drafter(
    drafter: str = "whisper-tiny.en",
    target: str = "whisper-base",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
) -> WhisperForConditionalGeneration:
    """`drafter` re-indexed into `target`'s vocabulary (`remap_vocabulary`): a same-tokenizer assistant.

    Not a checkpoint of its own: tiny.en's weights, its rows looked up by token string. Alone it
    transcribes worse than tiny.en (a word the multilingual BPE splits differently from GPT-2's is
    spelled with pieces tiny.en never produced), but as a drafter its tokens are verified by the target,
    so the output is the target's greedy output whatever it proposes.
    """
    from transformers import GenerationConfig, WhisperConfig

    model, _ = load(drafter, dtype, cache_dir, device)
    folder = cached_path(target, dtype, cache_dir)
    if not folder.is_dir():
        load(target, dtype, cache_dir, "cpu")  # converts it once
    target_config = WhisperConfig.from_pretrained(folder)
    source = vocabulary_map(
        json.loads((folder / "tokenizer.json").read_text()),
        json.loads((cached_path(drafter, dtype, cache_dir) / "tokenizer.json").read_text()),
        target_config.vocab_size,
    )
    remapped = remap_vocabulary(model, source, target_config, GenerationConfig.from_pretrained(folder))
    remapped.to(model.device)
    remapped.config._name_or_path = f"{drafter}-as-{target}-vocab"
    return remapped
