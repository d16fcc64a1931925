"""Logits processors over a ragged batch: the target's processors applied to every verified position.

A `generate` batch shares one `LogitsProcessorList`; rows that joined later (the server) bring their
own. Processors that read only the scores (temperature, top-k, top-p, ...) run once over a whole
[B, K + 1, V] block; any other processor (repetition penalty, min_new_tokens, ...) runs per row and
position on the row's own token ids, padding included, as plain `generate` would call it.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation import logits_process as lp

from ..host_syncs import to_device
from .rows import Row

# Processors that read only the scores, never the token ids: a whole [B, K + 1, V] block goes through
# them at once instead of one call per row and position.
IDS_FREE_PROCESSORS = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
)


def row_processors(processors, request: int):
    """The processors as they apply to one original row of a batch, called on a [1, L] view of it.

    `RepetitionPenaltyLogitsProcessor` holds one padding length per row of the batch (`transformers`
    >= 5 ignores left padding that way); the row's own copy holds that row's length as an int.
    """
    out = []
    for proc in processors:
        ignore = getattr(proc, "prompt_ignore_length", None)
        if isinstance(proc, lp.RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
            proc = copy.copy(proc)
            proc.prompt_ignore_length = int(ignore[request])
        out.append(proc)
    return lp.LogitsProcessorList(out)


def ids_free(processors) -> bool:
    return len(processors) > 0 and all(isinstance(p, IDS_FREE_PROCESSORS) for p in processors)


class GenerateBatch:
    """Rows given together as one `generate` batch: one processor list, one padded prompt tensor."""

    def __init__(self, processors, input_ids: torch.Tensor, model_kwargs: dict, rows: list[Row]):
        self.processors = processors
        self.ids_free = ids_free(processors)
        self.input_ids = input_ids  # [B, P] as given, left padding included
        self.model_kwargs = model_kwargs  # what `generate` prepared (attention_mask, position_ids, ...)
        self.order = [r.id for r in rows]
        self.members = set(self.order)


def score_position(row: Row, prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The row's processors on one position: prefix = committed + candidate ids, logits [V] -> [V]."""
    if not len(row.request.processors):
        return logits
    ids = to_device([row.request.padding + prefix], logits.device, torch.long)  # [1, L]
    return row.request.processors(ids, logits[None])[0]


def score_rows(rows: list[Row], prefixes: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """Each row's processors on one position of its own: logits [n, V] -> [n, V] (prefixes: [n] committed +
    candidate ids). Rows sharing one list of processors that read only the scores go through it in one call."""
    first = rows[0].request.processors
    shared = all(
        len(r.request.processors) == len(first) and all(a is b for a, b in zip(r.request.processors, first))
        for r in rows
    )
    if shared and not len(first):
        return logits
    if shared and ids_free(first):
        return first(None, logits)
    return torch.stack([score_position(row, prefix, logits[i]) for i, (row, prefix) in enumerate(zip(rows, prefixes))])


def target_scores(
    rows: list[Row],
    batch: GenerateBatch | None,
    logits: torch.Tensor,
    drafts: list[list[int]],
    run_isolated,
    paths: list[list[list[int]]] | None = None,
) -> torch.Tensor:
    """Each row's processors at each of its verified positions: logits [B, K + 1, V] -> scores [B, K + 1, V].

    batch: the `generate` batch when every row belongs to it (one call over the whole block);
    run_isolated(row, fn): runs a per-row computation so that a fault fails that row only;
    paths: per row, the draft tokens before each slot, for processors that read them (a token tree's
    paths: slot 0 the root, slot i + 1 node i); default the chain's prefixes drafts[b][:j].
    """
    if not any(len(r.request.processors) for r in rows):
        return logits
    if batch is not None and batch.ids_free:  # one call over the whole batch
        B, T, V = logits.shape
        return batch.processors(None, logits.reshape(-1, V)).view(B, T, V)
    scores = logits.clone()
    for b, row in enumerate(rows):
        procs = row.request.processors
        if not len(procs) or row.done:
            continue
        n = len(drafts[b]) + 1
        if ids_free(procs):
            run_isolated(row, lambda: scores.__setitem__((b, slice(0, n)), procs(None, logits[b, :n])))
        else:

            def per_position(b=b, row=row, n=n):
                for j in range(n):
                    before = paths[b][j] if paths is not None else drafts[b][:j]
                    scores[b, j] = score_position(row, row.sequence + before, logits[b, j])

            run_isolated(row, per_position)
    return scores


def first_scores(rows: list[Row], logits: torch.Tensor, batch: GenerateBatch | None, run_isolated) -> torch.Tensor:
    """Processed scores [n, V] of the first token of each joining row, from the prefill's logits [n, V]."""
    if batch is not None:
        return batch.processors(batch.input_ids, logits) if len(batch.processors) else logits
    if not any(len(r.request.processors) for r in rows):
        return logits
    scores = logits.clone()
    for i, row in enumerate(rows):
        if len(row.request.processors):
            run_isolated(
                row,
                lambda: scores.__setitem__(
                    i, row.request.processors(row.as_tensor().to(logits.device), logits[i : i + 1])[0]
                ),
            )
    return scores
