"""`POST /v1/audio/transcriptions` on a real loopback server with a tiny random Whisper target: concurrent
requests of different lengths, rates and languages each transcribed as plain `generate` transcribes its
audio alone; every refusal in OpenAI's error shape; the text routes refusing a Whisper target, and the
audio route refusing a causal LM.

The tiny Whisper reads 8 mel bins over 32 frames, so its feature extractor here has a 1 s window
(16 kHz, hop 500); its vocabulary is the character tokenizer's, which decodes the transcript.
"""

from __future__ import annotations

import asyncio
import io
import re
import wave

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from hf_spin.serving import build_app
from hf_spin.speech_models import decode_wav

from .archs import EOS, WHISPER_FRAMES, tiny_encoder_decoder
from .speculation import perturb
from .speculation import pool as spin_pool
from .test_server import Served
from .tiny_tokenizers import char_tokenizer

RATE = 16_000
# a 1 s window of WHISPER_FRAMES frames: the tiny model's encoder input
FEATURES = dict(feature_size=8, sampling_rate=RATE, hop_length=RATE // WHISPER_FRAMES, chunk_length=1, n_fft=400)
ROUTE = "/v1/audio/transcriptions"
SUPPRESSED, BEGIN_SUPPRESSED = [71], [10, EOS]  # tokens the tiny model picks: its suppression matters
MAX_LENGTH = 24  # generation_config.max_length (real Whisper: 448); the 4 forced tokens come on top

pytestmark = pytest.mark.usefixtures("one_thread")


def whisper():
    model = tiny_encoder_decoder("whisper", init_std=0.1)
    model.generation_config.suppress_tokens = list(SUPPRESSED)
    model.generation_config.begin_suppress_tokens = list(BEGIN_SUPPRESSED)
    model.generation_config.max_length = MAX_LENGTH
    return model


def wav(seconds: float, rate: int = RATE, channels: int = 1, seed: int = 0, width: int = 2) -> bytes:
    """Noise as a PCM WAV file of `width` bytes a sample."""
    n = int(seconds * rate)
    pcm = np.random.default_rng(seed).integers(-8000, 8000, size=n * channels)
    data = pcm.astype("<i2").tobytes() if width == 2 else (pcm // 256 + 128).astype(np.uint8).tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)
    return out.getvalue()


@pytest.fixture(scope="module")
def target():
    return whisper()


@pytest.fixture(scope="module")
def features():
    return WhisperFeatureExtractor(**FEATURES)


@pytest.fixture(scope="module")
def served(target, features):
    pool = spin_pool([perturb(whisper()), "prompt_lookup"], policy="round_robin")
    s = Served(build_app(target, char_tokenizer(), pool, model_id="tiny-whisper", feature_extractor=features))
    yield s
    s.stop()


def plain(target, features, data: bytes, language: str) -> str:
    """Plain `generate` on the audio alone, decoded (Whisper's short-form output leaves out the forced tokens)."""
    audio = decode_wav(data, RATE)
    feats = features(audio, sampling_rate=RATE, return_tensors="pt").input_features  # [1, 8, 32]
    out = target.generate(feats, language=language, task="transcribe")
    return char_tokenizer().decode(out[0], skip_special_tokens=True)


def post(client, data: bytes, **form):
    """The form with `data` as its file (none when `form` gives `file` as a plain field)."""
    files = {} if "file" in form else {"file": ("speech.wav", data, "audio/wav")}
    return client.post(ROUTE, files=files, data={"model": "whisper", **form})


def test_transcripts_equal_plain_generate_under_concurrency(served, target, features):
    """Four concurrent requests: audio of 0.3-1 s, at 16 and 8 kHz, mono and stereo, English and German
    (and the default language, English); each transcript is plain `generate`'s, and drafts were made."""
    cases = [
        (wav(0.3, seed=1), {"language": "en"}, "en"),
        (wav(0.7, rate=8000, seed=2), {"language": "de"}, "de"),
        (wav(1.0, channels=2, seed=3), {}, "en"),
        (wav(0.5, seed=4), {"language": "german", "response_format": "text"}, "de"),
    ]

    async def go():
        async with served.async_client() as c:
            return await asyncio.gather(*(post(c, data, **form) for data, form, _ in cases))

    responses = asyncio.run(go())
    texts = [plain(target, features, data, language) for data, _, language in cases]
    assert len(set(texts)) > 1, "the audio should change the transcript"
    for r, (_, form, _), text in zip(responses, cases, texts):
        assert r.status_code == 200, r.text
        if form.get("response_format") == "text":
            assert r.headers["content-type"].startswith("text/plain") and r.text == text
        else:
            assert r.json() == {"text": text}
    drafted = sum(d.drafted for d in served.service.metrics.drafter_totals().values())
    assert drafted > 0
    with served.client() as c:
        metrics = c.get("/metrics").text
        info = c.get("/info").json()
    assert 'hf_spin_requests_total{route="transcriptions",status="ok"} 4.0' in metrics
    assert info["model_pipeline_tag"] == "automatic-speech-recognition"


def test_sampled_transcription(served):
    with served.client() as c:
        r = post(c, wav(0.4, seed=5), temperature="0.7")
    assert r.status_code == 200 and isinstance(r.json()["text"], str), r.text


REFUSED = [
    (wav(0.3), {"response_format": "srt"}, 422, "response_format", r"'srt' is not supported; supported: json, text"),
    (wav(0.3), {"response_format": "verbose_json"}, 422, "response_format", r"supported: json, text"),
    (b"ID3 this is an mp3", {}, 400, "file", r"not a readable 16-bit PCM WAV .*WAV only"),
    (wav(0.3, width=1), {}, 400, "file", r"only 16-bit PCM WAV is supported, got 8-bit"),
    (wav(1.5), {}, 400, "file", r"the audio lasts 1.5 s; this server transcribes at most 1 s per request"),
    (wav(0.0), {}, 400, "file", r"the audio is empty"),
    (wav(0.3), {"language": "fr"}, 422, "language", r"'fr' is not one this model knows; supported: de, en"),
    (wav(0.3), {"temperature": "1.5"}, 422, "temperature", r"temperature: Input should be less than or equal to 1"),
    (wav(0.3), {"prompt": "Hello."}, 422, "prompt", r"a prompt \(previous text\) is not supported"),
    (
        wav(0.3),
        {"timestamp_granularities[]": "word"},
        422,
        "timestamp_granularities[]",
        r"unknown field; supported: file, language, model, prompt, response_format, temperature",
    ),
    (b"", {"file": "speech.wav"}, 422, "file", r"file: Input should be an instance of UploadFile"),
]


@pytest.mark.parametrize("data, form, status, param, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refusals_say_what_was_wrong(served, data, form, status, param, message):
    with served.client() as c:
        r = post(c, data, **form)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None
    assert re.search(message, err["message"]), err["message"]


def test_a_form_without_a_file_and_text_routes_are_refused(served):
    with served.client() as c:
        r = c.post(ROUTE, data={"model": "whisper"})
        assert r.status_code == 422 and "file: required field missing" in r.json()["error"]["message"], r.text
        for route, body in (("/v1/completions", {"prompt": "ab"}), ("/generate", {"inputs": "ab"})):
            r = c.post(route, json=body)
            assert r.status_code == 400, r.text
            assert "send audio to POST /v1/audio/transcriptions" in r.text
        assert 'route="transcriptions",status="invalid"' in c.get("/metrics").text
    with pytest.raises(ValueError, match="a Whisper target needs its feature extractor"):
        build_app(whisper(), char_tokenizer())


def test_a_causal_lm_target_refuses_audio_and_t5_refuses_both():
    from .archs import tiny_model

    s = Served(build_app(tiny_model("llama"), char_tokenizer(), model_id="tiny-llama"))
    try:
        with s.client() as c:
            r = post(c, wav(0.3))
    finally:
        s.stop()
    assert r.status_code == 400
    assert re.search(r"'tiny-llama' is not a Whisper model; .* needs one", r.json()["error"]["message"])
    s = Served(build_app(tiny_encoder_decoder("t5"), char_tokenizer(), model_id="tiny-t5"))
    try:
        with s.client() as c:
            audio, text = post(c, wav(0.3)), c.post("/generate", json={"inputs": "ab"})
    finally:
        s.stop()
    assert audio.status_code == 400 and "not a Whisper model" in audio.text
    assert text.status_code == 400 and "this target (t5) is an encoder-decoder" in text.json()["error"]


def test_serve_a_local_whisper_folder(tmp_path, target, features):
    """`hf-spin serve --model FOLDER` with a Whisper folder: its feature extractor comes along, prompt lookup
    is the default drafter, and the transcript is plain `generate`'s."""
    import argparse

    from hf_spin.serving import cli

    target.generation_config._from_model_config = False  # as a checkpoint's: kept on load, languages included
    target.save_pretrained(tmp_path)
    features.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    s = Served(cli.build(parser.parse_args(["--model", str(tmp_path), "--dtype", "float32", "--device", "cpu"])))
    data = wav(0.6, seed=6)
    try:
        with s.client() as c:
            r = post(c, data)
            drafters = [d["kind"] for d in c.get("/info").json()["drafters"]]
    finally:
        s.stop()
    assert r.status_code == 200 and r.json() == {"text": plain(target, features, data, "en")}, r.text
    assert drafters == ["prompt_lookup"]


@pytest.mark.real_models
def test_packaged_whisper_base_served_with_tiny_en_drafting():
    """`hf-spin serve --model whisper-base --drafter whisper-tiny.en --drafter prompt_lookup` (tiny.en
    re-indexed into base's vocabulary): the five LibriVox utterances, sent at once, come back as plain
    `generate`'s transcripts (float32, CPU)."""
    import argparse

    import torch

    from hf_spin import speech_models as sm
    from hf_spin.serving import cli

    from .test_speech_models import _real_available

    if reason := _real_available():
        pytest.skip(reason)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--model", "whisper-base", "--drafter", "whisper-tiny.en", "--drafter", "prompt_lookup"]
    s = Served(cli.build(parser.parse_args(argv + ["--dtype", "float32", "--device", "cpu"])))
    samples = sm.speech_samples()

    def as_wav(sample) -> bytes:
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(sample.sampling_rate)
            w.writeframes((np.clip(sample.audio, -1, 1 - 2**-15) * 32768).astype("<i2").tobytes())
        return out.getvalue()

    async def go():
        async with s.async_client() as c:
            return await asyncio.gather(*(post(c, as_wav(x), language="en") for x in samples))

    try:
        responses = asyncio.run(go())
        drafted = sum(d.drafted for d in s.service.metrics.drafter_totals().values())
    finally:
        s.stop()
    model, processor = sm.load("whisper-base", torch.float32, device="cpu")
    for r, sample in zip(responses, samples):
        audio = decode_wav(as_wav(sample), RATE)  # the samples as the server read them (16-bit)
        features = processor(audio, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.no_grad():
            ids = model.generate(features, language="en", task="transcribe")
        assert r.status_code == 200 and r.json() == {"text": processor.batch_decode(ids, skip_special_tokens=True)[0]}
        assert sm.wer(sample.text, r.json()["text"]) <= 0.2, (sample.text, r.json())
    assert drafted > 0
