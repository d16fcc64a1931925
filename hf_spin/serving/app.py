"""The ASGI app (FastAPI): TGI's routes, OpenAI-compatible completions, health, info and metrics.

    POST /generate              TGI, one JSON answer            GET /health    200 while the scheduler runs
    POST /                      TGI's compat route (stream: true for SSE)
    POST /generate_stream       TGI, server-sent events          GET /info      models, drafters, policy, limits
    POST /v1/completions        OpenAI (stream: true for SSE)    GET /metrics   Prometheus text
    POST /v1/chat/completions   OpenAI (stream: true for SSE)
    POST /v1/audio/transcriptions   OpenAI, a multipart form with a WAV file (a Whisper target only)

With an API key every route but /health wants `Authorization: Bearer <key>`. The scheduler thread starts
with the app and stops with it (running requests get `shutdown_grace_seconds` to finish).
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..version import __version__
from . import audio, openai, tgi
from .errors import describe, error_response
from .metrics import CONTENT_TYPE
from .schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from .service import Service

# Request body model of each POST route, to list the supported fields when an unknown one comes.
BODY_MODELS = {
    "/": GenerateRequest,
    "/generate": GenerateRequest,
    "/generate_stream": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
ROUTE_NAMES = {
    "/": "generate",
    "/generate": "generate",
    "/generate_stream": "generate_stream",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/audio/transcriptions": audio.ROUTE,
}


def create_app(service: Service, transcriber: audio.Transcriber | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.scheduler.stop, service.shutdown_grace_seconds)

    def authorized(request: Request) -> None:
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
            what = "no Authorization header" if not given else "a wrong API key"
            raise HTTPException(
                401,
                f"this server needs an API key: send 'Authorization: Bearer <key>' (got {what})",
                headers={"WWW-Authenticate": "Bearer"},
            )

    app = FastAPI(title="hf_spin", version=__version__, lifespan=lifespan)
    guarded = [Depends(authorized)]
    app.include_router(tgi.router(service), dependencies=guarded)
    app.include_router(openai.router(service), dependencies=guarded)
    app.include_router(audio.router(service, transcriber), dependencies=guarded)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        status, message, param = describe(exc.errors(), BODY_MODELS.get(request.url.path))
        route = ROUTE_NAMES.get(request.url.path)
        if route:
            service.metrics.requests.labels(route, "invalid").inc()
        return error_response(request, status, message, "malformed" if status == 400 else "validation", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "unauthorized" if exc.status_code == 401 else "validation"
        return error_response(request, exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.get("/health", summary="200 while the server can take requests")
    async def health():
        if service.scheduler.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": "the scheduler thread is not running"}, status_code=503)

    @app.get(
        "/info", summary="model, drafters, policy and limits (TGI's /info plus hf_spin's fields)", dependencies=guarded
    )
    async def info():
        limits = service.limits
        return {
            "model_id": service.model_id,
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": service.scheduler.max_batch_size + service.scheduler.max_queue,
            "max_batch_size": service.scheduler.max_batch_size,
            "max_batch_prefill_tokens": service.scheduler.max_batch_prefill_tokens,
            "max_queue": service.scheduler.max_queue,
            "max_best_of": 1,
            "max_stop_sequences": 4,
            "max_input_tokens": limits.max_input_tokens,
            "max_total_tokens": limits.max_total_tokens,
            "max_client_batch_size": 1,
            "validation_workers": 1,
            "router": "hf_spin",
            "version": __version__,
            "sha": None,
            "docker_label": None,
            **service.info,
        }

    @app.get("/metrics", summary="Prometheus metrics", dependencies=guarded)
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    return app
