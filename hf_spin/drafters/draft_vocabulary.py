"""A draft model whose output layer scores a subset of the vocabulary (a draft vocabulary).

A small drafter over a large vocabulary spends much of each draft token in its output layer: Whisper
tiny.en 11.4 of 20 ms a token on a CPU (51,865 rows of 384), Qwen2.5-0.5B 136M of its 494M parameters.
Scoring only N ids cuts that layer by V / N. Ids outside the subset are never proposed (their draft
probability q is 0), so the target's verification stays exact: only acceptance can fall, where the target's
next token lies outside. Byte-level BPE vocabularies number their tokens in merge order, which roughly
follows frequency, so the N lowest ids are a choice that needs no data (FR-Spec ranks by counted frequency
instead); any list of ids can be given. docs/design.md, "Draft vocabulary".
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


def draft_ids(model, vocabulary: int | Sequence[int]) -> torch.Tensor:
    """The sorted ids `[N]` a draft vocabulary keeps: the `vocabulary` lowest ids (an int) or the given ids,
    with the model's end-of-sequence ids always in (a draft must be able to end)."""
    rows = model.get_output_embeddings().weight.shape[0]
    if isinstance(vocabulary, int):
        if not 0 < vocabulary <= rows:
            raise ValueError(f"draft_vocabulary={vocabulary} is not supported; give 1 .. {rows} (the output rows)")
        ids = set(range(vocabulary))
    else:
        ids = {int(i) for i in vocabulary}
        if not ids or min(ids) < 0 or max(ids) >= rows:
            raise ValueError(f"draft_vocabulary ids must lie in 0 .. {rows - 1} (the output rows), got {len(ids)} ids")
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= {e for e in ([eos] if isinstance(eos, int) else eos or []) if e < rows}
    return torch.tensor(sorted(ids), dtype=torch.long)


def with_draft_vocabulary(model, ids: torch.Tensor):
    """A view of `model` that shares every module but its output layer, which scores `ids` only: its logits
    are `[..., N]`, column i for id `ids[i]`. The given model is unchanged."""
    head = model.get_output_embeddings()
    cut = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None)
    with torch.no_grad():  # [N, D] rows of the (possibly tied) output weight, copied
        index = ids.to(head.weight.device)
        cut.weight = torch.nn.Parameter(head.weight[index].clone(), requires_grad=False)
        if head.bias is not None:
            cut.bias = torch.nn.Parameter(head.bias[index].clone(), requires_grad=False)
    view = copy.copy(model)
    view._modules = dict(model._modules)  # its own module table: replacing the head leaves the model's
    view.set_output_embeddings(cut)
    return view


def widen(logits: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """Logits `[n, N]` over a draft vocabulary -> `[n, width]` over the full one, -inf outside it."""
    full = logits.new_full((logits.shape[0], width), float("-inf"))
    full[:, ids.to(logits.device)] = logits
    return full
