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

Split-KV (Spin's request decomposition, Eq. 13, in flash-decoding form): the keys of a row are cut into
S splits of `split_size` keys; one program per (query block, row x head, split) computes a partial
softmax over its split; a second pass merges the partials with their log-sum-exps (see the merge
kernel). Long rows are processed by many programs in parallel, short rows leave their later splits empty.

Layout of this file (Liger-Kernel): the two `@triton.jit` kernels, their launcher, the pure-PyTorch
reference `varlen_attention_ref`, and the dispatcher `varlen_attention`.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the reference still works; the dispatcher never picks the kernel
    triton = None
    tl = None
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Query rows per program: the smallest tile tl.dot accepts; a verification row has K + 1 <= 16 tokens.
BLOCK_M_VERIFY = 16
# Query rows per program when a row has more queries than that (a prefill through the same kernel).
BLOCK_M_PREFILL = 64
# Keys per inner-loop step.
BLOCK_N = 64
# A split holds at least this many keys: below that the merge costs more than the parallelism buys.
MIN_SPLIT_KEYS = 256
# At most this many splits per row (the merge kernel loads all of a query's partials at once).
MAX_SPLITS = 128


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAS_TRITON:

    @triton.jit
    def _varlen_attention_split_kernel(
        Q_ptr,  # [total_q, H, D] queries, packed by row
        K_ptr,  # [total_k, H_kv, D] keys, packed by row
        V_ptr,  # [total_k, H_kv, D_v] values, packed by row
        O_ptr,  # [S, total_q, H, D_v] partial outputs per split, each normalised within its split (the output itself when S == 1)
        Lse_ptr,  # [S, total_q, H] float32 natural-log log-sum-exp of each split's scaled scores (-inf: split saw no key)
        cu_seqlens_q_ptr,  # [B + 1] int32 start of each row's queries
        cu_seqlens_k_ptr,  # [B + 1] int32 start of each row's keys
        seqused_k_ptr,  # [B] int32 keys used per row (only read when HAS_SEQUSED_K)
        Tree_ptr,  # [sum_b L_q(b)^2] int8 packed tree masks (only read when HAS_TREE)
        cu_tree_ptr,  # [B + 1] int32 start of each row's tree block (only read when HAS_TREE)
        softmax_scale,  # float, multiplies q . k
        stride_qt, stride_qh,  # Q strides (token, head); the head dim is contiguous
        stride_kt, stride_kh,  # K strides
        stride_vt, stride_vh,  # V strides
        stride_os, stride_ot, stride_oh,  # O strides (split, token, head)
        stride_ls, stride_lt,  # Lse strides (split, token); heads are contiguous
        H,  # query heads
        GROUP,  # query heads per KV head (H // H_kv)
        D,  # head dim of q and k
        D_V,  # head dim of v
        split_size,  # keys per split, a multiple of BLOCK_N
        window,  # sliding window W: query at key position p sees keys j > p - W (only read when HAS_WINDOW)
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_TREE: tl.constexpr,
        HAS_SEQUSED_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32), else the default
        DOT_FP32: tl.constexpr,  # upcast tl.dot operands to float32 (the interpreter multiplies bfloat16 bit patterns)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # Maths, for one query row x of a row with L_q queries and L_k keys, split s = keys [lo_s, hi_s):
        #   scores      x_j = softmax_scale * q . k_j                         (masked j: x_j = -inf)
        #   online softmax over the split's key tiles (base 2: x * log2(e), exp2):
        #     m  <- max(m, max_j x_j);  l <- l * 2^(m_old - m) + sum_j 2^(x_j - m)
        #     acc <- acc * 2^(m_old - m) + sum_j 2^(x_j - m) v_j
        #   partial     O_s = acc / l = sum_{j in s} e^{x_j} v_j / sum_{j in s} e^{x_j}
        #   log-sum-exp lse_s = ln sum_{j in s} e^{x_j} = (m + log2 l) * ln 2   (-inf, O_s = 0 when l = 0)
        # The merge kernel combines the splits (Eq. 13).
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // H
        h = pid_bh % H
        h_kv = h // GROUP

        q_start = tl.load(cu_seqlens_q_ptr + b)
        q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k_ptr + b)
        if HAS_SEQUSED_K:
            k_len = tl.load(seqused_k_ptr + b)
        else:
            k_len = tl.load(cu_seqlens_k_ptr + b + 1) - k_start
        prefix = k_len - q_len  # keys before the first new token

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the row
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_valid = offs_m < q_len
        d_valid = offs_d < D
        dv_valid = offs_dv < D_V

        q_ptrs = Q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        qk_scale = softmax_scale * 1.4426950408889634  # log2(e): exp2 instead of exp

        lo = pid_s * split_size
        hi = tl.minimum(lo + split_size, k_len)
        if CAUSAL and not HAS_TREE:
            # the block's last query sees keys up to prefix + its index: skip tiles past that
            last_query = tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len) - 1
            hi = tl.minimum(hi, prefix + last_query + 1)
        if HAS_WINDOW:  # the block's first query sees keys from prefix + its index - W + 1: skip tiles before
            lo = tl.maximum(lo, prefix + pid_m * BLOCK_M - window + 1)
        if HAS_TREE:
            tree_start = tl.load(cu_tree_ptr + b)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_k = start_n + offs_n  # [BLOCK_N] key index within the row
            k_valid = offs_k < hi
            k_ptrs = K_ptr + (k_start + offs_k)[:, None] * stride_kt + h_kv * stride_kh + offs_d[None, :]
            k = tl.load(k_ptrs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if DOT_FP32:  # exact: a product of two bfloat16 values is exact in float32
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            qk = qk * qk_scale  # [BLOCK_M, BLOCK_N]
            allowed = k_valid[None, :] & m_valid[:, None]
            new = offs_k - prefix  # index among the row's new tokens (< 0: cached prefix)
            if HAS_TREE:
                t_ptrs = Tree_ptr + tree_start + offs_m[:, None] * q_len + new[None, :]
                t_mask = m_valid[:, None] & (new >= 0)[None, :] & k_valid[None, :]
                tree = tl.load(t_ptrs, mask=t_mask, other=0)
                allowed = allowed & ((new < 0)[None, :] | (tree != 0))
            elif CAUSAL:
                allowed = allowed & (new[None, :] <= offs_m[:, None])
            if HAS_WINDOW:
                allowed = allowed & (offs_m[:, None] - new[None, :] < window)
            qk = tl.where(allowed, qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: avoid inf - inf
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = V_ptr + (k_start + offs_k)[:, None] * stride_vt + h_kv * stride_vh + offs_dv[None, :]
            v = tl.load(v_ptrs, mask=k_valid[:, None] & dv_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            p = p.to(v.dtype)  # rounded to the input dtype, as flash-attention does
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # ln(2)
        o_ptrs = O_ptr + pid_s * stride_os + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=m_valid[:, None] & dv_valid[None, :])
        l_ptrs = Lse_ptr + pid_s * stride_ls + (q_start + offs_m) * stride_lt + h
        tl.store(l_ptrs, lse, mask=m_valid)

    @triton.jit
    def _merge_splits_kernel(
        O_part_ptr,  # [S, total_q, H, D_v] float32 partial outputs of the split kernel
        Lse_part_ptr,  # [S, total_q, H] float32 their log-sum-exps
        Out_ptr,  # [total_q, H, D_v] merged output, in the input dtype
        Lse_ptr,  # [total_q, H] float32 merged log-sum-exp
        stride_ps, stride_pt, stride_ph,  # O_part strides (split, token, head)
        stride_ls, stride_lt,  # Lse_part strides (split, token)
        stride_ot, stride_oh,  # Out strides (token, head)
        stride_mt,  # Lse stride (token); heads are contiguous
        S,  # number of splits
        D_V,  # head dim of v
        BLOCK_S: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):
        # Merge (Spin Eq. 13, the corrected softmax denominator): with O_s and lse_s from the split kernel,
        #   lse = ln sum_s e^{lse_s}
        #   O   = sum_s e^{lse_s - lse} O_s
        # which equals sum_j e^{x_j} v_j / sum_j e^{x_j} over all keys: each split's own denominator
        # e^{lse_s} is swapped for the row's. Empty splits (lse_s = -inf) weigh 0; all empty: O = 0.
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        s_valid = offs_s < S
        lse_s = tl.load(Lse_part_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_valid, other=float("-inf"))
        lse_max = tl.max(lse_s, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        w = tl.exp(lse_s - lse_max)  # [BLOCK_S], 0 for empty splits
        denom = tl.sum(w, 0)
        p_ptrs = O_part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_dv[None, :]
        o_s = tl.load(p_ptrs, mask=s_valid[:, None] & (offs_dv < D_V)[None, :], other=0.0)  # [BLOCK_S, BLOCK_DV]
        denom_safe = tl.where(denom > 0, denom, 1.0)
        out = tl.sum(o_s * w[:, None], 0) / denom_safe
        tl.store(Out_ptr + t * stride_ot + h * stride_oh + offs_dv, out.to(Out_ptr.dtype.element_ty), mask=offs_dv < D_V)
        tl.store(Lse_ptr + t * stride_mt + h, tl.where(denom > 0, lse_max + tl.log(denom_safe), float("-inf")))


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window=None) -> None:
    """Shapes, dtypes and devices the kernel and the reference both rely on; errors say what was given."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be [total, heads, head_dim] (flash-attention varlen layout), got shape {tuple(x.shape)}")
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
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has {cu_seqlens_k.numel()}; both are [B + 1]")
    B = cu_seqlens_q.numel() - 1
    if seqused_k is not None and (seqused_k.shape != (B,) or seqused_k.dtype != torch.int32 or seqused_k.device != q.device):
        raise ValueError(f"seqused_k must be int32 [B] = [{B}] on {q.device}, got shape {tuple(seqused_k.shape)}, dtype {seqused_k.dtype}, device {seqused_k.device}")
    if tree_mask is not None and (tree_mask.ndim != 1 or tree_mask.dtype != torch.bool or tree_mask.device != q.device):
        raise ValueError(
            f"tree_mask must be a flat bool tensor [sum_b q_len_b ** 2] on {q.device} (see pack_tree_masks), "
            f"got shape {tuple(tree_mask.shape)}, dtype {tree_mask.dtype}, device {tree_mask.device}"
        )
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
        if tree_mask is not None:
            raise ValueError("sliding_window with a tree_mask is not supported: a tree's tokens are not at consecutive positions")


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] int32 cumulative starts (flash-attention's cu_seqlens): [2, 3] -> [0, 2, 5]."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def _cu_tree(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[B + 1] int32 start of each row's [L_q, L_q] block in a packed tree mask."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    return cu_seqlens(q_lens * q_lens)


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


def default_num_splits(batch_heads_blocks: int, max_seqlen_k: int, device: torch.device) -> int:
    """Flash-decoding heuristic: split the keys only while the grid is smaller than about two waves of
    the GPU's SMs, and keep MIN_SPLIT_KEYS keys per split at least."""
    if max_seqlen_k <= MIN_SPLIT_KEYS:
        return 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = max(1, math.ceil(2 * sms / max(batch_heads_blocks, 1)))
    else:  # the interpreter: splitting only adds programs, but it is what the tests exercise
        wanted = MAX_SPLITS
    return max(1, min(wanted, MAX_SPLITS, math.ceil(max_seqlen_k / MIN_SPLIT_KEYS)))


def _varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    tree_mask: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    num_splits: int | None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: returns (out [total_q, H, D_v] in q's dtype, lse [total_q, H] float32)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use varlen_attention_ref or install hf-spin[kernels]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its head dim, got strides {x.stride()}; call .contiguous()")
    if q.device.type != "cuda" and not _interpret_requested():
        raise RuntimeError(f"the Triton kernel needs CUDA tensors or TRITON_INTERPRET=1; got tensors on {q.device}")
    total_q, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[2]
    B = cu_seqlens_q.numel() - 1
    out = torch.empty(total_q, H, D_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(total_q, H, dtype=torch.float32, device=q.device)
    if total_q == 0 or B == 0 or H == 0:
        return out, lse.fill_(float("-inf"))

    block_m = BLOCK_M_VERIFY if max_seqlen_q <= BLOCK_M_VERIFY else BLOCK_M_PREFILL
    m_blocks = max(1, triton.cdiv(max_seqlen_q, block_m))
    if num_splits is None:
        num_splits = default_num_splits(B * H * m_blocks, max_seqlen_k, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    split_size = max(BLOCK_N, triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), num_splits), BLOCK_N) * BLOCK_N)
    num_splits = max(1, triton.cdiv(max(max_seqlen_k, 1), split_size))  # drop splits no row reaches

    if num_splits == 1:  # no merge: the split kernel writes the output and lse directly
        o_part, lse_part = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        o_part = torch.empty(num_splits, total_q, H, D_v, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(num_splits, total_q, H, dtype=torch.float32, device=q.device)
    has_tree = tree_mask is not None
    tree = tree_mask.view(torch.int8) if has_tree else q  # q: an unread placeholder pointer
    cu_tree = _cu_tree(cu_seqlens_q) if has_tree else cu_seqlens_q
    used = seqused_k if seqused_k is not None else cu_seqlens_k

    kernel = _interpretable(_varlen_attention_split_kernel, q.device)
    kernel[(m_blocks, B * H, num_splits)](
        q, k, v, o_part, lse_part,
        cu_seqlens_q, cu_seqlens_k, used, tree, cu_tree,
        softmax_scale,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        H, H // H_kv, D, D_v, split_size, sliding_window or 0,
        CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None,
        HAS_TREE=has_tree,
        HAS_SEQUSED_K=seqused_k is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=q.dtype == torch.bfloat16 and q.device.type != "cuda",
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(D_v)),
    )
    if num_splits > 1:
        merge = _interpretable(_merge_splits_kernel, q.device)
        merge[(total_q, H)](
            o_part, lse_part, out, lse,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0),
            num_splits, D_v,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_DV=max(16, triton.next_power_of_2(D_v)),
        )
    return out, lse


_INTERPRETED: dict = {}


def _interpretable(kernel, device: torch.device):
    """The kernel as the Triton interpreter runs it, for CPU tensors under TRITON_INTERPRET=1.

    `triton.jit` reads TRITON_INTERPRET when it decorates, i.e. when this module is imported; a process
    that set the variable later (a test module imported after another one imported hf_spin) still gets
    the interpreter here."""
    if device.type == "cuda" or not hasattr(kernel, "fn") or type(kernel).__name__ == "InterpretedFunction":
        return kernel
    if kernel not in _INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


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
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window)
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

    Runs the Triton kernel on CUDA tensors when triton imports, or on any tensors under
    TRITON_INTERPRET=1; otherwise the reference `varlen_attention_ref` (float32 math).
    Returns out `[total_q, H, D_v]` in q's dtype (and lse `[total_q, H]` float32 with return_lse).
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, tree_mask, sliding_window)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if use_triton(q.device):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        out, lse = _varlen_attention_triton(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, scale, tree_mask, seqused_k, num_splits,
            sliding_window,
        )
    else:
        out, lse = varlen_attention_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
            tree_mask=tree_mask, seqused_k=seqused_k, sliding_window=sliding_window, return_lse=True,
        )
    return (out, lse) if return_lse else out
