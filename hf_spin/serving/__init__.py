"""Serving: an HTTP server with TGI's routes and OpenAI-compatible completions over a `SpinEngine`.

    app = hf_spin.serving.build_app(model, tokenizer, hf_spin.AssistantPool([draft, "prompt_lookup"]))
    uvicorn.run(app, host="127.0.0.1", port=8080)        # or: hf-spin serve --model ... --drafter ...

    # a Whisper target serves audio (POST /v1/audio/transcriptions) instead of text:
    app = build_app(whisper, processor.tokenizer, pool, feature_extractor=processor.feature_extractor)

Modules: `schemas` (request bodies), `requests` (body -> engine Request), `scheduler` (the thread that
owns the engine), `service` (what routes share), `tgi`, `openai` and `audio` (the routes), `app` (the
FastAPI app: errors, auth, health, info, metrics), `metrics`, `text` (stop sequences, incremental
decoding), `cli` (`hf-spin serve`).
"""

from __future__ import annotations

from ..pool import AssistantPool
from ..step.engine import SpinEngine
from .metrics import Metrics
from .requests import Limits
from .scheduler import Scheduler
from .service import Service


def build_app(
    model,
    tokenizer,
    pool: AssistantPool | None = None,
    *,
    model_id: str | None = None,
    max_batch_size: int = 16,
    max_queue: int = 64,
    max_batch_prefill_tokens: int = 4096,
    limits: Limits | None = None,
    api_key: str | None = None,
    pipeline: bool | int = False,
    threads: int | None = None,
    draft_threads: int | None = None,
    shutdown_grace_seconds: float = 10.0,
    info: dict | None = None,
    feature_extractor=None,
):
    """The ASGI app serving `model` (with `pool`'s drafters; None: plain decoding, still batched).

    pipeline: False, True (micro-batches chosen by Spin's heuristic) or a fixed number of micro-batches.
    threads: torch threads of the scheduler thread (the target's); draft_threads: of the pipeline's drafting thread.
    feature_extractor: a Whisper target's (`WhisperFeatureExtractor`), required for one: audio to features.
    Returns a FastAPI app; `app.state.service` holds the parts.
    """
    from .app import create_app  # fastapi is only needed once an app is built

    def make_engine():
        if pipeline:
            from ..step.pipeline import Pipeline

            fixed = None if pipeline is True else int(pipeline)
            return Pipeline(
                model, pool, tokenizer, micro_batches=fixed, isolate_faults=True, draft_threads=draft_threads
            )
        return SpinEngine(model, pool, tokenizer, isolate_faults=True)

    transcriber, text_refusal = _speech(model, feature_extractor)
    holder: dict = {}
    metrics = Metrics(
        engine_stats=lambda: dict(holder["scheduler"].engine.drafter_stats) if "scheduler" in holder else {}
    )
    scheduler = Scheduler(
        make_engine,
        max_batch_size=max_batch_size,
        max_queue=max_queue,
        metrics=metrics,
        threads=threads,
        max_batch_prefill_tokens=max_batch_prefill_tokens,
    )
    holder["scheduler"] = scheduler
    eos = model.generation_config.eos_token_id
    details = {
        "model_dtype": str(model.dtype),
        "model_device_type": model.device.type,
        "speculation": pool is not None,
        "drafters": [{"name": i.name, "kind": i.kind, "num_parameters": i.num_parameters} for i in pool.infos]
        if pool
        else [],
        "policy": type(pool.policy).__name__ if pool else None,
        "cache": pool.cache_layout if pool else None,
        "pipeline": "auto" if pipeline is True else (int(pipeline) if pipeline else False),
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        **({"model_pipeline_tag": "automatic-speech-recognition"} if transcriber else {}),
        **(info or {}),
    }
    service = Service(
        model_id=model_id or getattr(model.config, "name_or_path", "") or model.config.model_type,
        tokenizer=tokenizer,
        scheduler=scheduler,
        metrics=metrics,
        limits=limits or Limits(),
        api_key=api_key,
        info=details,
        shutdown_grace_seconds=shutdown_grace_seconds,
        text_refusal=text_refusal,
    )
    app = create_app(service, transcriber)
    app.state.service = service
    return app


def _speech(model, feature_extractor):
    """(the audio route's `Transcriber` or None, why the text routes refuse the target or None)."""
    from .audio import Transcriber

    config = model.config
    if config.model_type == "whisper":
        if feature_extractor is None:
            raise ValueError(
                "a Whisper target needs its feature extractor: "
                "build_app(..., feature_extractor=processor.feature_extractor)"
            )
        refusal = "the model is a Whisper speech recognizer: send audio to POST /v1/audio/transcriptions, not text"
        return Transcriber(model, feature_extractor), refusal
    if getattr(config, "is_encoder_decoder", False):
        return None, f"the text routes take causal LMs; this target ({config.model_type}) is an encoder-decoder"
    return None, None


__all__ = ["Limits", "Metrics", "Scheduler", "Service", "build_app"]
