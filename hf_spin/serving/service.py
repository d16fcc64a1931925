"""What every route shares: the tokenizer, the scheduler, the limits, the metrics, and the two halves
of serving one request (submit it, then wait for its tokens while watching for a client that left)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..step.rows import Request
from .requests import InvalidRequest, Limits, engine_request, prompt_ids
from .scheduler import Finished, Job, Scheduler, Tokens
from .schemas import Sampling
from .text import IncrementalDecoder

# How often a waiting non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_SECONDS = 0.2


@dataclass
class Service:
    model_id: str
    tokenizer: object
    scheduler: Scheduler
    metrics: object  # Metrics
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None  # None: no authentication
    info: dict = field(default_factory=dict)  # extra /info fields: drafters, policy, pipeline, dtype, device
    shutdown_grace_seconds: float = 10.0  # running requests may finish this long after shutdown begins
    text_refusal: str | None = None  # why the text routes refuse this target (an encoder-decoder); None: they serve it

    def __post_init__(self):
        tok = self.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        self.eos_ids: set[int] = set(self.info.pop("eos_token_ids", []) or []) | ({eos} if eos is not None else set())
        self.special_ids: set[int] = set(getattr(tok, "all_special_ids", []) or [])

    # -- one request ---------------------------------------------------------------------------------
    def encode(self, text: str, sampling: Sampling, add_special_tokens: bool = True) -> list[int]:
        self._takes_text()
        return prompt_ids(self.tokenizer, text, self.limits, sampling.truncate, add_special_tokens)

    def chat_prompt(self, messages: list[dict]) -> str:
        self._takes_text()
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                (
                    f"the model {self.model_id!r} has no chat template; "
                    "use /v1/completions or /generate with a plain prompt"
                ),
                "messages",
            )
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def submit(self, sampling: Sampling, ids: list[int]) -> Job:
        """Queue one request (raises InvalidRequest for a max_new_tokens out of range, Overloaded when full)."""
        return self.enqueue(engine_request(sampling, ids, self.tokenizer, self.eos_ids, self.limits))

    def enqueue(self, request: Request) -> Job:
        """Queue an engine request built by a route (raises Overloaded when full)."""
        job = self.scheduler.submit(request)
        self.metrics.prompt_tokens.inc(len(request.prompt))
        return job

    def _takes_text(self) -> None:
        if self.text_refusal is not None:
            raise InvalidRequest(self.text_refusal, "model", status=400)

    async def result(self, job: Job, http_request) -> tuple[Finished, list[int], list[float]] | None:
        """Wait for the whole result; None if the client disconnected first (its row is then cancelled)."""
        ids: list[int] = []
        logprobs: list[float] = []
        getter = asyncio.ensure_future(job.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_SECONDS)
                if not done:
                    if await http_request.is_disconnected():
                        self.cancel(job)
                        return None
                    continue
                event = getter.result()
                ids += event.ids
                logprobs += event.logprobs
                if isinstance(event, Finished):
                    return event, ids, logprobs
                getter = asyncio.ensure_future(job.queue.get())
        finally:
            getter.cancel()

    def cancel(self, job: Job) -> None:
        job.cancel()
        self.scheduler.wake()

    # -- tokens to text --------------------------------------------------------------------------------
    def token_texts(self, prompt: list[int], ids: list[int]) -> list[str]:
        decoder = IncrementalDecoder(self.tokenizer, prompt)
        return [decoder.push(t) for t in ids]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


__all__ = ["Finished", "Service", "Tokens"]
