"""From a validated HTTP request to an engine `Request`: prompt tokens checked against the server's
limits, logits processors in `transformers`' order, stopping criteria (EOS, stop sequences), the seed."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria

from ..step.rows import Request
from .schemas import DEFAULT_MAX_NEW_TOKENS, Sampling
from .text import StopSequences


class InvalidRequest(ValueError):
    """Input the server refuses with a 4xx (422: a value out of what is supported; 400: input it cannot use
    at all, such as an unreadable file); the message says what was given and what is allowed."""

    def __init__(self, message: str, param: str | None = None, status: int = 422):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_input_tokens: int = 4096  # prompt tokens (after truncation)
    max_total_tokens: int = 8192  # prompt + max_new_tokens: bounds one row's KV cache
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # when the request gives none (capped by max_total_tokens)

    def __post_init__(self):
        if not 1 <= self.max_input_tokens < self.max_total_tokens:
            raise ValueError(
                f"need 1 <= max_input_tokens < max_total_tokens, "
                f"got {self.max_input_tokens} and {self.max_total_tokens}"
            )
        if self.default_max_new_tokens < 1:
            raise ValueError(f"default_max_new_tokens must be >= 1, got {self.default_max_new_tokens}")


def processors(s: Sampling) -> LogitsProcessorList:
    """`transformers`' processors for these parameters, in the order `generate` applies them."""
    out = LogitsProcessorList()
    if s.repetition_penalty not in (None, 1.0):
        out.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.do_sample:
        if s.temperature not in (None, 1.0):
            out.append(lp.TemperatureLogitsWarper(s.temperature))
        if s.top_k is not None:
            out.append(lp.TopKLogitsWarper(s.top_k))
        if s.top_p not in (None, 1.0):
            out.append(lp.TopPLogitsWarper(s.top_p))
        if s.typical_p not in (None, 1.0):
            out.append(lp.TypicalLogitsWarper(s.typical_p))
    return out


def prompt_ids(
    tokenizer, text: str, limits: Limits, truncate: int | None = None, add_special_tokens: bool = True
) -> list[int]:
    if not text:
        raise InvalidRequest("the prompt is empty; give at least one character of input", "inputs")
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if truncate is not None:
        ids = ids[-truncate:]
    if not ids:
        raise InvalidRequest(f"the prompt {text[:40]!r} encodes to no tokens", "inputs")
    if len(ids) > limits.max_input_tokens:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_input_tokens} "
            "(--max-input-tokens; TGI's `truncate` parameter keeps only the last tokens)",
            "inputs",
        )
    return ids


def engine_request(
    s: Sampling, ids: list[int], tokenizer, eos_ids: set[int], limits: Limits, logprobs: bool = True
) -> Request:
    room = limits.max_total_tokens - len(ids)
    max_new = s.max_new_tokens if s.max_new_tokens is not None else min(limits.default_max_new_tokens, room)
    if max_new > room:
        raise InvalidRequest(
            f"max_new_tokens={max_new} is out of range: prompt ({len(ids)} tokens) + max_new_tokens must be <= "
            f"{limits.max_total_tokens} (--max-total-tokens), so at most {room} here",
            "max_new_tokens",
        )
    criteria = StoppingCriteriaList([EosTokenCriteria(sorted(eos_ids))] if eos_ids else [])
    if s.stop:
        criteria.append(StopSequences(tokenizer, s.stop, prompt_length=len(ids)))
    return Request(
        prompt=ids,
        max_new_tokens=max_new,
        processors=processors(s),
        stopping_criteria=criteria,
        do_sample=s.do_sample,
        seed=s.seed if s.do_sample else None,
        logprobs=logprobs,
    )
