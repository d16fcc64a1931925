"""The Triton kernels behind `varlen_attention.varlen_attention`, and their launcher.

Inputs, masks and outputs are `varlen_attention`'s (its module docstring holds the conventions); the
dispatcher there checks them, picks this launcher and falls back to the reference when it raises
`KernelUnavailable`. This module imports without Triton (HAS_TRITON is then False and the kernels are
not defined), and imports nothing from `varlen_attention`.

Layout (Liger-Kernel): the split kernel and the merge kernel (`@triton.jit`), the block table and its
fallbacks, the device checks, the launcher `_varlen_attention_triton`, and `_interpretable` (the
kernels under the Triton interpreter on CPU tensors, for the tests).

GQA packing: one program serves one KV head and all G = H / H_kv query heads that share it, so each
K / V tile is loaded once per KV head rather than once per query head. Its BLOCK_M tile rows are
(query, head-in-group) pairs, query-major: packed row r of a row's queries is query r // G of query
head h_kv * G + r % G. A verification row of L_q <= 16 tokens with G = 4 fills 64 tile rows; the
masks read the query index r // G, so causal, window and tree masks are per query as before.

Split-KV (Spin's request decomposition, Eq. 13, in flash-decoding form): the keys of a row are cut into
S splits of `split_size` keys; one program per (query block, row x KV head, split) computes a partial
softmax over its split; a second pass merges the partials with their log-sum-exps (see the merge
kernel). Long rows are processed by many programs in parallel, short rows leave their later splits empty.

Block sizes come from a table keyed on the padded head dim and the element size (`_BLOCK_TABLE`),
sized to leave room in shared memory on sm80+ for K and V tiles times the pipelining stages. Where a
configuration still does not fit (Triton raises OutOfResources at launch: a smaller GPU, another
compiler version) the launcher retries with fewer stages, then smaller BLOCK_N, then smaller BLOCK_M,
and remembers what failed (each failure costs one compile per process); when nothing fits, or the GPU
is older than sm80, it raises KernelUnavailable and the dispatcher warns once and runs the PyTorch
reference (docs/kernels.md).

Compiles: the kernels are specialised on the dtype, head dims, group size, mask flags, tile
(small: <= 16 packed rows, or large) and whether the keys are split (the output pointer's dtype), but
not on the sizes that change every step (total_q, total_k, strides, split_size, number of splits):
those are `do_not_specialize`, and the merge kernel loops over the splits. Strides are passed in units
of STRIDE_ALIGN (a constexpr, the largest power of two up to 16 dividing them all; 16 for any head dim
that is a multiple of 16), so the compiler still knows every row starts aligned and vectorises the
loads. `varlen_attention.warm_up` compiles the variants a serving loop will launch. Offsets are
computed in int64: a layer's K cache may hold more than 2^31 elements.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAS_TRITON = True
except ImportError:  # the reference still works; the dispatcher never picks the kernel
    triton = None
    tl = None
    HAS_TRITON = False

    class OutOfResources(Exception):  # never raised without Triton; keeps the launcher's except clause valid
        pass


# Packed rows (query tokens x heads of a GQA group) up to which a program takes the small tile: the
# smallest tile tl.dot accepts. Above it (wide groups, prefill) the table's large tile.
SMALL_TILE_ROWS = 16
# A split holds at least this many keys: below that the merge costs more than the parallelism buys.
MIN_SPLIT_KEYS = 256
# At most this many splits per row (the merge kernel loads all of a query's log-sum-exps at once).
MAX_SPLITS = 128
# The kernel needs bf16 tensor cores and cp.async: Ampere (sm80) or newer.
MIN_CAPABILITY = (8, 0)


class KernelUnavailable(RuntimeError):
    """The Triton kernel cannot run this call (a GPU older than sm80, no block configuration fits, a head
    dim beyond the table); the dispatcher warns once and runs the reference."""


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAS_TRITON:

    @triton.jit(
        do_not_specialize=[
            "stride_qt",
            "stride_qh",
            "stride_kt",
            "stride_kh",
            "stride_vt",
            "stride_vh",
            "stride_os",
            "stride_ot",
            "stride_oh",
            "stride_ls",
            "stride_lt",
            "split_size",
            "window",
        ]
    )
    def _varlen_attention_split_kernel(
        Q_ptr,  # [total_q, H, D] queries, packed by row
        K_ptr,  # [total_k, H_kv, D] keys, packed by row
        V_ptr,  # [total_k, H_kv, D_v] values, packed by row
        # O_ptr: [S, total_q, H, D_v] partial outputs per split, each normalised within its split (the output itself
        # when S == 1); Lse_ptr: [S, total_q, H] float32 natural-log log-sum-exp of each split's scaled scores (-inf:
        # split saw no key)
        O_ptr,
        Lse_ptr,
        cu_seqlens_q_ptr,  # [B + 1] int32 start of each row's queries
        cu_seqlens_k_ptr,  # [B + 1] int32 start of each row's keys
        seqused_k_ptr,  # [B] int32 keys used per row (only read when HAS_SEQUSED_K)
        Tree_ptr,  # [sum_b L_q(b)^2] int8 packed tree masks (only read when HAS_TREE)
        cu_tree_ptr,  # [B + 1] int32 start of each row's tree block (only read when HAS_TREE)
        softmax_scale,  # float, multiplies q . k
        stride_qt,
        stride_qh,  # Q strides (token, head) in units of STRIDE_ALIGN elements; the head dim is contiguous
        stride_kt,
        stride_kh,  # K strides, likewise
        stride_vt,
        stride_vh,  # V strides, likewise
        stride_os,
        stride_ot,
        stride_oh,  # O strides (split, token, head), likewise
        stride_ls,
        stride_lt,  # Lse strides (split, token) in elements; heads are contiguous
        H_KV,  # key / value heads
        D,  # head dim of q and k
        D_V,  # head dim of v
        split_size,  # keys per split, a multiple of BLOCK_N
        window,  # sliding window W: query at key position p sees keys j > p - W (only read when HAS_WINDOW)
        GROUP: tl.constexpr,  # query heads per KV head (H // H_kv), packed into the tile's rows
        STRIDE_ALIGN: tl.constexpr,  # every Q / K / V / O stride is a multiple of this many elements
        CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_TREE: tl.constexpr,
        HAS_SEQUSED_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32), else the default
        DOT_FP32: tl.constexpr,  # upcast tl.dot operands to float32 (the interpreter multiplies bfloat16 bit patterns)
        BLOCK_M: tl.constexpr,  # packed rows per program: (query, head in group) pairs, query-major
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
        # The merge kernel combines the splits (Eq. 13). Each packed row r is query r // GROUP of query
        # head h_kv * GROUP + r % GROUP: the G heads of a group share every K / V tile loaded here.
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // H_KV
        h_kv = pid_bh % H_KV

        q_start = tl.load(cu_seqlens_q_ptr + b)
        q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
        if pid_m * BLOCK_M >= q_len * GROUP:  # a block past this row's queries (a longer row sized the grid)
            return
        k_start = tl.load(cu_seqlens_k_ptr + b)
        if HAS_SEQUSED_K:
            k_len = tl.load(seqused_k_ptr + b)
        else:
            k_len = tl.load(cu_seqlens_k_ptr + b + 1) - k_start
        prefix = k_len - q_len  # keys before the first new token

        # int64 element offsets: a layer's packed K / V may hold more than 2^31 elements.
        stride_qt = stride_qt.to(tl.int64) * STRIDE_ALIGN
        stride_qh = stride_qh.to(tl.int64) * STRIDE_ALIGN
        stride_kt = stride_kt.to(tl.int64) * STRIDE_ALIGN
        stride_vt = stride_vt.to(tl.int64) * STRIDE_ALIGN
        stride_ot = stride_ot.to(tl.int64) * STRIDE_ALIGN
        stride_oh = stride_oh.to(tl.int64) * STRIDE_ALIGN
        K_ptr += k_start.to(tl.int64) * stride_kt + h_kv.to(tl.int64) * (stride_kh.to(tl.int64) * STRIDE_ALIGN)
        V_ptr += k_start.to(tl.int64) * stride_vt + h_kv.to(tl.int64) * (stride_vh.to(tl.int64) * STRIDE_ALIGN)
        O_ptr += pid_s.to(tl.int64) * (stride_os.to(tl.int64) * STRIDE_ALIGN)
        Lse_ptr += pid_s.to(tl.int64) * stride_ls.to(tl.int64)

        offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed row: query x GROUP + head in group
        offs_m = offs_r // GROUP  # [BLOCK_M] query index within the row
        head = h_kv * GROUP + offs_r % GROUP  # [BLOCK_M] query head
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_valid = offs_m < q_len
        d_valid = offs_d < D
        dv_valid = offs_dv < D_V
        token = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] query token in the packed batch

        q_ptrs = Q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        qk_scale = softmax_scale * 1.4426950408889634  # log2(e): exp2 instead of exp

        lo = pid_s * split_size
        hi = tl.minimum(lo + split_size, k_len)
        if CAUSAL and not HAS_TREE:
            # the block's last query sees keys up to prefix + its index: skip tiles past that
            last_query = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
            hi = tl.minimum(hi, prefix + last_query + 1)
        if HAS_WINDOW:  # the block's first query sees keys from prefix + its index - W + 1: skip tiles before
            lo = tl.maximum(lo, prefix + (pid_m * BLOCK_M) // GROUP - window + 1)
        if HAS_TREE:
            tree_start = tl.load(cu_tree_ptr + b)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_k = start_n + offs_n  # [BLOCK_N] key index within the row
            k_valid = offs_k < hi
            k_ptrs = K_ptr + offs_k[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
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
            v_ptrs = V_ptr + offs_k[:, None].to(tl.int64) * stride_vt + offs_dv[None, :]
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
        o_ptrs = O_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=m_valid[:, None] & dv_valid[None, :])
        l_ptrs = Lse_ptr + token * stride_lt.to(tl.int64) + head
        tl.store(l_ptrs, lse, mask=m_valid)

    @triton.jit(
        do_not_specialize=[
            "stride_ps",
            "stride_pt",
            "stride_ph",
            "stride_ls",
            "stride_lt",
            "stride_ot",
            "stride_oh",
            "stride_mt",
            "S",
        ]
    )
    def _merge_splits_kernel(
        O_part_ptr,  # [S, total_q, H, D_v] float32 partial outputs of the split kernel
        Lse_part_ptr,  # [S, total_q, H] float32 their log-sum-exps
        Out_ptr,  # [total_q, H, D_v] merged output, in the input dtype
        Lse_ptr,  # [total_q, H] float32 merged log-sum-exp
        stride_ps,
        stride_pt,
        stride_ph,  # O_part strides (split, token, head)
        stride_ls,
        stride_lt,  # Lse_part strides (split, token)
        stride_ot,
        stride_oh,  # Out strides (token, head)
        stride_mt,  # Lse stride (token); heads are contiguous
        S,  # number of splits (runtime: a new split count compiles nothing)
        D_V,  # head dim of v
        BLOCK_S: tl.constexpr,  # MAX_SPLITS: every split count shares one compile
        BLOCK_DV: tl.constexpr,
    ):
        # Merge (Spin Eq. 13, the corrected softmax denominator): with O_s and lse_s from the split kernel,
        #   lse = ln sum_s e^{lse_s}
        #   O   = sum_s e^{lse_s - lse} O_s
        # which equals sum_j e^{x_j} v_j / sum_j e^{x_j} over all keys: each split's own denominator
        # e^{lse_s} is swapped for the row's. Empty splits (lse_s = -inf) weigh 0; all empty: O = 0.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        stride_ps, stride_ls = stride_ps.to(tl.int64), stride_ls.to(tl.int64)  # int64 offsets, as in the split kernel
        Lse_part_ptr += t * stride_lt + h
        O_part_ptr += t * stride_pt + h * stride_ph
        lse_s = tl.load(Lse_part_ptr + offs_s * stride_ls, mask=offs_s < S, other=float("-inf"))  # [BLOCK_S]
        lse_max = tl.max(lse_s, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        denom = tl.sum(tl.exp(lse_s - lse_max), 0)
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s in range(0, S):  # one split's partial at a time: S is not a tile size
            w = tl.exp(tl.load(Lse_part_ptr + s * stride_ls) - lse_max)  # 0 for an empty split
            acc += w * tl.load(O_part_ptr + s * stride_ps + offs_dv, mask=offs_dv < D_V, other=0.0)
        denom_safe = tl.where(denom > 0, denom, 1.0)
        out = acc / denom_safe
        tl.store(
            Out_ptr + t * stride_ot + h * stride_oh + offs_dv, out.to(Out_ptr.dtype.element_ty), mask=offs_dv < D_V
        )
        tl.store(Lse_ptr + t * stride_mt + h, tl.where(denom > 0, lse_max + tl.log(denom_safe), float("-inf")))


@dataclass(frozen=True)
class BlockConfig:
    """One launch configuration of the split kernel."""

    block_m: int  # packed rows (query x head in group) per program; >= 16, tl.dot's smallest tile
    block_n: int  # keys per inner-loop step; >= 16 likewise
    num_warps: int  # 8 where a large tile's float32 accumulator [block_m, D] would spill with 4
    num_stages: int  # software-pipelining depth: each stage holds a K and a V tile in shared memory


# (padded head dim, bytes per element) -> (small tile, large tile). Shared memory per program is about
# num_stages * block_n * (BLOCK_D + BLOCK_DV) * bytes for K and V, plus block_m * BLOCK_D * bytes for Q:
# at most ~112 KB here, under an A100's 163 KB and an H100's 227 KB. Smaller GPUs (sm86 / sm89: 99 KB)
# take the launcher's fallbacks.
_BLOCK_TABLE: dict[tuple[int, int], tuple[BlockConfig, BlockConfig]] = {
    (64, 2): (BlockConfig(16, 64, 4, 3), BlockConfig(64, 64, 4, 3)),  # K + V 16 KB a stage
    (128, 2): (BlockConfig(16, 64, 4, 3), BlockConfig(64, 64, 4, 3)),  # 32 KB a stage (D = 80, 96, 128)
    (256, 2): (BlockConfig(16, 32, 4, 2), BlockConfig(64, 32, 8, 2)),  # 32 KB a stage
    (64, 4): (BlockConfig(16, 64, 4, 2), BlockConfig(64, 64, 4, 2)),  # 32 KB a stage
    (128, 4): (BlockConfig(16, 32, 4, 2), BlockConfig(64, 32, 4, 2)),  # 32 KB a stage
    (256, 4): (BlockConfig(16, 32, 4, 1), BlockConfig(32, 32, 8, 1)),  # 64 KB, one stage
}


def block_config(head_dim: int, itemsize: int, rows: int) -> BlockConfig:
    """The table's configuration for a head dim (the larger of q's and v's), element size and packed
    rows per row of queries (max_seqlen_q x group): the small tile up to SMALL_TILE_ROWS rows."""
    block_d = max(64, 1 << (head_dim - 1).bit_length())
    if (block_d, itemsize) not in _BLOCK_TABLE:
        raise KernelUnavailable(f"head dim {head_dim} is not in the varlen kernel's block table (supported: up to 256)")
    small, large = _BLOCK_TABLE[block_d, itemsize]
    return small if rows <= SMALL_TILE_ROWS else large


def _fallback_configs(config: BlockConfig) -> list[BlockConfig]:
    """`config`, then what the launcher tries when it does not fit: one stage, then BLOCK_N halved down
    to 16, then BLOCK_M halved down to 16."""
    configs = [config, replace(config, num_stages=1)]
    while configs[-1].block_n > 16:
        configs.append(replace(configs[-1], block_n=configs[-1].block_n // 2))
    while configs[-1].block_m > 16:
        configs.append(replace(configs[-1], block_m=configs[-1].block_m // 2, num_warps=4))
    return list(dict.fromkeys(configs))


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


def _is_cuda(device: torch.device) -> bool:
    """Its own function so that tests can put a CPU tensor on a pretend old GPU."""
    return device.type == "cuda"


def _check_device(device: torch.device) -> None:
    """Raise KernelUnavailable on a CUDA GPU older than sm80; RuntimeError off CUDA without the interpreter."""
    if _is_cuda(device):
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            raise KernelUnavailable(
                f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                f"the varlen Triton kernel needs sm{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+ (Ampere or newer)"
            )
    elif not _interpret_requested():
        raise RuntimeError(f"the Triton kernel needs CUDA tensors or TRITON_INTERPRET=1; got tensors on {device}")


def _stride_align(tensors: tuple[torch.Tensor, ...]) -> int:
    """The largest power of two up to 16 that divides every token / head / split stride of `tensors`."""
    align = 16
    while align > 1 and any(s % align for x in tensors for s in x.stride()[:-1]):
        align //= 2
    return align


def _cu_tree(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[B + 1] int32 start of each row's [L_q, L_q] block in a packed tree mask (the cumulative squares)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    return torch.nn.functional.pad(torch.cumsum(q_lens * q_lens, 0), (1, 0)).to(torch.int32)


# Configurations that raised OutOfResources, per (device, dtype, head dims, group, tile): skipped afterwards.
_TOO_BIG: set[tuple] = set()


def _launch_split_kernel(grid, args: tuple, constexprs: dict, config: BlockConfig) -> None:
    """One launch of the split kernel (its own function so that tests can make it raise OutOfResources)."""
    kernel = _interpretable(_varlen_attention_split_kernel, args[0].device)
    kernel[grid](
        *args,
        **constexprs,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _launch_merge_kernel(grid, args: tuple, constexprs: dict) -> None:
    """One launch of the merge kernel (its own function so that tests can see what it is specialised on)."""
    _interpretable(_merge_splits_kernel, args[0].device)[grid](*args, **constexprs)


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
    config: BlockConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: returns (out [total_q, H, D_v] in q's dtype, lse [total_q, H] float32).

    config: the block configuration to start from (None: the table's, `block_config`). A configuration
    that does not fit is replaced by its fallbacks (`_fallback_configs`); KernelUnavailable when none
    fits, or when the GPU is older than sm80."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use varlen_attention_ref or install hf-spin[kernels]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its head dim, got strides {x.stride()}; call .contiguous()")
    _check_device(q.device)
    total_q, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[2]
    group = H // H_kv
    B = cu_seqlens_q.numel() - 1
    out = torch.empty(total_q, H, D_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(total_q, H, dtype=torch.float32, device=q.device)
    if total_q == 0 or B == 0 or H == 0:
        return out, lse.fill_(float("-inf"))

    rows = max(max_seqlen_q, 1) * group  # packed rows of the longest row of queries
    first = config or block_config(max(D, D_v), q.element_size(), rows)
    key = (str(q.device), q.dtype, D, D_v, group, rows <= SMALL_TILE_ROWS)
    for candidate in _fallback_configs(first):
        if key + (candidate,) in _TOO_BIG:
            continue
        try:
            return _launch(
                q,
                k,
                v,
                out,
                lse,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                causal,
                softmax_scale,
                tree_mask,
                seqused_k,
                num_splits,
                sliding_window,
                candidate,
            )
        except OutOfResources:
            _TOO_BIG.add(key + (candidate,))
    raise KernelUnavailable(
        f"no block configuration of the varlen kernel fits this GPU for head dim {D}, {q.dtype} "
        f"(tried {first} and smaller, down to 16 x 16 tiles with one stage)"
    )


def _launch(
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    tree_mask,
    seqused_k,
    num_splits,
    sliding_window,
    config: BlockConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One try of the launcher with `config`: grid, splits, strides, then the split and merge kernels."""
    total_q, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[2]
    group = H // H_kv
    B = cu_seqlens_q.numel() - 1
    m_blocks = max(1, triton.cdiv(max(max_seqlen_q, 1) * group, config.block_m))
    if num_splits is None:
        num_splits = default_num_splits(B * H_kv * m_blocks, max_seqlen_k, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    block_n = config.block_n
    split_size = max(block_n, triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), num_splits), block_n) * block_n)
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
    align = _stride_align((q, k, v, o_part))

    args = (
        q,
        k,
        v,
        o_part,
        lse_part,
        cu_seqlens_q,
        cu_seqlens_k,
        used,
        tree,
        cu_tree,
        softmax_scale,
        q.stride(0) // align,
        q.stride(1) // align,
        k.stride(0) // align,
        k.stride(1) // align,
        v.stride(0) // align,
        v.stride(1) // align,
        o_part.stride(0) // align,
        o_part.stride(1) // align,
        o_part.stride(2) // align,
        lse_part.stride(0),
        lse_part.stride(1),
        H_kv,
        D,
        D_v,
        split_size,
        sliding_window or 0,
    )
    constexprs = dict(
        GROUP=group,
        STRIDE_ALIGN=align,
        CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None,
        HAS_TREE=has_tree,
        HAS_SEQUSED_K=seqused_k is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=q.dtype == torch.bfloat16 and q.device.type != "cuda",
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(D_v)),
    )
    _launch_split_kernel((m_blocks, B * H_kv, num_splits), args, constexprs, config)
    if num_splits > 1:
        args = (
            o_part,
            lse_part,
            out,
            lse,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            num_splits,
            D_v,
        )
        _launch_merge_kernel(
            (total_q, H), args, dict(BLOCK_S=MAX_SPLITS, BLOCK_DV=max(16, triton.next_power_of_2(D_v)))
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
