"""EasySpec: layer-parallel "fuzzy" drafting with bonus calibration (Wu et al., 2025, arXiv 2502.02493).

Fuzzy speculation. The decoder layers of the drafter are grouped into sets of N consecutive layers
(the first and last layers always stay alone; the remainder of the middle forms a smaller last set).
Within a set S = {s, ..., s+N-1} every attention reads the hidden state h_s *entering the set*, so all
N attentions can run at once; the residual stream and the MLPs stay sequential, and each layer still
adds its own attention output to the running hidden state:

    a_i  = Attn_i(LN_i(h_s))                  for every i in S, together (one batched computation)
    h'_i = h_i + a_i                          (h_i: running state, h_s at i = s)
    h_i+1 = h'_i + MLP_i(LN'_i(h'_i))

Exact decoding is the special case where every set has one layer (a_i = Attn_i(LN_i(h_i))), so
group_size=1 runs the model's own layers in the model's own order and equals the plain drafter bit for bit.
Worked example: 24 layers, N = 4 -> sets [0] [1-4] [5-8] [9-12] [13-16] [17-20] [21-22] [23].

On one device a set's attention runs batched: its layers' q/k/v projections are one `bmm` over weights
stacked once per drafter (copies: the model itself is never touched), the attention cores run per layer
over each layer's own KV, the output projections are one more `bmm`. When a set's layers sit on several
devices (see `fuzzy_device_map`), each layer's attention runs on its own device; every attention of
the set is launched before the first residual add, so on GPUs they overlap.

Bonus calibration. Draft steps write fuzzy KV. After each verification the drafter drops the fuzzy
KV entries (rollback to the last exactly computed token) and runs the accepted tokens plus the
bonus token through the model once, sequentially and exactly. That catch-up refills the cache with the
plain drafter's KV and yields the first draft token of the round, which is therefore exact; the
other k - 1 are fuzzy. Without calibration only the prompt prefill is exact; every later forward,
catch-up included, is fuzzy and fuzzy KV is kept.

Lossless by construction: verification only sees the proposal and, when sampling, the fuzzy draft
distribution q'' it was drawn from, so the target distribution is kept exactly whatever q'' is.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import CACHE_ARG, forward_ragged
from .model import ModelDrafter

# Decoders whose forward is exactly: embed -> rotary -> [pre-norm attention, pre-norm MLP] x L -> norm -> lm_head,
# with layers named input_layernorm / self_attn (q_proj, k_proj, v_proj, o_proj) / post_attention_layernorm / mlp.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_GROUP_SIZE = 4  # EasySpec's default set size
MASK_FUNCTIONS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def layer_sets(num_layers: int, group_size: int) -> list[list[int]]:
    """Layer indices per set: first and last layer alone, the middle in runs of group_size."""
    if num_layers <= 2:
        return [[i] for i in range(num_layers)]
    middle = list(range(1, num_layers - 1))
    return [[0]] + [middle[i : i + group_size] for i in range(0, len(middle), group_size)] + [[num_layers - 1]]


def fuzzy_device_map(config, devices: list, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, object]:
    """A `device_map` for `from_pretrained` / `accelerate.dispatch_model` that spreads every set over `devices`.

    The j-th layer of a set goes to devices[j % len(devices)]; embeddings, the first and last layers,
    the final norm and the LM head stay on devices[0]. Example, 6 layers, N = 2, devices [0, 1]:
    layers 0, 1, 3, 5 on 0; layers 2, 4 on 1.
    """
    c = config.get_text_config()
    home = devices[0]
    device_map: dict[str, object] = {
        "model.embed_tokens": home,
        "model.rotary_emb": home,
        "model.norm": home,
        "lm_head": home,
    }
    for layer_set in layer_sets(c.num_hidden_layers, group_size):
        for j, i in enumerate(layer_set):
            device_map[f"model.layers.{i}"] = devices[j % len(devices)]
    return device_map


def _check_layout(model) -> None:
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"FuzzyDrafter supports pre-norm Llama/Qwen2-style decoders {SUPPORTED_MODEL_TYPES}, got model_type "
            f"{config.model_type!r}; use hf_spin.ModelDrafter for it (exact drafting)"
        )
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"FuzzyDrafter needs model.model.{{{', '.join(needed)}}} and model.lm_head; "
            f"{type(model).__name__} lacks some"
        )
    for i, layer in enumerate(inner.layers):
        parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        attn_parts = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(hasattr(layer, n) for n in parts) or not all(hasattr(layer.self_attn, n) for n in attn_parts):
            raise ValueError(
                f"FuzzyDrafter: decoder layer {i} of {type(model).__name__} lacks one of {parts} "
                f"/ self_attn.{attn_parts}"
            )
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("FuzzyDrafter cannot run a model with offloaded (meta) weights; load it fully on its devices")


def _layer_kind(config, i: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return types[i]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


@dataclass
class _StackedSet:
    """One set's attention projections stacked along a leading set dimension N (copies of the model's weights)."""

    qkv_weight: torch.Tensor  # [N, C, Oq + Ok + Ov]  transposed q/k/v projection weights
    qkv_bias: torch.Tensor | None  # [N, 1, Oq + Ok + Ov], None when no layer has a bias
    o_weight: torch.Tensor  # [N, H*D, C]  transposed output projection weights
    o_bias: torch.Tensor | None  # [N, 1, C]
    sizes: tuple[int, int, int]  # Oq, Ok, Ov
    source: tuple  # (data_ptr, version) of every source parameter: stale when the model's weights change


def _params(attn) -> list[torch.Tensor | None]:
    return [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
            attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias]  # fmt: skip


def _fingerprint(attns) -> tuple:
    return tuple((p.data_ptr(), p._version) if p is not None else None for a in attns for p in _params(a))


def _stack(attns) -> _StackedSet:
    q, k, v, o = ([getattr(a, name) for a in attns] for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    qkv_weight = torch.stack(
        [torch.cat([qi.weight, ki.weight, vi.weight]).T for qi, ki, vi in zip(q, k, v)]
    ).contiguous()

    def bias(*projs):
        if all(p.bias is None for p in projs):
            return None
        return torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projs])

    qkv_bias = [bias(qi, ki, vi) for qi, ki, vi in zip(q, k, v)]
    o_bias = [bias(oi) for oi in o]
    return _StackedSet(
        qkv_weight=qkv_weight,
        qkv_bias=None if all(b is None for b in qkv_bias) else torch.stack(qkv_bias)[:, None],
        o_weight=torch.stack([oi.weight.T for oi in o]).contiguous(),
        o_bias=None if all(b is None for b in o_bias) else torch.stack(o_bias)[:, None],
        sizes=(q[0].out_features, k[0].out_features, v[0].out_features),
        source=_fingerprint(attns),
    )


class LayerParallelForward:
    """The drafter's forward with each set's attentions reading the set's input hidden state.

    Called like the model (the keyword arguments `forward_ragged` passes) and returns
    `CausalLMOutputWithPast(logits=...)`. Holds no per-call state; the stacked weights are built on
    first use and rebuilt if the model's attention weights change.

    batched: run a single-device set's projections as one `bmm` (True) or call each layer's own
        attention module (False; also what sets spread over several devices do).
    """

    def __init__(self, model, group_size: int = DEFAULT_GROUP_SIZE, batched: bool = True):
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        _check_layout(model)
        self.model = model
        self.config = model.config.get_text_config()
        self.group_size = group_size
        self.batched = batched
        self.sets = layer_sets(self.config.num_hidden_layers, group_size)
        self.is_exact = all(len(s) == 1 for s in self.sets)  # N = 1, or too few layers to group: the model's forward
        self._stacked: dict[int, _StackedSet] = {}  # first layer of a set -> its stacked weights

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, S + T] over cache slots
        position_ids: torch.Tensor,  # [B, T] true positions
        cache_position: torch.Tensor | None = None,  # unused: masks come from position_ids and the 2D mask
        use_cache: bool = True,
        return_dict: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        **cache_arg,  # {CACHE_ARG: the RectangularCache}, named as the installed transformers names it
    ) -> CausalLMOutputWithPast:
        inner, cache = self.model.model, cache_arg[CACHE_ARG]
        h = inner.embed_tokens(input_ids)  # [B, T, C]
        kinds = {_layer_kind(self.config, i) for i in range(self.config.num_hidden_layers)}
        masks = {
            kind: MASK_FUNCTIONS[kind](
                config=self.config,
                inputs_embeds=h,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{CACHE_ARG: cache},
            )
            for kind in kinds
        }
        rope = inner.rotary_emb(h, position_ids)  # (cos, sin), each [B, T, D]
        ctx = _Context(masks, rope, position_ids, cache)
        layers = inner.layers
        for layer_set in self.sets:
            if len(layer_set) == 1:  # the model's own layer, exactly as the model runs it
                i = layer_set[0]
                dev = _device(layers[i])
                h = layers[i](
                    h.to(dev),
                    attention_mask=ctx.mask(self.config, i, dev),
                    position_embeddings=ctx.rope_on(dev),
                    position_ids=ctx.on(position_ids, dev),
                    use_cache=True,
                    **{CACHE_ARG: cache},
                )
                continue
            attn_out = self._set_attention(layer_set, h, ctx)  # N x [B, T, C], each on its layer's device
            for i, a in zip(layer_set, attn_out):
                layer = layers[i]
                h = h.to(a.device) + a  # h'_i = h_i + a_i
                h = h + layer.mlp(layer.post_attention_layernorm(h))  # h_i+1 = h'_i + MLP_i(LN'_i(h'_i))
        h = inner.norm(h.to(_device(inner.norm)))
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        lm_head = self.model.lm_head
        return CausalLMOutputWithPast(logits=lm_head(h[:, keep].to(lm_head.weight.device)))

    def _set_attention(self, layer_set: list[int], x: torch.Tensor, ctx: _Context) -> list[torch.Tensor]:
        """Every attention of the set on the set's input x [B, T, C]: a_i = Attn_i(LN_i(x))."""
        layers = self.model.model.layers
        devices = {_device(layers[i]) for i in layer_set}
        if self.batched and len(devices) == 1:
            return self._batched_attention(layer_set, x.to(devices.pop()), ctx)
        out = []
        for i in layer_set:  # one device per layer: launched back to back, they overlap on GPUs
            dev = _device(layers[i])
            xi = x.to(dev, non_blocking=True)
            a, _ = layers[i].self_attn(
                hidden_states=layers[i].input_layernorm(xi),
                position_embeddings=ctx.rope_on(dev),
                attention_mask=ctx.mask(self.config, i, dev),
                position_ids=ctx.on(ctx.position_ids, dev),
                **{CACHE_ARG: ctx.cache},
            )
            out.append(a)
        return out

    def _stacked_weights(self, layer_set: list[int]) -> _StackedSet:
        attns = [self.model.model.layers[i].self_attn for i in layer_set]
        stacked = self._stacked.get(layer_set[0])
        if stacked is None or stacked.source != _fingerprint(attns):
            stacked = self._stacked[layer_set[0]] = _stack(attns)
        return stacked

    def _batched_attention(self, layer_set: list[int], x: torch.Tensor, ctx: _Context) -> list[torch.Tensor]:
        layers = self.model.model.layers
        B, T, C = x.shape
        N = len(layer_set)
        w = self._stacked_weights(layer_set)
        normed = torch.stack([layers[i].input_layernorm(x) for i in layer_set]).view(N, B * T, C)  # [N, BT, C]
        if w.qkv_bias is None:
            qkv = torch.bmm(normed, w.qkv_weight)  # [N, BT, Oq + Ok + Ov]
        else:
            qkv = torch.baddbmm(w.qkv_bias, normed, w.qkv_weight)
        cos, sin = ctx.rope_on(x.device)
        cores = []
        for n, i in enumerate(layer_set):
            attn = layers[i].self_attn
            D = attn.head_dim
            q, k, v = (t.reshape(B, T, -1, D) for t in qkv[n].view(B, T, -1).split(w.sizes, dim=-1))  # [B, T, H, D]
            if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
            q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
            k, v = ctx.cache.update(k, v, i)  # [B, Hkv, S + T, D]
            kind = _layer_kind(self.config, i)
            core, _ = _attention_function(attn, self.config)(
                attn,
                q,
                k,
                v,
                ctx.mask(self.config, i, x.device),
                dropout=0.0,
                scaling=attn.scaling,
                sliding_window=self.config.sliding_window if kind == "sliding_attention" else None,
            )  # [B, T, H, D]
            cores.append(core.reshape(B * T, -1))
        o = torch.stack(cores)  # [N, BT, H*D]
        out = torch.bmm(o, w.o_weight) if w.o_bias is None else torch.baddbmm(w.o_bias, o, w.o_weight)  # [N, BT, C]
        return list(out.view(N, B, T, C))


def _attention_function(attn, config):
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)


def _device(module) -> torch.device:
    return next(module.parameters()).device


class _Context:
    """Per-forward inputs shared by every layer, moved to a layer's device once per device."""

    def __init__(self, masks: dict, rope: tuple, position_ids: torch.Tensor, cache):
        self.masks, self.rope, self.position_ids, self.cache = masks, rope, position_ids, cache
        self._moved: dict = {}

    def on(self, t, device):
        if t is None or not isinstance(t, torch.Tensor) or t.device == device:
            return t
        key = (id(t), device)
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]

    def rope_on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.on(self.rope[0], device), self.on(self.rope[1], device)

    def mask(self, config, i: int, device):
        return self.on(self.masks[_layer_kind(config, i)], device)


class FuzzyDrafter(ModelDrafter):
    """A same-tokenizer draft model run with EasySpec's layer-parallel fuzzy forward.

        hf_spin.FuzzyDrafter(model, group_size=4, calibrate=True)

    group_size: N, layers per set (1 = exact, the plain drafter).
    calibrate: refill the KV of accepted + bonus tokens exactly after each verification (bonus
        calibration); False keeps fuzzy KV and runs every forward after the prefill fuzzily.
    batched: one-device sets run their projections as one batched matmul (see LayerParallelForward).
    """

    def __init__(
        self,
        model,
        group_size: int = DEFAULT_GROUP_SIZE,
        calibrate: bool = True,
        batched: bool = True,
        name: str | None = None,
    ):
        super().__init__(model, name=name)
        self.fuzzy = LayerParallelForward(model, group_size, batched)
        self.calibrate = calibrate
        if name is None:
            self.name += f"-fuzzy{group_size}" + ("" if calibrate else "-uncalibrated")

    @property
    def group_size(self) -> int:
        return self.fuzzy.group_size

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        super().start(target, sequences, target_cache)
        # calibration: track the exact prefix, so that fuzzy KV never survives a verification, accepted or not
        self.exact = [0] * len(sequences) if self.calibrate else None

    def _forward(self, chunks: list[list[int]], keep: list[int] | None) -> torch.Tensor:
        served = [b for b, chunk in enumerate(chunks) if chunk]
        if keep is None:  # a draft step: fuzzy
            logits = forward_ragged(self.model, self.cache, chunks, all_logits=False, forward=self.fuzzy)
            if self.exact is not None and self.fuzzy.is_exact:  # sets of one layer: the model's own computation
                for b in served:
                    self.exact[b] += len(chunks[b])
            return logits
        if self.calibrate or any(keep[b] == 0 for b in served):  # calibration, or a prompt prefill: exact
            logits = super()._forward(chunks, keep)
            if self.exact is not None:
                for b in served:
                    self.exact[b] = keep[b] + len(chunks[b])
            return logits
        return forward_ragged(self.model, self.cache, chunks, all_logits=False, forward=self.fuzzy)
