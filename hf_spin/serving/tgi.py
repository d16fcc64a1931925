"""TGI's generation routes with its JSON shapes (text-generation-inference, router/src/lib.rs).

`POST /generate` -> {"generated_text": str, "details": {...}} (details when `parameters.details`); `POST /` is
either, by the body's `stream`;
`POST /generate_stream` -> server-sent events, one per token:

    data: {"index": 1, "token": {"id": 330, "text": " a", "logprob": -0.2, "special": false},
           "generated_text": null, "details": null, "top_tokens": null}
    ...
    data: {"index": 8, "token": {...}, "generated_text": "the whole text",
           "details": {"finish_reason": "length", "generated_tokens": 8, "seed": null, "input_length": 5},
           "top_tokens": null}

A request that fails while generating ends with `data: {"error": "...", "error_type": "generation"}`.
"""

from __future__ import annotations

import json
from time import perf_counter

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from ..step.rows import CANCELLED, ERROR
from .errors import error_payload, error_response
from .requests import InvalidRequest
from .scheduler import Finished, Overloaded
from .schemas import GenerateRequest
from .server import SHUTDOWN_MARGIN_SECONDS
from .service import Service
from .text import IncrementalDecoder, finish_reason

# Seconds between SSE keep-alive comments on a quiet stream.
SSE_PING_SECONDS = 15


def _token(service: Service, token_id: int, text: str, logprob: float | None) -> dict:
    return {"id": token_id, "text": text, "logprob": logprob, "special": token_id in service.special_ids}


def _failure(service: Service, request: Request, route: str, end: Finished):
    """The response for a job that did not finish normally (an error, or a shutdown that cancelled it)."""
    if end.reason == ERROR:
        service.metrics.requests.labels(route, "error").inc()
        return error_response(request, 500, f"generation failed: {end.error}", "generation")
    service.metrics.requests.labels(route, "cancelled").inc()
    return error_response(
        request, 503, end.error or "the request was cancelled", "cancelled", headers={"Retry-After": "1"}
    )


async def _finished(service: Service, request: Request, route: str, job):
    """(the job's result `(end, out, logprobs)`, None) once it finished normally, else (None, the response to
    send instead): 499 when the client left (the row was freed), `_failure`'s when it failed or was cancelled."""
    result = await service.result(job, request)
    if result is None:
        service.metrics.requests.labels(route, "cancelled").inc()
        return None, JSONResponse({}, status_code=499)  # nobody is listening; the row was freed
    if result[0].reason in (ERROR, CANCELLED):
        return None, _failure(service, request, route, result[0])
    return result, None


def stream_failure(end: Finished) -> tuple[str, str]:
    """(status label, message) of a streamed job that ended in an error or was cancelled."""
    if end.reason == ERROR:
        return "error", f"generation failed: {end.error}"
    return "cancelled", end.error or "cancelled"


def router(service: Service) -> APIRouter:
    api = APIRouter()

    def start(route: str, body: GenerateRequest):
        sampling = body.parameters.to_sampling()
        ids = service.encode(body.inputs, sampling)
        return sampling, ids, service.submit(sampling, ids)

    @api.post("/generate", summary="Generate text (TGI)")
    async def generate(body: GenerateRequest, request: Request):
        t0 = perf_counter()
        try:
            sampling, ids, job = start("generate", body)
        except (InvalidRequest, Overloaded) as err:
            return _refused(service, request, "generate", err)
        result, instead = await _finished(service, request, "generate", job)
        if instead is not None:
            return instead
        end, out, logprobs = result
        text = service.text(out)
        if body.parameters.return_full_text:
            text = body.inputs + text
        payload = {"generated_text": text}
        if body.parameters.details:
            texts = service.token_texts(ids, out)
            payload["details"] = {
                "finish_reason": finish_reason(end.row, service.eos_ids),
                "generated_tokens": len(out),
                "seed": sampling.seed if sampling.do_sample else None,
                "prefill": [],
                "tokens": [_token(service, t, s, lp) for t, s, lp in zip(out, texts, logprobs)],
                "top_tokens": None,
                "best_of_sequences": None,
            }
        service.metrics.requests.labels("generate", "ok").inc()
        _observe(service, job, t0)
        return JSONResponse(payload, headers=_timing_headers(job, t0, len(ids), len(out)))

    @api.post("/generate_stream", summary="Generate text, one server-sent event per token (TGI)")
    async def generate_stream(body: GenerateRequest, request: Request):
        t0 = perf_counter()
        try:
            sampling, ids, job = start("generate_stream", body)
        except (InvalidRequest, Overloaded) as err:
            return _refused(service, request, "generate_stream", err)

        async def events():
            decoder = IncrementalDecoder(service.tokenizer, ids)
            out: list[int] = []
            status = "cancelled"
            try:
                async for event in job.events():
                    last = isinstance(event, Finished)
                    if last and event.reason in (ERROR, CANCELLED):
                        status, message = stream_failure(event)
                        yield {"data": json.dumps(error_payload(False, message, "generation"))}
                        return
                    for i, (token_id, logprob) in enumerate(zip(event.ids, event.logprobs)):
                        out.append(token_id)
                        final = last and i == len(event.ids) - 1
                        yield {
                            "data": json.dumps(
                                {
                                    "index": len(out),
                                    "token": _token(service, token_id, decoder.push(token_id), logprob),
                                    "generated_text": (body.inputs if body.parameters.return_full_text else "")
                                    + service.text(out)
                                    if final
                                    else None,
                                    "details": {
                                        "finish_reason": finish_reason(event.row, service.eos_ids),
                                        "generated_tokens": len(out),
                                        "seed": sampling.seed if sampling.do_sample else None,
                                        "input_length": len(ids),
                                    }
                                    if final
                                    else None,
                                    "top_tokens": None,
                                }
                            )
                        }
                    if last:
                        status = "ok"
                        _observe(service, job, t0)
            finally:
                if status == "cancelled" and not job.finished_at:
                    service.cancel(job)  # the client went away mid-stream: free its row at the next step
                service.metrics.requests.labels("generate_stream", status).inc()

        return EventSourceResponse(
            events(),
            ping=SSE_PING_SECONDS,
            shutdown_grace_period=service.shutdown_grace_seconds + SHUTDOWN_MARGIN_SECONDS,
        )

    @api.post("/", summary="TGI's compatibility route: /generate, or /generate_stream when stream is true")
    async def compat(body: GenerateRequest, request: Request):
        return await (generate_stream if body.stream else generate)(body, request)

    return api


def _refused(service: Service, request: Request, route: str, err: InvalidRequest | Overloaded) -> JSONResponse:
    if isinstance(err, Overloaded):
        service.metrics.requests.labels(route, "rejected").inc()
        return error_response(request, 503, str(err), "overloaded", headers={"Retry-After": str(err.retry_after)})
    service.metrics.requests.labels(route, "invalid").inc()
    return error_response(request, err.status, str(err), "validation", err.param)


def _observe(service: Service, job, t0: float) -> None:
    now = perf_counter()
    service.metrics.request_seconds.observe(now - t0)
    if job.first_token_at is not None:
        service.metrics.ttft.observe(job.first_token_at - t0)


def _timing_headers(job, t0: float, prompt_tokens: int, generated: int) -> dict:
    """TGI's timing headers (milliseconds)."""
    total = (perf_counter() - t0) * 1000
    queue = ((job.admitted_at or job.submitted_at) - job.submitted_at) * 1000
    inference = total - queue
    return {
        "x-total-time": f"{total:.0f}",
        "x-queue-time": f"{queue:.0f}",
        "x-inference-time": f"{inference:.0f}",
        "x-time-per-token": f"{inference / max(generated, 1):.0f}",
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated),
    }
