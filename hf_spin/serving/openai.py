"""OpenAI-compatible routes: `POST /v1/completions` and `POST /v1/chat/completions`, streaming or not.

Shapes as OpenAI's API reference: a completion is {"id": "cmpl-...", "object": "text_completion",
"created", "model", "choices": [{"index": 0, "text", "logprobs": null, "finish_reason": "stop" | "length"}],
"usage": {...}}; a chat completion has "object": "chat.completion" and "message": {"role": "assistant",
"content"}. Streams send chunks (`text` or `delta` per token), a last chunk with the finish reason,
then `data: [DONE]`. Unlike TGI, a stop sequence is cut from the text (held back while it could begin).
Temperature 0 decodes greedily; OpenAI's default temperature (1.0) samples.
"""

from __future__ import annotations

import json
import uuid
from time import perf_counter

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from ..step.rows import CANCELLED, ERROR
from ..version import __version__
from .errors import error_payload
from .requests import InvalidRequest
from .scheduler import Finished, Overloaded
from .schemas import ChatCompletionRequest, CompletionRequest
from .server import SHUTDOWN_MARGIN_SECONDS
from .service import Service
from .text import IncrementalDecoder, StopTrimmer, finish_reason
from .tgi import SSE_PING_SECONDS, _finished, _observe, _refused, stream_failure

FINGERPRINT = f"hf_spin-{__version__}"


def _openai_reason(row, service: Service) -> str:
    return "length" if finish_reason(row, service.eos_ids) == "length" else "stop"


def router(service: Service) -> APIRouter:
    api = APIRouter(prefix="/v1")

    async def run(body, request: Request, route: str, chat: bool):
        t0 = perf_counter()
        sampling = body.to_sampling()
        try:
            if chat:
                prompt = service.chat_prompt([m.model_dump(exclude_none=True) for m in body.messages])
                ids = service.encode(
                    prompt, sampling, add_special_tokens=False
                )  # the template holds the special tokens
            else:
                ids = service.encode(body.prompt, sampling)
            job = service.submit(sampling, ids)
        except (InvalidRequest, Overloaded) as err:
            return _refused(service, request, route, err)
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": job.created,
            "model": body.model or service.model_id,
            "system_fingerprint": FINGERPRINT,
        }

        if not body.stream:
            result, instead = await _finished(service, request, route, job)
            if instead is not None:
                return instead
            end, out, _ = result
            trimmer = StopTrimmer(sampling.stop)
            text = trimmer.push(service.text(out)) + trimmer.flush()
            reason = _openai_reason(end.row, service)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            )
            payload = {
                **head,
                "object": kind,
                "choices": [{**choice, "logprobs": None, "finish_reason": reason}],
                "usage": _usage(ids, out),
            }
            service.metrics.requests.labels(route, "ok").inc()
            _observe(service, job, t0)
            return JSONResponse(payload)

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(piece: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = (
                    {"role": "assistant", "content": ""} if role else ({"content": piece} if piece is not None else {})
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
            return {"data": json.dumps({**head, "object": f"{kind}.chunk" if chat else kind, "choices": [choice]})}

        async def events():
            decoder = IncrementalDecoder(service.tokenizer, ids)
            trimmer = StopTrimmer(sampling.stop)
            out: list[int] = []
            status = "cancelled"
            try:
                if chat:
                    yield chunk(None, None, role=True)
                async for event in job.events():
                    last = isinstance(event, Finished)
                    if last and event.reason in (ERROR, CANCELLED):
                        status, message = stream_failure(event)
                        yield {"data": json.dumps(error_payload(True, message, "generation"))}
                        return
                    for token_id in event.ids:
                        out.append(token_id)
                        piece = decoder.push(token_id)
                        if token_id not in service.special_ids:
                            piece = trimmer.push(piece)
                            if piece:
                                yield chunk(piece, None)
                    if last:
                        rest = trimmer.flush()
                        if rest:
                            yield chunk(rest, None)
                        yield chunk(None, _openai_reason(event.row, service))
                        if include_usage:
                            yield {
                                "data": json.dumps(
                                    {
                                        **head,
                                        "object": f"{kind}.chunk" if chat else kind,
                                        "choices": [],
                                        "usage": _usage(ids, out),
                                    }
                                )
                            }
                        yield {"data": "[DONE]"}
                        status = "ok"
                        _observe(service, job, t0)
            finally:
                if status == "cancelled" and not job.finished_at:
                    service.cancel(job)
                service.metrics.requests.labels(route, status).inc()

        return EventSourceResponse(
            events(),
            ping=SSE_PING_SECONDS,
            shutdown_grace_period=service.shutdown_grace_seconds + SHUTDOWN_MARGIN_SECONDS,
        )

    @api.post("/completions", summary="OpenAI-compatible text completion")
    async def completions(body: CompletionRequest, request: Request):
        return await run(body, request, "completions", chat=False)

    @api.post("/chat/completions", summary="OpenAI-compatible chat completion")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(body, request, "chat_completions", chat=True)

    return api


def _usage(prompt: list[int], out: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
