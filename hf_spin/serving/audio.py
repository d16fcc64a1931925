"""OpenAI's `POST /v1/audio/transcriptions` for a Whisper target: audio in, the transcript out.

    curl localhost:8080/v1/audio/transcriptions -F file=@speech.wav -F model=whisper-base -F language=en

The multipart form of OpenAI's API reference (`schemas.TranscriptionRequest`; unknown fields refused):
`file` (16-bit PCM WAV at any rate, resampled to the feature extractor's), `model` (echoed), `language`
(default "en" on a multilingual model, none on an English-only one), `response_format` ("json":
`{"text": ...}`, or "text"), `temperature` (0: greedy, as plain `generate`; up to 1: sampled at it, with
no fallback). Audio longer than the feature extractor's window (30 s for Whisper) is refused, not chunked.

Each request becomes one engine row, as a text request does: the encoder runs once on a worker thread
(one request at a time, off the event loop), and the row, whose prompt is Whisper's forced tokens
(`<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>`) and whose processors are Whisper's
token suppression, joins the scheduler's batch with the server's drafters. Greedy transcripts are those
of plain `model.generate(input_features, language=..., task="transcribe")`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import wave
from time import perf_counter

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria
from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

from ..cache.encoder_rows import EncoderRows
from ..speech_models import decode_wav
from ..step.rows import Request as EngineRequest
from .errors import describe
from .requests import InvalidRequest, processors
from .scheduler import Overloaded
from .schemas import Sampling, TranscriptionRequest
from .service import Service
from .tgi import _finished, _observe, _refused

ROUTE = "transcriptions"  # the metrics' route label
MAX_UPLOAD_BYTES = 25 * 2**20  # OpenAI's limit on the file
DEFAULT_LANGUAGE = "en"  # a multilingual model's language when the request names none (no detection)


# The form in the OpenAPI schema (the route parses it itself, so that an app without python-multipart builds)
FORM_SCHEMA = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary"},
        **{name: {"type": "string"} for name in ("model", "language", "prompt", "response_format")},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    },
}


class Transcriber:
    """What the route needs of a Whisper target: audio to features, features to an encoder output (once
    per request), and the engine row that decodes it as Whisper's own `generate` would."""

    def __init__(self, model, feature_extractor):
        if importlib.util.find_spec("python_multipart") is None:
            raise ImportError("the audio route reads its form with python-multipart: pip install 'hf-spin[serve]'")
        self.model = model
        self.features = feature_extractor
        self.generation = model.generation_config
        self.lock = threading.Lock()  # one encoder pass at a time: concurrent uploads do not oversubscribe cores

    def decoder_prompt(self, language: str | None) -> list[int]:
        """Whisper's forced tokens: start, language and task (multilingual models), no-timestamps."""
        g = self.generation
        ids = [g.decoder_start_token_id]
        lang_to_id = getattr(g, "lang_to_id", None) or {}
        if lang_to_id:
            ids += [self.language_id(language or DEFAULT_LANGUAGE), g.task_to_id["transcribe"]]
        elif language is not None and TO_LANGUAGE_CODE.get(language.lower(), language.lower()) != "en":
            raise InvalidRequest(f"language={language!r}: this model is English-only; give en or none", "language")
        if getattr(g, "no_timestamps_token_id", None) is not None:
            ids.append(g.no_timestamps_token_id)
        return ids

    def language_id(self, language: str) -> int:
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())  # a name ("german") or a code ("de")
        token = self.generation.lang_to_id.get(f"<|{code}|>")
        if token is None:
            known = ", ".join(sorted(k.strip("<|>") for k in self.generation.lang_to_id))
            raise InvalidRequest(f"language={language!r} is not one this model knows; supported: {known}", "language")
        return token

    def encode(self, data: bytes) -> EncoderRows:
        """The encoder side of one row from the uploaded bytes (blocking: run it on a worker thread)."""
        fe = self.features
        try:
            audio = decode_wav(data, fe.sampling_rate)  # [samples] float32 mono
        except (wave.Error, EOFError, ValueError) as err:
            raise InvalidRequest(
                f"the file is not a readable 16-bit PCM WAV ({err}); this server decodes WAV only "
                "(convert with e.g. `ffmpeg -i in.mp3 -ac 1 -ar 16000 out.wav`)",
                "file",
                status=400,
            ) from None
        if not len(audio):
            raise InvalidRequest("the audio is empty (no samples)", "file", status=400)
        if len(audio) > fe.n_samples:
            raise InvalidRequest(
                f"the audio lasts {len(audio) / fe.sampling_rate:.1f} s; this server transcribes at most "
                f"{fe.chunk_length} s per request (long-form audio is not served): split it",
                "file",
                status=400,
            )
        model = self.model
        feats = fe(audio, sampling_rate=fe.sampling_rate, return_tensors="pt").input_features  # [1, n_mels, frames]
        feats = feats.to(model.device, model.dtype)
        with self.lock, torch.no_grad():
            hidden = model.get_encoder()(input_features=feats).last_hidden_state  # [1, S_enc, D]
        return EncoderRows(hidden, None, feats, None)  # no masks: Whisper's features are padded to the window

    def request(self, prompt: list[int], encoder: EncoderRows, temperature: float) -> EngineRequest:
        """The engine row: Whisper's length rule, its suppression processors (in its order), EOS."""
        g, limit = self.generation, self.model.config.max_target_positions
        chain = LogitsProcessorList()
        if g.begin_suppress_tokens:
            chain.append(SuppressTokensAtBeginLogitsProcessor(g.begin_suppress_tokens, begin_index=len(prompt)))
        if g.suppress_tokens:
            chain.append(SuppressTokensLogitsProcessor(g.suppress_tokens))
        sampled = temperature > 0
        chain.extend(processors(Sampling(None, do_sample=sampled, temperature=temperature if sampled else None)))
        eos = [g.eos_token_id] if isinstance(g.eos_token_id, int) else list(g.eos_token_id)
        # Whisper's generate lets the decoder prompt (up to half the window) come on top of max_length; a
        # config without max_length (where `generate` would stop after 20 tokens) decodes up to the window
        max_length = min((g.max_length or limit) + min(limit // 2 - 1, len(prompt)), limit)
        return EngineRequest(
            prompt=prompt,
            max_length=max_length,
            processors=chain,
            stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos)]),
            do_sample=sampled,
            encoder=encoder,
        )


def router(service: Service, transcriber: Transcriber | None) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.post(
        "/audio/transcriptions",
        summary="OpenAI-compatible transcription of a WAV file (a Whisper target)",
        openapi_extra={"requestBody": {"content": {"multipart/form-data": {"schema": FORM_SCHEMA}}}},
    )
    async def transcriptions(request: Request):
        t0 = perf_counter()
        try:
            if transcriber is None:
                raise InvalidRequest(
                    f"this server's model {service.model_id!r} is not a Whisper model; "
                    "/v1/audio/transcriptions needs one (hf-spin serve --model whisper-base)",
                    "model",
                    status=400,
                )
            async with request.form() as form:
                try:
                    body = TranscriptionRequest.model_validate(dict(form))
                except ValidationError as err:
                    status, message, param = describe(err.errors(), TranscriptionRequest)
                    raise InvalidRequest(message, param, status) from None
                data = await body.file.read(MAX_UPLOAD_BYTES + 1)
            if len(data) > MAX_UPLOAD_BYTES:
                raise InvalidRequest(f"the file is over {MAX_UPLOAD_BYTES // 2**20} MiB", "file", status=413)
            ids = transcriber.decoder_prompt(body.language)
            encoder = await asyncio.to_thread(transcriber.encode, data)
            job = service.enqueue(transcriber.request(ids, encoder, body.temperature))
        except (InvalidRequest, Overloaded) as err:
            return _refused(service, request, ROUTE, err)
        result, instead = await _finished(service, request, ROUTE, job)
        if instead is not None:
            return instead
        _, out, _ = result
        text = service.text(out)
        service.metrics.requests.labels(ROUTE, "ok").inc()
        _observe(service, job, t0)
        return PlainTextResponse(text) if body.response_format == "text" else JSONResponse({"text": text})

    return api
