"""Drafters for an encoder-decoder target that cross-attend to an encoder's output of each row.

A smaller encoder-decoder model of the target's family (a tiny Whisper for a larger one) reads what the
target's encoder read (each row's `EncoderRows.inputs`, from the target's cache) and runs its own encoder
on it once per row: for every row at its first catch-up or draft (never, in a call the planner decodes
plainly), then for each row as it joins. A decoder-only assistant that cross-attends to the target's
encoder output (distil-whisper's layout, `WhisperForCausalLM`) reads that output instead and runs no
encoder. Either drafts on its decoder exactly as `ModelDrafter` does, its self-attention cache rolled back
per row and its cross-attention K/V following its rows (cache/encoder_rows.py). docs/design.md,
"Encoder-decoder targets".
"""

from __future__ import annotations

import torch

from ..cache import RectangularCache
from ..cache.encoder_rows import EncoderRows, reads_encoder_output
from .model import ModelDrafter


class EncoderDecoderDrafter(ModelDrafter):
    """A draft encoder-decoder model, or a decoder reading the target's encoder output, sharing the
    target's tokenizer; drafts chains or trees on its decoder."""

    def __init__(self, model, name: str | None = None, tree_width: int = 3, draft_vocabulary=None):
        super().__init__(model, name=name, tree_width=tree_width, draft_vocabulary=draft_vocabulary)
        self.target_cache: RectangularCache | None = None  # the target's, read for joining rows' encoder inputs

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        encoder = getattr(target_cache, "encoder", None)
        if encoder is None or (encoder.inputs is None and self.own_encoder):
            raise ValueError(
                f"drafter {self.name!r} is an encoder-decoder model: it needs the encoder input of an "
                "encoder-decoder target's rows (generate's input_features / input_ids)"
            )
        super().start(target, sequences, target_cache)
        self.target_cache = target_cache  # its `encoder` follows the engine's rows; read when first needed

    def add_rows(self, sequences: list[list[int]]) -> None:
        super().add_rows(sequences)
        if self.cache.encoder is None:  # not encoded yet: the first forward encodes every row
            return
        joined = self.target_cache.encoder  # the target's cache has appended the joining rows already
        rows = torch.arange(len(joined) - len(sequences), len(joined))
        self.cache.encoder = EncoderRows.cat([self.cache.encoder, self._encode(joined.take(rows))])

    def unencoded(self, row: int) -> bool:
        return self.own_encoder and (self.cache is None or self.cache.encoder is None or row >= len(self.cache.encoder))

    def _catch_up(self, rows: list[int], sequences: list[list[int]]):
        """`ModelDrafter._catch_up`, after running this model's encoder over every row if it has not run
        yet: a call the planner never drafts with costs no encoder (its first catch-up pays it)."""
        if self.cache.encoder is None:
            self.cache.encoder = self._encode(self.target_cache.encoder)
        return super()._catch_up(rows, sequences)

    def finish(self) -> None:
        super().finish()
        self.target_cache = None

    @property
    def own_encoder(self) -> bool:
        """False for a decoder that reads the target's encoder output (`reads_encoder_output`)."""
        return not reads_encoder_output(self.model)

    @torch.no_grad()
    def _encode(self, target_rows: EncoderRows) -> EncoderRows:
        """This model's encoder over the rows' encoder inputs: `[B, S, D]` hidden states, computed once;
        the target's own output for a decoder without an encoder."""
        if not self.own_encoder:
            return EncoderRows(target_rows.hidden.to(self.model.device, self.model.dtype), target_rows.mask)
        device = self.model.device
        mask = target_rows.input_mask.to(device) if target_rows.input_mask is not None else None  # [B, S_in]
        read = target_rows.inputs.to(device)  # [B, ...] features (in this model's dtype) or token ids
        read = read.to(self.model.dtype) if read.is_floating_point() else read
        inputs = {self.model.main_input_name: read} | ({"attention_mask": mask} if mask is not None else {})
        hidden = self.model.get_encoder()(**inputs, return_dict=True).last_hidden_state  # [B, S, D]
        return EncoderRows(hidden, mask)
