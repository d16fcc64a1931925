"""The decoding loop: batched, lossless speculative decoding behind `model.generate`.

`generate` is a `custom_generate` callable: `transformers` runs all of its own preparation (logits
processors, stopping criteria, special tokens, masks, `max_length`) and then calls it. Each step:

    policy --plan--> drafters --drafts (+ q)--> target forward on ragged rows --> verify
       ^                                                                          |
       +------ stats <-- commit tokens, stop rows, roll back the target cache ----+

Rows are independent: each accepts its own number of tokens; a row that stops leaves the batch.
State per active row: `sequences[b]`, the committed tokens (prompt without padding + generated);
the target cache holds every committed token but the last, which is fed with the next drafts.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass
from time import perf_counter

import torch
from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import RaggedCache, forward_ragged, needs_contiguous_slots
from .drafters import Draft, DraftRequest
from .policies import BatchView, Plan, StepFeedback
from .pool import AssistantPool
from .stats import DrafterStats, GenerationStats, RowStats
from .verification import verify_greedy, verify_sampling

# model_kwargs that `generate`'s preparation hands over and this loop understands.
KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "past_key_values", "logits_to_keep", "cache_position"}
# generation_config outputs this loop does not produce, with what a user gets instead.
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
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


@dataclass
class SpinGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus what the call did (`stats`). `past_key_values` is None: the
    ragged cache has holes a caller could not use."""

    stats: GenerationStats | None = None


def _row_processors(processors, request: int):
    """The processors as they apply to one original row, called on a [1, L] view of it.

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
    if config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={config.cache_implementation!r} is not supported with assistant_pool; "
            "hf_spin manages its own ragged dynamic cache (leave cache_implementation unset)"
        )
    unknown = set(model_kwargs) - KNOWN_MODEL_KWARGS
    if unknown:
        raise ValueError(f"model inputs {sorted(unknown)} are not supported with assistant_pool; supported: {sorted(KNOWN_MODEL_KWARGS)}")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a pre-filled past_key_values is not supported with assistant_pool; pass the full prompt instead")


class _Rows:
    """The active rows: committed sequences, the padding each prompt came with, and their stats."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.ids = list(range(input_ids.shape[0]))  # [B] request index of each active row
        self.padding = [row[~keep].tolist() for row, keep in zip(input_ids, attention_mask.bool())]
        self.sequences = [row[keep].tolist() for row, keep in zip(input_ids, attention_mask.bool())]
        self.prompt_lengths = [len(s) for s in self.sequences]

    def as_tensor(self, b: int, extra: list[int] = ()) -> torch.Tensor:
        """Row b as plain `generate` would hold it: [1, padding + committed + extra]."""
        return torch.tensor([self.padding[b] + self.sequences[b] + list(extra)])

    def keep(self, kept: list[int]) -> None:
        for name in ("ids", "padding", "sequences", "prompt_lengths"):
            setattr(self, name, [getattr(self, name)[b] for b in kept])


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
    **model_kwargs,
):
    """Speculative decoding with an `AssistantPool`; use as `model.generate(..., custom_generate=hf_spin.generate,
    assistant_pool=pool)` or after `hf_spin.enable()` as `model.generate(..., assistant_pool=pool)`.

    `transformers` drops `streamer` and `tokenizer` on the custom_generate path: pass them as
    `spin_streamer=` and `spin_tokenizer=` there (`hf_spin.enable()` does it for you).
    """
    if assistant_pool is None:
        raise ValueError("hf_spin.generate needs assistant_pool=hf_spin.AssistantPool([...])")
    config = generation_config or model.generation_config
    model_kwargs.pop("synced_gpus", None)
    logits_processor = logits_processor or lp.LogitsProcessorList()
    _validate(model, input_ids, config, assistant_pool, model_kwargs, logits_processor)
    drafters = assistant_pool.bind(model, spin_tokenizer)
    policy = assistant_pool.policy
    stopping_criteria = stopping_criteria or StoppingCriteriaList()
    do_sample = bool(config.do_sample)
    pad_id = int(config._pad_token_tensor) if getattr(config, "_pad_token_tensor", None) is not None else 0
    streamer = spin_streamer
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer supports batch size 1 only, got batch size {input_ids.shape[0]}")

    start = perf_counter()
    B, P = input_ids.shape
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    rows = _Rows(input_ids.cpu(), attention_mask.cpu())
    row_stats = [RowStats() for _ in range(B)]
    names = assistant_pool.names  # unique per drafter
    drafter_stats = {name: DrafterStats() for name in names}
    stats = GenerationStats(rows=row_stats, drafters=drafter_stats)
    generated: list[list[int]] = [[] for _ in range(B)]  # per request, tokens produced
    usable = [True] * len(drafters)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    per_row = [_row_processors(logits_processor, i) for i in range(B)]  # indexed by request

    def score(b: int, prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Target logits processors on one row: prefix = committed + candidate ids, logits [V]."""
        ids = torch.tensor([rows.padding[b] + prefix], device=logits.device)  # [1, L]
        return per_row[rows.ids[b]](ids, logits[None])[0]

    score_fn = score if len(logits_processor) else None
    ids_free = len(logits_processor) > 0 and all(isinstance(p, IDS_FREE_PROCESSORS) for p in logits_processor)

    def commit(b: int, tokens: list[int], scores: torch.Tensor) -> bool:
        """Append tokens to row b one at a time until a stopping criterion fires; True if it stopped."""
        for j, token in enumerate(tokens):
            rows.sequences[b].append(token)
            generated[rows.ids[b]].append(token)
            if stopping_criteria(rows.as_tensor(b), scores[j : j + 1]).any():
                del tokens[j + 1 :]
                return True
        return False

    # 1. Prefill the target exactly as `generate` would, and pick the first token.
    cache = RaggedCache(attention_mask.bool(), contiguous=needs_contiguous_slots(model.config))
    model_kwargs["past_key_values"] = cache
    inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    logits = model(**inputs, return_dict=True).logits[:, -1].to(dtype=torch.float32)  # [B, V]
    scores = logits_processor(input_ids, logits) if len(logits_processor) else logits
    first = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0] if do_sample else scores.argmax(-1)  # [B]
    stats.prefill_seconds = perf_counter() - start
    finished = [commit(b, [int(first[b])], scores[b : b + 1]) for b in range(B)]
    for rs in row_stats:  # the prefill forward produced one token per row: plain decoding scores 1.0
        rs.add(drafted=0, accepted=0, new_tokens=1)
    if streamer is not None:
        streamer.put(first.cpu())
    for d in drafters:
        d.start(model, rows.sequences, target_cache=cache)

    step = 0
    while True:
        # 2. Retire finished rows (the batch only shrinks here, between steps).
        kept = [b for b in range(len(rows.ids)) if not finished[b]]
        now = perf_counter() - start
        for b in range(len(rows.ids)):
            if finished[b]:
                row_stats[rows.ids[b]].wall_seconds = now
        if not kept:
            break
        if len(kept) < len(rows.ids):
            index = torch.tensor(kept)
            rows.keep(kept)
            cache.select_rows(index.to(cache.slot_mask.device))
            for d, ok in zip(drafters, usable):
                if ok:
                    d.select_rows(index)
        B = len(rows.ids)

        # 3. Plan: which drafter and how many tokens per row, capped by the room left before max_length.
        plan = policy.plan(BatchView(row_ids=list(rows.ids), usable=list(usable), step=step))
        room = [config.max_length - len(rows.padding[b]) - len(rows.sequences[b]) - 1 for b in range(B)]
        ks = [max(0, min(plan.k[b], room[b])) if plan.drafter[b] is not None else 0 for b in range(B)]

        # 4. Draft, one call per drafter over the rows it serves. A drafter that raises is dropped.
        drafts: list[list[int]] = [[] for _ in range(B)]
        qs: list[torch.Tensor | None] = [None] * B
        draft_seconds = [0.0] * len(drafters)
        for d_idx, drafter in enumerate(drafters):
            served = [b for b in range(B) if plan.drafter[b] == d_idx and ks[b] > 0]
            if not served or not usable[d_idx]:
                continue
            t = perf_counter()
            try:
                out: Draft = drafter.draft(DraftRequest(served, rows.sequences, [ks[b] for b in served], do_sample, score_fn))
            except Exception as err:  # noqa: BLE001 - any drafter fault must leave decoding lossless
                warnings.warn(f"drafter {drafter.name!r} raised {err!r}; dropped for the rest of this call", stacklevel=2)
                usable[d_idx] = False
                drafter_stats[names[d_idx]].failures += 1
                drafter.finish()
                continue
            draft_seconds[d_idx] = perf_counter() - t
            drafter_stats[names[d_idx]].draft_seconds += draft_seconds[d_idx]
            for b, tokens, q in zip(served, out.tokens, out.q):
                drafts[b], qs[b] = list(tokens), q

        # 5. Verify: one target forward over [last committed token] + drafts for every row.
        t = perf_counter()
        chunks = [[rows.sequences[b][-1]] + drafts[b] for b in range(B)]
        target_logits = forward_ragged(model, cache, chunks).to(dtype=torch.float32)  # [B, K + 1, V]
        K = target_logits.shape[1] - 1
        draft_lengths = torch.tensor([len(d) for d in drafts], device=target_logits.device)  # [B]
        draft_tokens = torch.tensor([d + [0] * (K - len(d)) for d in drafts], device=target_logits.device).view(B, K)
        target_scores = target_logits
        if ids_free:
            V = target_logits.shape[-1]
            target_scores = logits_processor(None, target_logits.reshape(-1, V)).view(B, K + 1, V)
        elif score_fn is not None:
            target_scores = target_logits.clone()
            for b in range(B):
                for j in range(len(drafts[b]) + 1):
                    target_scores[b, j] = score(b, rows.sequences[b] + drafts[b][:j], target_logits[b, j])
        if do_sample:
            p = torch.softmax(target_scores, dim=-1)  # [B, K + 1, V]
            q = _stack_q(qs, drafts, K, p) if any(x is not None for x in qs) else None
            verdict = verify_sampling(p, draft_tokens, draft_lengths, q)
        else:
            verdict = verify_greedy(target_scores, draft_tokens, draft_lengths)
        verify_seconds = perf_counter() - t
        stats.verify_seconds += verify_seconds

        # 6. Commit accepted + recovered/bonus tokens, stop rows, roll the target cache back per row.
        accepted = verdict.accepted.tolist()
        next_tokens = verdict.next_token.tolist()
        finished = []
        for b in range(B):
            new = drafts[b][: accepted[b]] + [next_tokens[b]]
            finished.append(commit(b, new, target_scores[b]))
            rs = row_stats[rows.ids[b]]
            rs.add(len(drafts[b]), accepted[b], len(new))
            if plan.drafter[b] is not None and ks[b] > 0 and usable[plan.drafter[b]]:
                name = names[plan.drafter[b]]
                rs.drafters[name] += 1
                drafter_stats[name].add(len(drafts[b]), accepted[b], len(new))
            if streamer is not None:
                streamer.put(torch.tensor(new))
        cache.rollback(torch.tensor([len(s) - 1 for s in rows.sequences], device=cache.slot_mask.device))
        stats.steps += 1
        policy.update(
            StepFeedback(list(rows.ids), Plan(plan.drafter, ks), [len(d) for d in drafts], accepted, draft_seconds, verify_seconds)
        )
        step += 1

    # 7. Assemble the output like plain `generate`: prompt as given, then tokens, padded on the right.
    for d in drafters:
        d.finish()
    stats.wall_seconds = perf_counter() - start
    assistant_pool.record(stats)
    if streamer is not None:
        streamer.end()
    width = max(len(g) for g in generated)
    tail = torch.full((len(generated), width), pad_id, dtype=input_ids.dtype)
    for i, g in enumerate(generated):
        tail[i, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        return SpinGenerateOutput(sequences=sequences, stats=stats)
    return sequences


def _stack_q(qs: list[torch.Tensor | None], drafts: list[list[int]], K: int, p: torch.Tensor) -> torch.Tensor:
    """Per-row q [k_b, V] (or None: deterministic proposal) -> [B, K, V], zero rows meaning one-hot."""
    q = torch.zeros(p.shape[0], K, p.shape[2], dtype=p.dtype, device=p.device)
    for b, qb in enumerate(qs):
        if qb is not None and len(drafts[b]):
            q[b, : len(drafts[b])] = qb[: len(drafts[b])].to(device=p.device, dtype=p.dtype)
    return q


# --- hf_spin.enable(): `model.generate(..., assistant_pool=pool)` on any causal LM -----------------

_original_generate = None


def _generate_with_pool(model, *args, assistant_pool, streamer=None, tokenizer=None, stop_strings=None, stopping_criteria=None, **kwargs):
    for name in ("custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}= cannot be combined with assistant_pool=; put every drafter in the pool")
    if stop_strings is not None:  # transformers cannot build this criterion on the custom_generate path
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= as well (to match strings against tokens)")
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), StopStringCriteria(tokenizer, stop_strings)])
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
    """Teach every `transformers` model's `generate` the `assistant_pool=` argument (idempotent)."""
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
