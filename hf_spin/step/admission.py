"""Admission: the target's prefill of rows joining the running batch, and their first token.

A whole `generate` batch is prefilled exactly as `generate` prefills it (its own input tensors and
model kwargs), or, where the cost profile prices it cheaper, in groups of rows of similar prompt lengths
(`planning/prefill.py`), each left-padded into a block of its own and the blocks' caches joined as one
padded block would hold them; rows joining a running batch (the server) likewise. On packed
rows (`cache="packed"`) only the new rows' tokens are fed. An encoder-decoder target's rows feed their
decoder prompts (of one length in a `generate` batch, as `generate` feeds them) beside their encoder
outputs, whose cross-attention K/V that forward computes once. Either way the new rows' KV is appended
to the batch's cache, after the rows already running.
"""

from __future__ import annotations

import inspect
from time import perf_counter
from typing import Callable, Protocol

import torch

from ..cache import CACHE_ARG, CACHE_NAMES, PackedCache, RectangularCache, forward_ragged, needs_contiguous_slots
from ..cache.encoder_rows import EncoderRows
from ..cache.static import StaticRowCache
from ..host_syncs import wait_for
from ..verify.chains import gumbel_noise
from .processors import GenerateBatch
from .rows import Row

# Token id that left-pads the prompts of rows prefilled together; masked, so any valid id works.
JOIN_PAD_TOKEN = 0


class PrefillCosts(Protocol):
    """What learns from the prefill's forwards (the planner): their cost far past the grid prices prefill groups."""

    def learns_prefill(self, positions: int) -> bool: ...

    def observe_prefill(self, rows: int, positions: int, seconds: float) -> None: ...


def prefill_kwargs(model, attention_mask: torch.Tensor) -> dict:
    """The model inputs `generate` prepares for a prefill of left-padded rows (mask, positions, logits_to_keep)."""
    kwargs = {"attention_mask": attention_mask, "use_cache": True}
    if "position_ids" in inspect.signature(model.forward).parameters:
        position_ids = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = position_ids.masked_fill(attention_mask == 0, 0)
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = 1
    return kwargs


def prefill(
    model,
    cache,
    running: int,
    rows: list[Row],
    batch: GenerateBatch | None,
    packed: bool,
    static: Callable[[int], StaticRowCache] | None = None,
    groups: list[list[int]] | None = None,
    costs: PrefillCosts | None = None,
):
    """Target forward over the joining rows' prompts, their KV appended after the `running` rows of
    `cache` (None: a new batch). Returns (the batch's cache, logits [n, V] float32 at each new row's
    last token). static: the batch's cache is a `StaticRowCache`, filled from this eager prefill; called with
    the rows' count for a new batch's (`static.take_cache` where the forwards compile).
    groups: indices into `rows` of the rows to prefill together, one forward a group (`can_group` must
    hold; `planning/prefill.py` picks them); None: all in one. costs: told each block's forward time where it
    learns from it (left-padded blocks only)."""
    if packed:  # a forward over the new rows' tokens only
        if cache is None:
            cache = PackedCache(0, device=model.device)
        cache.add_empty_rows(len(rows))
        try:
            chunks = [[] for _ in range(running)] + [r.sequence for r in rows]
            return cache, forward_ragged(model, cache, chunks, all_logits=False)[running:, -1].to(dtype=torch.float32)
        except BaseException:
            cache.select_rows(torch.arange(running))  # the new rows leave again
            raise
    if rows[0].request.encoder is not None:  # an encoder-decoder target: the decoder prompts, with each row's encoder
        fresh = RectangularCache(
            torch.zeros(len(rows), 0, dtype=torch.bool, device=model.device),
            contiguous=needs_contiguous_slots(model.config),
            encoder=EncoderRows.cat([r.request.encoder for r in rows]),
        )
        lengths = [len(r.sequence) for r in rows]
        logits = forward_ragged(model, fresh, [r.sequence for r in rows], all_logits=False)[:, -1].float()  # [n, V]
        fresh.rollback(lengths)  # every token kept; a contiguous cache closes the holes of shorter prompts
        if running and cache is not None:
            cache.append_rows(fresh)
            return cache, logits
        return fresh, logits
    if groups is not None and len(groups) > 1:
        fresh, logits = _prefill_groups(model, rows, groups, costs)
    else:
        fresh, logits = _prefill_block(model, rows, batch, costs)
    if static is not None:  # copied into free row slots, capacity for the rows' length limit
        cache = cache if running and cache is not None else static(len(rows))
        cache.append_rows(fresh, min_capacity=max(r.request.max_length for r in rows))
        return cache, logits
    if running and cache is not None:
        cache.append_rows(fresh)
        return cache, logits
    return fresh, logits


def can_group(rows: list[Row], batch: GenerateBatch | None, packed: bool) -> bool:
    """Whether `prefill` takes `groups` for these rows and they give what one forward gives: not on packed rows
    (no padding to save) nor for an encoder-decoder target (its own prefill); for a `generate` batch, left
    padding only and positions counted from each row's first token (rows joining a running batch always may)."""
    if packed or rows[0].request.encoder is not None:
        return False
    if batch is None:
        return True
    mask = batch.model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(batch.input_ids)
    ok = (mask[:, 1:] >= mask[:, :-1]).all()  # left padding only
    given = batch.model_kwargs.get("position_ids")
    if given is not None:
        ok = ok & (given == mask.long().cumsum(-1) - 1)[mask.bool()].all()
    return bool(ok)  # one host read


def _prefill_block(
    model, rows: list[Row], batch: GenerateBatch | None, costs: PrefillCosts | None
) -> tuple[RectangularCache, torch.Tensor]:
    """One forward over `rows`' prompts: `batch`'s own tensors and kwargs (exactly `generate`'s prefill), or
    with no batch the prompts left-padded into one block; timed for `costs` where they learn from it. Returns
    (their cache, logits [n, V] float32)."""
    if batch is not None:  # exactly what `generate` prepared
        input_ids, kwargs = batch.input_ids, dict(batch.model_kwargs)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
    else:  # left-pad the prompts into one block
        width = max(len(r.sequence) for r in rows)
        input_ids = torch.full((len(rows), width), JOIN_PAD_TOKEN, dtype=torch.long)  # [n, P]
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [n, P]
        for i, r in enumerate(rows):
            input_ids[i, width - len(r.sequence) :] = torch.tensor(r.sequence)
            attention_mask[i, width - len(r.sequence) :] = 1
        input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
        kwargs = prefill_kwargs(model, attention_mask)
    fresh = RectangularCache(attention_mask.bool(), contiguous=needs_contiguous_slots(model.config))
    for name in CACHE_NAMES:  # generate's empty cache, under either name
        kwargs.pop(name, None)
    kwargs[CACHE_ARG] = fresh
    inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **kwargs)
    timed = costs is not None and costs.learns_prefill(input_ids.numel())
    start = perf_counter()
    logits = model(**inputs, return_dict=True).logits[:, -1].to(dtype=torch.float32)  # [n, V]
    if timed:
        wait_for(logits.device)
        costs.observe_prefill(len(rows), input_ids.numel(), perf_counter() - start)
    return fresh, logits


def _prefill_groups(
    model, rows: list[Row], groups: list[list[int]], costs: PrefillCosts | None
) -> tuple[RectangularCache, torch.Tensor]:
    """`_prefill_block` per group, the groups' caches joined (each left-padded with holes to the longest, as
    one block would be) and put back in row order. Returns (their cache, logits [n, V] float32)."""
    parts = [_prefill_block(model, [rows[i] for i in group], None, costs) for group in groups]
    fresh = parts[0][0]
    for part, _ in parts[1:]:
        fresh.append_rows(part)
    back = torch.tensor([i for group in groups for i in group]).argsort()  # [n] row -> its place in the groups
    fresh.select_rows(back)
    logits = torch.cat([part_logits for _, part_logits in parts])  # [n, V] in the groups' order
    return fresh, logits[back.to(logits.device)]


def first_tokens(rows: list[Row], scores: torch.Tensor, run_isolated) -> list[int]:
    """The joining rows' first tokens from their processed scores [n, V]: greedy rows take the argmax,
    sampled rows draw from softmax(scores), seeded rows by Gumbel-max with their own noise."""
    first = scores.argmax(-1)  # [n]
    shared = [i for i, r in enumerate(rows) if r.request.do_sample and r.request.seed is None and not r.done]
    if shared and len(shared) == len(rows):
        first = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0]
    elif shared:
        idx = torch.tensor(shared, device=scores.device)
        first[idx] = torch.multinomial(torch.softmax(scores[idx], -1), 1)[:, 0]
    for i, row in enumerate(rows):
        if row.request.do_sample and row.request.seed is not None and not row.done:

            def draw(i=i, row=row):
                noise = gumbel_noise(row.request.seed, 0, 1, scores.shape[-1], scores.device)[0]
                first[i] = (torch.log_softmax(scores[i], -1) + noise).argmax()

            run_isolated(row, draw)
    return first.tolist()
