"""Request bodies the server accepts, as pydantic models that refuse unknown fields.

Two families, each with the field names and JSON shapes of the API it copies:

* TGI (text-generation-inference): `GenerateRequest` = {"inputs": str, "parameters": `Parameters`, "stream": bool}
  for `POST /generate` and `POST /generate_stream`. Every TGI parameter is a known field, so TGI clients that send
  all of them (most send nulls) work; the ones hf_spin does not implement accept only their neutral value.
* OpenAI: `CompletionRequest` (`POST /v1/completions`) and `ChatCompletionRequest` (`POST /v1/chat/completions`),
  likewise; `TranscriptionRequest` (`POST /v1/audio/transcriptions`): the fields of its multipart form.

Each text request becomes one `Sampling` (the generation parameters the engine needs) with `to_sampling()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.datastructures import UploadFile

# TGI's defaults: 100 new tokens, at most 4 stop sequences.
DEFAULT_MAX_NEW_TOKENS = 100
MAX_STOP_SEQUENCES = 4
# OpenAI's default for /v1/completions is 16 tokens; chat has no default (we use TGI's).
OPENAI_COMPLETION_DEFAULT_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "10" is not an int


@dataclass
class Sampling:
    """Generation parameters of one request, validated, in the engine's terms."""

    max_new_tokens: int | None  # None: the route's default, capped by the server's limits
    do_sample: bool = False
    temperature: float | None = None  # None or 1.0: unchanged
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # a row with a seed samples from its own RNG: the same request gives the same tokens
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None  # keep only the last `truncate` prompt tokens (TGI)


def _neutral(name: str, value, neutral) -> None:
    """A field copied from the API for compatibility whose only supported value is its neutral one."""
    if value is not None and value != neutral:
        raise ValueError(f"{name}={value!r} is not supported by hf_spin (only {neutral!r} or null)")


# --- TGI ---------------------------------------------------------------------------------------------


class Parameters(_Strict):
    """TGI's `parameters` object (text-generation-inference, router/src/lib.rs `GenerateParameters`)."""

    best_of: int | None = Field(None, description="only 1 (or null) is supported")
    decoder_input_details: bool = False
    details: bool = False  # return finish reason, token ids, texts and log-probabilities
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: dict | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0)
    return_full_text: bool | None = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    top_n_tokens: int | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    truncate: int | None = Field(None, ge=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    watermark: bool = False
    adapter_id: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: list[str]) -> list[str]:
        if len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}")
        if any(not s for s in stop):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    @model_validator(mode="after")
    def _unsupported(self):
        _neutral("best_of", self.best_of, 1)
        _neutral("decoder_input_details", self.decoder_input_details, False)
        _neutral("frequency_penalty", self.frequency_penalty, 0.0)
        _neutral("grammar", self.grammar, None)
        _neutral("top_n_tokens", self.top_n_tokens, 0)
        _neutral("watermark", self.watermark, False)
        _neutral("adapter_id", self.adapter_id, None)
        return self

    def to_sampling(self) -> Sampling:
        # TGI samples when asked to or when any warper is set (text_generation_server/utils/tokens.py)
        warped = (
            (self.temperature not in (None, 1.0))
            or self.top_k is not None
            or self.top_p not in (None, 1.0)
            or self.typical_p not in (None, 1.0)
        )
        return Sampling(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.do_sample or warped,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            typical_p=self.typical_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=list(self.stop),
            truncate=self.truncate,
        )


class GenerateRequest(_Strict):
    inputs: str
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = False


# --- OpenAI ------------------------------------------------------------------------------------------


class _OpenAICommon(_Strict):
    model: str | None = None  # accepted and echoed; the server runs one model
    temperature: float | None = Field(None, ge=0, le=2)  # 0: greedy; OpenAI's default 1.0 samples
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        _neutral("n", self.n, 1)
        _neutral("presence_penalty", self.presence_penalty, 0.0)
        _neutral("frequency_penalty", self.frequency_penalty, 0.0)
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by hf_spin (only null or {})")
        return self

    def _sampling(self, max_tokens: int | None) -> Sampling:
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature == 0.0
        return Sampling(
            max_new_tokens=max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_p=None if greedy else self.top_p,
            seed=self.seed,
            stop=list(self.stop or []),
        )


class CompletionRequest(_OpenAICommon):
    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got a list of {len(prompt)}")
            prompt = prompt[0]
        return prompt

    @model_validator(mode="after")
    def _completion_unsupported(self):
        _neutral("echo", self.echo, False)
        _neutral("logprobs", self.logprobs, None)
        _neutral("best_of", self.best_of, 1)
        _neutral("suffix", self.suffix, None)
        return self

    def to_sampling(self) -> Sampling:
        return self._sampling(self.max_tokens if self.max_tokens is not None else OPENAI_COMPLETION_DEFAULT_TOKENS)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        _neutral("logprobs", self.logprobs, False)
        _neutral("top_logprobs", self.top_logprobs, 0)
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format is not supported by hf_spin (only null or {'type': 'text'})")
        if self.tools:
            raise ValueError("tools are not supported by hf_spin")
        _neutral("tool_choice", self.tool_choice, "none")
        return self

    def to_sampling(self) -> Sampling:
        tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(tokens)


TRANSCRIPTION_FORMATS = ("json", "text")  # OpenAI's srt, vtt and verbose_json carry timestamps: not served


class TranscriptionRequest(BaseModel):
    """OpenAI's transcription form: its values arrive as strings (coerced, not strict); the file as an upload."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    file: UploadFile  # 16-bit PCM WAV, any rate (resampled), at most the feature extractor's window
    model: str | None = None  # accepted; the server runs one model
    language: str | None = None  # a code or a name Whisper knows; None: "en" (a multilingual model), none (.en)
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = Field(0.0, ge=0, le=1)  # 0: greedy; above: sampled at it (OpenAI's range; no fallback)

    @field_validator("response_format")
    @classmethod
    def _format(cls, value):
        if value not in TRANSCRIPTION_FORMATS:
            raise ValueError(f"{value!r} is not supported; supported: {', '.join(TRANSCRIPTION_FORMATS)}")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_prompt(cls, value):
        if value:
            raise ValueError("a prompt (previous text) is not supported by hf_spin (only empty)")
        return value
