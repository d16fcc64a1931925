"""A draft model with another tokenizer, through token translation (universal assisted generation).

The row's committed target ids are decoded to text and re-encoded with the drafter's tokenizer;
the drafter's new ids are decoded (with a little context, so leading spaces survive) and encoded
with the target's tokenizer. The drafter's cache keeps whatever prefix of its ids is unchanged.
Drafts are greedy in the drafter's vocabulary: the proposal is deterministic given the prefix, so
verification treats q as one-hot and stays lossless at any temperature (see verification.py).
Unlike `transformers`' universal assisted generation, nothing of the drafter model is changed.
"""

from __future__ import annotations

from .model import ModelDrafter

# Drafter ids decoded before the new ones, so the new text keeps its leading space or merge.
DECODE_CONTEXT = 4


class TranslatingDrafter(ModelDrafter):
    shares_vocab = False
    kind = "translation"
    gives_q = False

    def __init__(self, model, tokenizer, target_tokenizer=None, name: str | None = None):
        super().__init__(model, name=name)
        self.tokenizer = tokenizer
        self.target_tokenizer = target_tokenizer  # may be set later by the pool from generate(tokenizer=...)

    def to_draft_space(self, sequence: list[int]) -> list[int]:
        text = self.target_tokenizer.decode(sequence)
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def to_target_space(self, prefix: list[int], new_ids: list[int], k: int) -> list[int]:
        context = prefix[-DECODE_CONTEXT:]
        text = self.tokenizer.decode(context + new_ids)[len(self.tokenizer.decode(context)) :]
        return self.target_tokenizer(text, add_special_tokens=False)["input_ids"][:k]
