"""Ragged (varlen) attention for verification: each row's new tokens attend to the row's own KV.

Conventions are flash-attention's varlen ones:

    q             [total_q, H, D]      queries of all rows, packed (row b: cu_seqlens_q[b] : cu_seqlens_q[b + 1])
    k, v          [total_k, H_kv, D]   keys / values, packed the same way (H % H_kv == 0: GQA / MQA)
    cu_seqlens_q  [B + 1] int32        cumulative query lengths, cu_seqlens_q[0] == 0
    cu_seqlens_k  [B + 1] int32        cumulative key lengths (row b's keys start at cu_seqlens_k[b])
    seqused_k     [B] int32, optional  keys row b actually uses, from cu_seqlens_k[b] on (the rest of its
                                       slot range is spare capacity: see `hf_spin.cache.PackedCache`)
    out           [total_q, H, D_v]

The causal mask is aligned to the bottom right: with q_len = L_q and k_len = L_k, query i of a row sees
keys j <= L_k - L_q + i, i.e. the queries are the last L_q keys of their row (the last accepted token
plus its drafts, appended to the cache before attention runs). A row with L_q = 0 produces nothing; a
query that sees no key (L_k < L_q) gets a zero output and lse = -inf, as in flash-attention.

Sliding windows (`sliding_window` = W, `transformers`' convention for Mistral / Gemma-3 local layers):
query i of a row, at key position p = L_k - L_q + i, also needs p - j < W, so it sees its last W keys,
itself included. Keys are positions: a row's keys hold no holes (`hf_spin.cache.PackedCache`).

Tree masks (vote trees): `tree_mask` replaces the causal triangle among a row's new tokens. It is a
flat bool tensor `[sum_b L_q(b) ** 2]` holding row b's `[L_q(b), L_q(b)]` block row-major from offset
sum_{c < b} L_q(c) ** 2 (the cumulative lengths of the squares; `pack_tree_masks` builds it). Query i of
row b sees every cached key j < P = L_k - L_q and new key P + t iff tree_mask_b[i, t]. Needs L_k >= L_q.

Implementations: `varlen_triton` holds the Triton kernels (GQA packing, split-KV, the block table,
compiles) and their launcher; this module holds the input checks, `pack_tree_masks`, the pure-PyTorch
reference `varlen_attention_ref`, the dispatcher `varlen_attention` (kernel, else torch's varlen op,
else the reference: docs/kernels.md) and `warm_up`, which compiles the kernel through the dispatcher.
`torch_varlen.py` wraps `torch.nn.attention.varlen` for comparison and as the fallback without Triton.
"""

from __future__ import annotations

import warnings

import torch

from .torch_varlen import torch_varlen_unsupported, varlen_attention_torch
from .varlen_inputs import check_inputs
from .varlen_triton import (
    HAS_TRITON,
    MIN_SPLIT_KEYS,
    SMALL_TILE_ROWS,
    KernelUnavailable,
    _cu_tree,
    _interpret_requested,
    _varlen_attention_triton,
)


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] int32 cumulative starts (flash-attention's cu_seqlens): [2, 3] -> [0, 2, 5]."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def pack_tree_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """B bool masks `[L_q(b), L_q(b)]` -> the flat `tree_mask` `[sum_b L_q(b) ** 2]` (row-major blocks).

    Example: masks [[1]] and [[1, 0], [1, 1]] (a one-token row and a causal two-token row) give
    [1, 1, 0, 1, 1].
    """
    for b, m in enumerate(masks):
        if m.ndim != 2 or m.shape[0] != m.shape[1]:
            raise ValueError(f"tree mask of row {b} must be square [q_len, q_len], got shape {tuple(m.shape)}")
    if not masks:
        return torch.zeros(0, dtype=torch.bool)
    return torch.cat([m.reshape(-1).bool() for m in masks])


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def varlen_attention_ref(
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
    upcast: bool = True,
    return_lse: bool = False,
):
    """Pure-PyTorch reference of `varlen_attention`, one row at a time (same arguments and masks).

    upcast: compute in float32 and cast the output back (the accurate fallback). With False every
    matmul and the softmax run in the input dtype: the "same-precision PyTorch implementation" the
    kernel's error is compared with. max_seqlen_q / max_seqlen_k are accepted for signature parity.
    Returns out `[total_q, H, D_v]` (and lse `[total_q, H]` float32 with return_lse).
    """
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window)
    total_q, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[2]
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(total_q, H, D_v, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, H), float("-inf"), dtype=torch.float32, device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else [cu_k[b + 1] - cu_k[b] for b in range(len(cu_q) - 1)]
    cu_t = _cu_tree(cu_seqlens_q).tolist() if tree_mask is not None else None
    for b in range(len(cu_q) - 1):
        L_q, L_k = cu_q[b + 1] - cu_q[b], used[b]
        if L_q == 0:
            continue
        qb = q[cu_q[b] : cu_q[b + 1]].to(dtype).transpose(0, 1)  # [H, L_q, D]
        kb = k[cu_k[b] : cu_k[b] + L_k].to(dtype).transpose(0, 1).repeat_interleave(H // H_kv, dim=0)  # [H, L_k, D]
        vb = v[cu_k[b] : cu_k[b] + L_k].to(dtype).transpose(0, 1).repeat_interleave(H // H_kv, dim=0)  # [H, L_k, D_v]
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale  # [H, L_q, L_k]
        i = torch.arange(L_q, device=q.device)[:, None]
        new = torch.arange(L_k, device=q.device)[None, :] - (L_k - L_q)  # [1, L_k] index among new tokens
        if tree_mask is not None:
            tree = tree_mask[cu_t[b] : cu_t[b + 1]].view(L_q, L_q)
            allowed = (new < 0) | tree.gather(1, new.clamp(min=0).expand(L_q, -1))
        elif causal:
            allowed = new <= i
        else:
            allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=q.device)
        if sliding_window is not None:
            allowed = allowed & (i - new < sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores.float(), dim=-1)  # [H, L_q]
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key: zeros, as flash-attention
        out[cu_q[b] : cu_q[b + 1]] = torch.matmul(probs.to(dtype), vb).transpose(0, 1).to(q.dtype)
        lse[cu_q[b] : cu_q[b + 1]] = row_lse.transpose(0, 1)
    return (out, lse) if return_lse else out


def use_triton(device: torch.device) -> bool:
    """The dispatcher's rule: Triton on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""
    return HAS_TRITON and (device.type == "cuda" or _interpret_requested())


def varlen_attention(
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
    """Attention of ragged rows of new tokens to their own KV, without padding.

    q `[total_q, H, D]`, k `[total_k, H_kv, D]`, v `[total_k, H_kv, D_v]`, cu_seqlens_q / cu_seqlens_k int32
    `[B + 1]`; max_seqlen_q / max_seqlen_k must bound every row's lengths (they size the grid). Masks
    and layout: see the module docstring. sliding_window: each query sees only its last W keys (None:
    all). num_splits: KV splits per row (None: `default_num_splits`).

    Which implementation runs:
    1. the Triton kernel on CUDA tensors when triton imports, or on any tensors under TRITON_INTERPRET=1;
       where it cannot run (a GPU older than sm80, no block configuration fits, a head dim above 256)
       it warns once and goes on to 3.
    2. without Triton, on CUDA: `torch.nn.attention.varlen` (flash-attention) where the installed torch
       has it and it supports the call (`torch_varlen.torch_varlen_unsupported`);
    3. otherwise the reference `varlen_attention_ref` (float32 math).
    Returns out `[total_q, H, D_v]` in q's dtype (and lse `[total_q, H]` float32 with return_lse).
    """
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    # 1. the Triton kernel
    if use_triton(q.device):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        try:
            out, lse = _varlen_attention_triton(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                int(max_seqlen_q),
                int(max_seqlen_k),
                causal,
                scale,
                tree_mask,
                seqused_k,
                num_splits,
                sliding_window,
            )
            return (out, lse) if return_lse else out
        except KernelUnavailable as e:
            _warn_once(f"{e}: varlen_attention runs the PyTorch reference instead (slower)")
    # 2. flash-attention through torch, without Triton
    elif q.device.type == "cuda":
        if torch_varlen_unsupported(q, k, v, causal, tree_mask, seqused_k, sliding_window, softmax_scale) is None:
            return varlen_attention_torch(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                causal,
                scale,
                seqused_k=seqused_k,
                sliding_window=sliding_window,
                num_splits=num_splits,
                return_lse=return_lse,
            )
    # 3. the reference
    out, lse = varlen_attention_ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
        tree_mask=tree_mask,
        seqused_k=seqused_k,
        sliding_window=sliding_window,
        return_lse=True,
    )
    return (out, lse) if return_lse else out


def warm_up(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str = "cuda",
    *,
    max_seqlen_q: int = 16,
    head_dim_v: int | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    tree_mask: bool = False,
    seqused_k: bool = True,
    prefill: bool = True,
) -> int:
    """Compile the kernel variants that serving with these shapes will launch, before the first request.

    One call per attention kind of a model (global layers; local layers with their `sliding_window`;
    tree verification with `tree_mask=True`). It launches, on a tiny batch, every tile the rows of 1 to
    `max_seqlen_q` query tokens can take (and the large tile of a prefill with `prefill=True`), each with
    the keys in one split and in two, so that the split kernel and the merge kernel are compiled for
    both. The sizes that vary while serving (total_q, total_k, strides, splits) are not specialised:
    nothing recompiles afterwards. Returns the number of launches (0 where the kernel does not run:
    no Triton, or not CUDA without the interpreter).
    """
    device = torch.device(device)
    if not use_triton(device):
        return 0
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    q_lens = {1, max_seqlen_q}  # the small tile (if a group fits it) and the tile of the longest verification row
    if prefill:
        q_lens.add(max(max_seqlen_q, SMALL_TILE_ROWS // group + 1))  # the large tile
    tiles = {}  # small tile or not -> a q_len that takes it
    for q_len in sorted(q_lens):
        tiles.setdefault(q_len * group <= SMALL_TILE_ROWS, q_len)
    launches = 0
    for q_len in tiles.values():
        k_len = q_len + 2 * MIN_SPLIT_KEYS  # enough keys for two splits
        q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(k_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.zeros(k_len, num_kv_heads, head_dim_v or head_dim, dtype=dtype, device=device)
        cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, k_len], dtype=torch.int32, device=device)
        kw = dict(
            tree_mask=torch.ones(q_len * q_len, dtype=torch.bool, device=device) if tree_mask else None,
            seqused_k=torch.tensor([k_len], dtype=torch.int32, device=device) if seqused_k else None,
            sliding_window=sliding_window,
        )
        for splits in (1, 2):
            varlen_attention(q, k, v, cu_q, cu_k, q_len, k_len, causal, num_splits=splits, **kw)
            launches += 1
    return launches
