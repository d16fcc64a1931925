"""`varlen_attention` as a `transformers` attention implementation: `attn_implementation="hf_spin_varlen"`.

Two ways in, both inside the model's own forward:

* Packed (padding-free, what hf_spin's ragged path uses): the caller feeds `input_ids [1, total_q]`
  with per-row `position_ids` and a `hf_spin.cache.PackedCache`, and passes a `VarlenMetadata` as the
  `spin_varlen=` model kwarg; `transformers` hands it to every attention call, as it hands
  `cu_seq_lens_q` to its flash-attention path. Queries `[1, H, total_q, D]` and the cache's keys
  `[1, H_kv, total_k, D]` are viewed as flash-attention's `[total, H, D]` without a copy.
* Padded (any ordinary `generate` / forward with `DynamicCache`): the mask builder returns the 2D
  padding mask `[B, S]` (None when nothing is padded), the attention function gathers each row's valid
  keys and queries (the queries are the last T slots), runs the varlen kernel, and scatters the output
  back; padded query slots get zeros (as with flash-attention), so compare logits at real tokens only.

The causal mask is applied by the kernel, aligned to the bottom right, and so is a layer's sliding
window (`sliding_window`, on key positions). Not supported, with an error that says so:
attention-logit soft-capping, attention sinks (`s_aux`), dropout in training, `output_attentions`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, fields

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .varlen_attention import cu_seqlens, varlen_attention

ATTENTION_NAME = "hf_spin_varlen"  # no "flash", "sdpa", "flex_attention" or "/": transformers special-cases those


@dataclass
class VarlenMetadata:
    """Ragged-batch metadata of one packed forward, flash-attention names. B rows, the same for every layer."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32  row b's queries are cu_seqlens_q[b] : cu_seqlens_q[b + 1]
    cu_seqlens_k: torch.Tensor  # [B + 1] int32  row b's key slots start at cu_seqlens_k[b]
    max_seqlen_q: int  # longest row of queries
    max_seqlen_k: int  # longest row of keys (after this forward's append)
    seqused_k: torch.Tensor | None = None  # [B] int32  keys row b uses (its slots may hold spare capacity)
    tree_mask: torch.Tensor | None = None  # [sum_b q_len_b ** 2] bool  see varlen_attention.pack_tree_masks
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> this metadata there

    def on(self, device: torch.device) -> "VarlenMetadata":
        """This metadata with its tensors on `device`, copied once per device and forward: the layers of a
        model dispatched over several devices (`device_map`) each read it where their KV lives."""
        if self.cu_seqlens_q.device == device:
            return self
        if device not in self._copies:
            moved = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
            self._copies[device] = VarlenMetadata(
                **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
            )
        return self._copies[device]

    @classmethod
    def make_dummy(cls, q_lens: list[int], k_lens: list[int], device="cpu") -> "VarlenMetadata":
        """Metadata of rows with these lengths packed back to back (tests)."""

        def cu(lengths):
            return cu_seqlens(torch.tensor(lengths, dtype=torch.long, device=device))

        return cls(cu(q_lens), cu(k_lens), max(q_lens, default=0), max(k_lens, default=0))


def on_device(device: torch.device):
    """The CUDA device context of `device`: Triton launches on the current CUDA device, not on the
    tensors' (a layer on cuda:1 while cuda:0 is current would launch on the wrong GPU). No-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _refuse(module, what: str) -> None:
    name = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    raise NotImplementedError(
        f"attn_implementation={ATTENTION_NAME!r} does not support {what} (model {name!r}); "
        "load the model with attn_implementation='sdpa' or 'eager' and use hf_spin with cache='rectangular'"
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    spin_varlen: VarlenMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query `[B, H, T, D]`, key / value `[B, H_kv, S, D]`,
    attention_mask None or `[B, S]` bool (from `varlen_attention_mask`). Returns (`[B, T, H, D_v]`, None)."""
    if softcap is not None:
        _refuse(module, f"attention-logit soft-capping (softcap={softcap})")
    if s_aux is not None:
        _refuse(module, "attention sinks (s_aux)")
    if dropout and module.training:
        _refuse(module, f"attention dropout in training (dropout={dropout})")
    if kwargs.get("output_attentions"):
        _refuse(module, "output_attentions=True")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if spin_varlen is not None:
        return _packed(query, key, value, spin_varlen, causal, scaling, sliding_window), None
    return _padded(query, key, value, attention_mask, causal, scaling, sliding_window), None


def _packed(query, key, value, meta: VarlenMetadata, causal, scaling, sliding_window) -> torch.Tensor:
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(
            f"spin_varlen needs packed inputs [1, H, total, D], got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}"
        )
    q = query[0].transpose(0, 1)  # [total_q, H, D]
    k = key[0].transpose(0, 1)  # [total_k, H_kv, D]
    v = value[0].transpose(0, 1)  # [total_k, H_kv, D_v]
    meta = meta.on(q.device)
    with on_device(q.device):
        out = varlen_attention(
            q,
            k,
            v,
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            causal,
            scaling,
            tree_mask=meta.tree_mask,
            seqused_k=meta.seqused_k,
            sliding_window=sliding_window,
        )
    return out.unsqueeze(0)  # [1, total_q, H, D_v]


def _padded(query, key, value, attention_mask, causal, scaling, sliding_window) -> torch.Tensor:
    B, H, T, D = query.shape
    S, H_kv, D_v = key.shape[2], key.shape[1], value.shape[3]
    q = query.transpose(1, 2).reshape(B * T, H, D)  # [B * T, H, D]
    k = key.transpose(1, 2).reshape(B * S, H_kv, D)  # [B * S, H_kv, D]
    v = value.transpose(1, 2).reshape(B * S, H_kv, D_v)
    device = query.device
    if attention_mask is None:
        cu_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=device)
        with on_device(device):
            out = varlen_attention(q, k, v, cu_q, cu_k, T, S, causal, scaling, sliding_window=sliding_window)
        return out.view(B, T, H, D_v)
    # Unpad: a row's valid keys in order; its valid queries are its valid slots among the last T.
    key_valid = attention_mask.to(device).bool()  # [B, S]
    query_valid = key_valid[:, S - T :].reshape(-1)  # [B * T]
    k_lens, q_lens = key_valid.sum(1), query_valid.view(B, T).sum(1)  # [B], [B]
    cu_k, cu_q = cu_seqlens(k_lens), cu_seqlens(q_lens)
    key_index = key_valid.reshape(-1).nonzero().squeeze(1)
    query_index = query_valid.nonzero().squeeze(1)
    with on_device(device):
        out_valid = varlen_attention(
            q[query_index],
            k[key_index],
            v[key_index],
            cu_q,
            cu_k,
            int(q_lens.max()),
            int(k_lens.max()),
            causal,
            scaling,
            sliding_window=sliding_window,
        )
    out = torch.zeros(B * T, H, D_v, dtype=out_valid.dtype, device=device)
    out[query_index] = out_valid
    return out.view(B, T, H, D_v)


def varlen_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask builder registered beside the attention function (transformers' `flash_attention_mask` rule):
    the 2D padding mask `[B, kv_length]` bool, or None when no slot is padded. The causal part is the
    kernel's; `mask_function` patterns beyond causal + padding (sliding windows) are checked in the
    attention function, where the window size is known."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if attention_mask.shape[1] < kv_length:  # a mask shorter than the keys: missing slots are valid
        attention_mask = torch.nn.functional.pad(attention_mask, (kv_length - attention_mask.shape[1], 0), value=True)
    if attention_mask.all():
        return None
    return attention_mask


def register(name: str = ATTENTION_NAME) -> None:
    """Register the attention function and its mask builder with transformers under `name` (idempotent)."""
    for bad in ("flash", "sdpa", "flex_attention", "/"):
        if bad in name:
            raise ValueError(
                f"attention name {name!r} contains {bad!r}, which transformers special-cases; pick another"
            )
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, varlen_attention_mask)


register()
