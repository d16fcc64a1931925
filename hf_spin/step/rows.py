"""Rows: what a caller asks the engine for (`Request`) and what the engine keeps per active row (`Row`).

A row is one sequence being generated. It joins the running batch with a prefill, produces tokens step
by step, and leaves the batch between steps once it stops (a stopping criterion, its length limit), is
cancelled, or fails. Every row carries its own generation parameters: logits processors, stopping
criteria, length limit, greedy or sampled, and a seed of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..cache.encoder_rows import EncoderRows
from ..stats import RowStats
from .continuations import Continuation

# Why a row left the batch (Row.finish_reason).
LENGTH = "length"  # reached its length limit (max_length / max_new_tokens)
STOPPED = "stop"  # a stopping criterion fired (EOS, a stop sequence, a user criterion)
CANCELLED = "cancelled"  # the caller cancelled it (a client that went away, a shutdown)
ERROR = "error"  # its prefill, verification or commit raised; `Row.error` says what


@dataclass
class Request:
    """One sequence to generate.

    Example: `Request(prompt=[1, 5, 9], max_new_tokens=16)` decodes greedily up to 16 tokens;
    `Request(prompt, max_new_tokens=16, do_sample=True, processors=LogitsProcessorList([TemperatureLogitsWarper(0.7)]),
    seed=0)` samples at temperature 0.7, the same tokens whenever it runs.
    """

    prompt: list[int]  # [L] prompt token ids, without padding
    max_new_tokens: int | None = None  # tokens to generate at most; or give max_length
    max_length: int | None = None  # at most this many tokens in padding + prompt + generated (generate's meaning)
    processors: LogitsProcessorList = field(default_factory=LogitsProcessorList)  # applied to target and drafts alike
    stopping_criteria: StoppingCriteriaList = field(
        default_factory=StoppingCriteriaList
    )  # called on [1, padding + sequence]
    do_sample: bool = False  # False: greedy
    seed: int | None = None  # sampled rows: draw each token by Gumbel-max with noise fixed by (seed, position), so the
    #                          tokens depend on the seed alone, never on drafts or batch; None: torch's global RNG
    padding: list[int] = field(
        default_factory=list
    )  # left padding the row had in a `generate` batch (processors see it)
    logprobs: bool = False  # record the log-probability of every generated token (after processors)
    # an encoder-decoder target's encoder side of this row (one row: its output, mask, input), computed once;
    # `prompt` is then the decoder prompt (e.g. Whisper's start, language and task tokens). None: a causal LM
    encoder: EncoderRows | None = None

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a Request needs a non-empty prompt (at least one token id)")
        if (self.max_new_tokens is None) == (self.max_length is None):
            raise ValueError(
                f"give exactly one of max_new_tokens and max_length, "
                f"got {self.max_new_tokens!r} and {self.max_length!r}"
            )
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
            self.max_length = len(self.padding) + len(self.prompt) + self.max_new_tokens
        # a max_length at or below the prompt still yields one token, as plain `generate` does


@dataclass(eq=False)
class Row:
    """The engine's state of one request while it runs, and what it produced."""

    id: int  # unique within an engine (and across the lanes of a pipeline)
    request: Request
    sequence: list[int] = field(default_factory=list)  # committed: prompt + generated
    generated: list[int] = field(default_factory=list)  # generated tokens only
    logprobs: list[float] = field(default_factory=list)  # per generated token, when request.logprobs
    stats: RowStats = field(default_factory=RowStats)
    banned: set[int] = field(default_factory=set)  # drafters that raised while serving this row
    finish_reason: str | None = None  # None while running; LENGTH, STOPPED, CANCELLED or ERROR
    error: str | None = None  # what went wrong, for ERROR
    cancel_requested: bool = False  # set by `cancel`; the row leaves at the next step
    # the request's stopping criteria read on the host (stopping.HostStop), False where they cannot be; None: not read
    # yet
    host_stop: object = None
    added_at: float = field(default_factory=perf_counter)
    # drafter -> its draft followed past its step, scored against the tokens committed after (continuations.py)
    continuations: dict[int, Continuation] = field(default_factory=dict)

    def __post_init__(self):
        if not self.sequence:
            self.sequence = list(self.request.prompt)

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def draft_room(self) -> int:
        """Draft tokens this row may still verify: one more token (recovered or bonus) must fit too
        (`BatchView.room`, the tokens it may still generate, is one more). A step's k is capped by
        it in `planning.planner.plan_k`."""
        return self.request.max_length - len(self.request.padding) - len(self.sequence) - 1

    def as_tensor(self, extra: list[int] = ()) -> torch.Tensor:
        """The row as plain `generate` would hold it: [1, padding + committed + extra]."""
        return torch.tensor([self.request.padding + self.sequence + list(extra)])

    def fail(self, err: BaseException | str) -> None:
        if not self.done:
            self.finish_reason, self.error = ERROR, err if isinstance(err, str) else f"{type(err).__name__}: {err}"
