"""CTranslate2's ``model.bin`` (a little-endian stream of named tensors, format version 6, ctranslate2/specs) read
into arrays and mapped onto `transformers`' `WhisperForConditionalGeneration`: its state dict, its config and
generation config, and the special tokens they name (docs/speech.md, "Conversion")."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

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
