"""The inputs every varlen attention path relies on (the Triton kernel, PyTorch's flash op, the reference):
shapes, dtypes and devices checked once, with errors that say what was given."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window=None) -> None:
    """Shapes, dtypes and devices the kernel and the reference both rely on; errors say what was given."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must be [total, heads, head_dim] (flash-attention varlen layout), got shape {tuple(x.shape)}"
            )
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share the head dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same [total_k, H_kv], got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.ndim != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1D int32 tensor [B + 1], got shape {tuple(cu.shape)}, dtype {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has {cu_seqlens_k.numel()}; "
            "both are [B + 1]"
        )
    B = cu_seqlens_q.numel() - 1
    if seqused_k is not None and (
        seqused_k.shape != (B,) or seqused_k.dtype != torch.int32 or seqused_k.device != q.device
    ):
        raise ValueError(
            f"seqused_k must be int32 [B] = [{B}] on {q.device}, got shape {tuple(seqused_k.shape)}, "
            f"dtype {seqused_k.dtype}, device {seqused_k.device}"
        )
    if tree_mask is not None and (tree_mask.ndim != 1 or tree_mask.dtype != torch.bool or tree_mask.device != q.device):
        raise ValueError(
            f"tree_mask must be a flat bool tensor [sum_b q_len_b ** 2] on {q.device} (see pack_tree_masks), "
            f"got shape {tuple(tree_mask.shape)}, dtype {tree_mask.dtype}, device {tree_mask.device}"
        )
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
        if tree_mask is not None:
            raise ValueError(
                "sliding_window with a tree_mask is not supported: a tree's tokens are not at consecutive positions"
            )
