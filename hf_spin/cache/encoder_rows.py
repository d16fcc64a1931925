"""Encoder-decoder models on ragged rows: each row's encoder output and cross-attention K/V.

An encoder-decoder model's decoder attends to its own tokens (self-attention, a `RectangularCache` like any
causal LM's) and to the encoder's output (cross-attention). The encoder runs once per request; its
cross-attention K/V are projected by the first decoder forward that sees them and kept
(`transformers`' `EncoderDecoderCache.is_updated`), so a step's forward projects none. `EncoderRows` holds
them beside the self-attention cache (`RectangularCache.encoder`) and follows its rows: a retired row's
K/V leave with it (`select_rows`), rows joining bring theirs (`cat`). docs/design.md, "Encoder-decoder
targets".
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput


@dataclass
class EncoderRows:
    """The encoder side of B rows, in the rows' batch order.

    hidden: `[B, S, D]` the encoder's last hidden state per row (rows joined with shorter encoder
        outputs are padded on the right, `mask` 0 there).
    mask: `[B, S]` the encoder attention mask the decoder's cross-attention reads (1: a real position),
        or whatever `generate` handed the model as `attention_mask`; None: every position is real.
    inputs: `[B, ...]` what the encoder read (`input_features`, `input_ids`), for a drafter that runs
        its own encoder on it; None where no drafter needs it.
    input_mask: `[B, S_in]` the inputs' attention mask; None: every position is real.
    cross: per decoder layer `[B, H, S, D]` cross-attention keys and values; empty until the next
        decoder forward computes them from `hidden` (for every row at once).
    """

    hidden: torch.Tensor
    mask: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    input_mask: torch.Tensor | None = None
    cross: DynamicCache = field(default_factory=DynamicCache)

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def take(self, rows: torch.Tensor) -> EncoderRows:
        """These rows (a host tensor of batch indices) as a new `EncoderRows`, without cross K/V (the forward
        that next needs them computes them)."""

        def pick(t):
            return None if t is None else t[rows.to(t.device)]

        return EncoderRows(pick(self.hidden), pick(self.mask), pick(self.inputs), pick(self.input_mask))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (a host tensor of batch indices, in their new order), cross K/V included."""
        kept = self.take(rows)
        self.hidden, self.mask, self.inputs, self.input_mask = kept.hidden, kept.mask, kept.inputs, kept.input_mask
        for layer in self.cross.layers:
            if layer.is_initialized and layer.keys.numel():
                index = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys[index], layer.values[index]

    @staticmethod
    def cat(parts: list[EncoderRows]) -> EncoderRows:
        """The parts' rows one after the other. Encoder outputs (and 2D inputs) of different lengths are
        padded on the right and masked there; cross K/V are joined where every part has them, else left
        for the next forward to compute for every row."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.hidden.shape[1] for p in parts)
        ragged = any(p.hidden.shape[1] != width for p in parts)
        hidden = torch.cat([_pad(p.hidden, width, 0.0) for p in parts])
        mask = _cat_masks([p.mask for p in parts], [p.hidden for p in parts], ragged)
        inputs = input_mask = None
        if all(p.inputs is not None for p in parts):
            in_width = max(p.inputs.shape[1] for p in parts)
            in_ragged = any(p.inputs.shape[1] != in_width for p in parts)
            if in_ragged and any(p.inputs.dim() != 2 for p in parts):
                raise ValueError("encoder inputs of different lengths can be joined only as [B, S] token ids")
            inputs = torch.cat([_pad(p.inputs, in_width, 0) for p in parts])
            input_mask = _cat_masks([p.input_mask for p in parts], [p.inputs for p in parts], in_ragged)
        joined = EncoderRows(hidden, mask, inputs, input_mask)
        layers = [p.cross.layers for p in parts]
        if all(ls and all(layer.is_initialized for layer in ls) for ls in layers):
            for i in range(len(layers[0])):
                keys = torch.cat([_pad(ls[i].keys, width, 0.0, dim=2) for ls in layers])
                values = torch.cat([_pad(ls[i].values, width, 0.0, dim=2) for ls in layers])
                joined.cross.update(keys, values, i)
        return joined

    def decoder_kwargs(self, model, inputs: dict) -> dict:
        """An encoder-decoder model's forward arguments from a decoder-only forward's `inputs` (input_ids,
        attention_mask, position_ids over the decoder's slots, ...): those under their decoder names
        (positions only where the model takes them; elsewhere its decoder counts slots and the cache is
        kept contiguous, `needs_contiguous_slots`), and these rows' encoder output and mask. A decoder
        that `reads_encoder_output` (`WhisperForCausalLM`) keeps its names and gets the output alone."""
        if not getattr(model.config, "is_encoder_decoder", False):  # a decoder reading an encoder's output
            return {**inputs, "encoder_outputs": BaseModelOutput(last_hidden_state=self.hidden)}
        out = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
        out["decoder_input_ids"] = inputs["input_ids"]
        out["decoder_attention_mask"] = inputs.get("attention_mask")
        if takes_decoder_positions(model) and inputs.get("position_ids") is not None:
            out["decoder_position_ids"] = inputs["position_ids"]
        out["encoder_outputs"] = BaseModelOutput(last_hidden_state=self.hidden)
        out["attention_mask"] = self.mask
        return out

    def with_cross(self, cache) -> EncoderDecoderCache:
        """The cache a decoder forward takes: `cache` (self-attention, B rows) and these rows' cross K/V
        (marked computed per layer where they are)."""
        return EncoderDecoderCache(cache, self.cross)


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    """The keyword names a model class's forward takes (read once per class: every forward asks)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def takes_decoder_positions(model) -> bool:
    """Whether the model's forward takes per-row decoder positions (`decoder_position_ids`: Whisper)."""
    return "decoder_position_ids" in _forward_parameters(type(model))


def reads_encoder_output(model) -> bool:
    """Whether a model that is not an encoder-decoder one still cross-attends to an encoder's output it is
    given (`encoder_outputs`): distil-whisper's decoder-only assistant, `WhisperForCausalLM`."""
    return not getattr(model.config, "is_encoder_decoder", False) and "encoder_outputs" in _forward_parameters(
        type(model)
    )


def _pad(t: torch.Tensor, width: int, value, dim: int = 1) -> torch.Tensor:
    """`t` padded with `value` on the right of dimension `dim` to `width`."""
    if t.shape[dim] == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _cat_masks(masks, tensors, ragged: bool) -> torch.Tensor | None:
    """Masks of parts joined, each padded with 0 to the longest (a part without one: all real over its
    tensor's length); None when no part has one and the parts are of one length. A mask need not be as
    long as its tensor (Whisper's covers the input frames, twice its encoder output)."""
    if all(m is None for m in masks) and not ragged:
        return None
    full = [
        m if m is not None else torch.ones(t.shape[:2], dtype=torch.long, device=t.device)
        for m, t in zip(masks, tensors)
    ]
    width = max(m.shape[1] for m in full)
    return torch.cat([_pad(m, width, 0) for m in full])
