"""`torch.nn.attention.varlen.varlen_attn` (PyTorch's flash-attention varlen op) behind `varlen_attention`'s
signature: the baseline benchmarks time the Triton kernel against, and the dispatcher's choice on CUDA
when Triton is missing.

What exists depends on the installed torch, so the wrapper reads `varlen_attn`'s signature rather than
a version number:

    torch 2.9   varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
    torch 2.11  ..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1)   ((-1, 0) is causal)
    torch 2.13  the same plus enable_gqa, seqused_k, block_table, num_splits

Without `enable_gqa` the KV heads are repeated for each query head (a copy, counted in any timing);
without `scale` only the default 1/sqrt(D); without `window_size` no sliding window; without
`seqused_k` no spare key slots (torch 2.11 cannot run a `PackedCache`'s calls).

Never supported here: tree masks (flash-attention has no arbitrary mask), float32 (flash-attention is
fp16 / bf16 only), tensors off CUDA, GPUs older than sm80. Flash-attention's causal mask and windows are
aligned to the bottom right, as `varlen_attention`'s; a query that sees no key gets a zero output and
lse = +inf there, turned into -inf here (this module's convention).
"""

from __future__ import annotations

import inspect
import math

import torch

from .varlen_inputs import check_inputs

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.9
    _varlen_attn = None

# The keyword arguments the installed `varlen_attn` takes (empty without it).
_PARAMETERS = frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # flash-attention 2's largest head dim


def torch_varlen_unsupported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
) -> str | None:
    """Why `varlen_attention_torch` cannot run this call with the installed torch; None when it can."""
    if _varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (added in 2.9)"
    if q.device.type != "cuda":
        return f"varlen_attn is CUDA only; got tensors on {q.device}"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "flash-attention needs sm80+"
    if q.dtype not in FLASH_DTYPES:
        return f"flash-attention takes float16 / bfloat16, got {q.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return (
            f"flash-attention takes one head dim, a multiple of 8 up to {MAX_HEAD_DIM}; "
            f"got D = {q.shape[-1]}, D_v = {v.shape[-1]}"
        )
    if tree_mask is not None:
        return "flash-attention has no tree mask"
    if sliding_window is not None and "window_size" not in _PARAMETERS:
        return "this torch's varlen_attn has no window_size"
    if seqused_k is not None and "seqused_k" not in _PARAMETERS:
        return "this torch's varlen_attn has no seqused_k"
    if (
        softmax_scale is not None
        and "scale" not in _PARAMETERS
        and not math.isclose(softmax_scale, q.shape[-1] ** -0.5)
    ):
        return "this torch's varlen_attn has no scale argument"
    if not causal and sliding_window is not None:
        return "a sliding window without the causal mask"
    return None


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    tree_mask: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """`varlen_attention` through `torch.nn.attention.varlen.varlen_attn`; same arguments and result.

    Raises NotImplementedError saying why where the installed torch cannot run the call
    (`torch_varlen_unsupported`). num_splits is passed where varlen_attn takes it (it changes only the
    rounding)."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window)
    reason = torch_varlen_unsupported(q, k, v, causal, tree_mask, seqused_k, sliding_window, softmax_scale)
    if reason is not None:
        raise NotImplementedError(f"varlen_attention_torch: {reason}; use varlen_attention")
    kw = {}
    if "window_size" in _PARAMETERS:
        left = sliding_window - 1 if sliding_window is not None else -1  # W keys: itself and W - 1 before
        kw["window_size"] = (left, 0) if causal else (-1, -1)
    else:
        kw["is_causal"] = causal
    if "scale" in _PARAMETERS and softmax_scale is not None:
        kw["scale"] = softmax_scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _PARAMETERS:
            kw["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [total_k, H, D]
    if seqused_k is not None:
        kw["seqused_k"] = seqused_k
    if num_splits is not None and "num_splits" in _PARAMETERS:
        kw["num_splits"] = num_splits
    if return_lse and "return_aux" in _PARAMETERS:
        from torch.nn.attention.varlen import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    result = _varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), **kw)
    if not return_lse:
        return result
    if "return_aux" not in _PARAMETERS:
        raise NotImplementedError("this torch's varlen_attn returns no log-sum-exp")
    out, lse = result
    lse = lse.transpose(0, 1).float()  # [H, total_q] -> [total_q, H]
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))  # a query that saw no key
