"""Spin's request decomposition, for verification without the varlen kernel: pick the block width.

A padded batched attention over ragged KV lengths L_1..L_B computes `[B, max_b L_b]` scores: it wastes
`B * max L - sum L` padded tokens. Spin cuts every row into blocks of one width w (the last block of a
row may be shorter), pads every block to w, runs one batched attention over the

    n(w) = sum_b ceil(L_b / w)                                     blocks of width w,

and merges the blocks of each row through their log-sum-exps (Eq. 13; the merge is written out in
`varlen_triton._merge_splits_kernel`). What it computes is `n(w) * w` tokens, of which

    padded(w) = n(w) * w - sum_b L_b                               are padding.

The planner chooses w. Objective: `padded(w) + block_overhead * n(w)`; `block_overhead` (default 0: the
padded-token count alone) prices what every extra block costs, in tokens (its copy of the queries, its
partial output and log-sum-exp, its share of the merge). Ties go to the widest block (fewest blocks).

The search (exact; the paper's own pseudo-code was not at hand when this was written, so this is the
search as implemented here, over the range the paper uses: from the shortest row to the longest):

1. Candidate range: w in [w_lo, w_hi] with w_lo = max(min_width or shortest row, 1) and w_hi = the
   longest row (a wider block only adds padding). A lower bound is needed: with w = 1 nothing is padded
   and every token is its own block; Spin cuts long rows down to about the length of the short ones,
   so the default lower bound is the shortest row. `multiple_of` restricts w to multiples of a tile size.
2. Pruning: between two consecutive breakpoints n(w) is constant while n(w) * w grows with w, so the
   optimum sits on a breakpoint, the smallest w giving some row b exactly m blocks: w = ceil(L_b / m)
   (rounded up to `multiple_of`), for m = 1 .. ceil(L_b / w_lo), plus w_lo itself.
3. Evaluate the objective on every candidate (O(B) each) and keep the best. With C candidates
   (C <= sum_b L_b / w_lo + B) that is O(B * C); `brute_force_block_width` checks it against every w.

Worked example: lengths [4, 8, 13] (sum 25). Unsplit: width 13, 3 blocks, 3 * 13 - 25 = 14 padded.
Candidates from w_lo = 4: w = 4 gives blocks 1 + 2 + 4 = 7 and 7 * 4 - 25 = 3 padded; w = 5: 1 + 2 + 3 = 6,
30 - 25 = 5; w = 7: 1 + 2 + 2 = 5, 35 - 25 = 10; w = 13: 14. The plan is w = 4 (3 padded tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class DecompositionPlan:
    """Blocks of one width covering every row; row b's blocks are consecutive, in key order."""

    block_width: int  # w: every block is padded to this many keys
    num_blocks: int  # n(w) = sum_b ceil(L_b / w)
    padded_tokens: int  # n(w) * w - sum_b L_b
    padded_tokens_unsplit: int  # B * max L - sum L: a plain padded batch
    block_row: list[int] = field(default_factory=list)  # [N] row of each block
    block_start: list[int] = field(default_factory=list)  # [N] first key of each block within its row
    block_length: list[int] = field(default_factory=list)  # [N] real keys in each block (<= w)


def _blocks(lengths: list[int], w: int) -> int:
    return sum(math.ceil(L / w) for L in lengths)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _objective(lengths: list[int], w: int, block_overhead: float) -> tuple[float, int]:
    n = _blocks(lengths, w)
    return n * w - sum(lengths) + block_overhead * n, -w  # ties: the widest block


def _range(lengths: list[int], min_width: int | None, multiple_of: int) -> tuple[int, int]:
    if any(L < 0 for L in lengths):
        raise ValueError(f"lengths must be >= 0, got {lengths}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    positive = [L for L in lengths if L > 0]
    lo = max(min_width if min_width is not None else min(positive), 1)
    hi = max(positive)
    lo, hi = _round_up(lo, multiple_of), _round_up(hi, multiple_of)
    return lo, max(lo, hi)


def plan_decomposition(
    lengths: list[int], min_width: int | None = None, multiple_of: int = 1, block_overhead: float = 0.0
) -> DecompositionPlan:
    """The block width minimising `padded(w) + block_overhead * n(w)` over the breakpoints (see module doc).

    lengths: KV length of every row (0: a row with nothing to attend to, it gets no block).
    min_width: lower bound of the search (default: the shortest non-empty row).
    multiple_of: block widths are multiples of this (a kernel tile, e.g. 16 or 64).
    """
    lengths = [int(L) for L in lengths]
    if not any(lengths):
        return DecompositionPlan(block_width=0, num_blocks=0, padded_tokens=0, padded_tokens_unsplit=0)
    lo, hi = _range(lengths, min_width, multiple_of)
    candidates = {lo, hi}
    for L in lengths:
        for m in range(1, math.ceil(L / lo) + 1):
            w = _round_up(math.ceil(L / m), multiple_of)
            if lo <= w <= hi:
                candidates.add(w)
    best = min(candidates, key=lambda w: _objective(lengths, w, block_overhead))
    return make_plan(lengths, best)


def brute_force_block_width(
    lengths: list[int], min_width: int | None = None, multiple_of: int = 1, block_overhead: float = 0.0
) -> int:
    """Every width in the range, for tests of the pruned search."""
    lengths = [int(L) for L in lengths]
    lo, hi = _range(lengths, min_width, multiple_of)
    return min(range(lo, hi + 1, multiple_of), key=lambda w: _objective(lengths, w, block_overhead))


def make_plan(lengths: list[int], w: int) -> DecompositionPlan:
    """The blocks of width w over these rows."""
    if w < 1:
        raise ValueError(f"block width must be >= 1, got {w}")
    rows, starts, sizes = [], [], []
    for b, L in enumerate(lengths):
        for start in range(0, L, w):
            rows.append(b)
            starts.append(start)
            sizes.append(min(w, L - start))
    total, longest = sum(lengths), max(lengths)
    return DecompositionPlan(
        block_width=w,
        num_blocks=len(rows),
        padded_tokens=len(rows) * w - total,
        padded_tokens_unsplit=len(lengths) * longest - total,
        block_row=rows,
        block_start=starts,
        block_length=sizes,
    )


def decomposed_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale=None,
    plan: DecompositionPlan | None = None,
):
    """`varlen_attention` without the kernel, as Spin runs it: one padded batched attention over the plan's
    blocks `[N, w]` (not over `[B, max L]`), then the Eq. 13 merge of each row's blocks. Pure torch, float32
    math; same arguments and bottom-right causal mask as `varlen_attention` (no tree masks).
    Returns out `[total_q, H, D_v]` in q's dtype."""
    import torch

    total_q, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[2]
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    q_lens_t = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [B]
    k_lens_t = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()  # [B]
    B, dev = q_lens_t.numel(), q.device
    plan = plan or plan_decomposition(k_lens_t.tolist())
    out = torch.zeros(total_q, H, D_v, dtype=q.dtype, device=dev)
    if plan.num_blocks == 0 or total_q == 0:
        return out
    w, Q = plan.block_width, max(int(max_seqlen_q), 1)
    row = torch.tensor(plan.block_row, device=dev)  # [N]
    start = torch.tensor(plan.block_start, device=dev)  # [N]
    length = torch.tensor(plan.block_length, device=dev)  # [N]
    j, i = torch.arange(w, device=dev), torch.arange(Q, device=dev)
    key_pos = start[:, None] + j  # [N, w] key index within the row
    key_valid = j[None, :] < length[:, None]  # [N, w]
    key_idx = (cu_seqlens_k[row].long()[:, None] + key_pos).clamp(max=max(k.shape[0] - 1, 0))
    q_valid = i[None, :] < q_lens_t[row][:, None]  # [N, Q]
    q_idx = (cu_seqlens_q[row].long()[:, None] + i).clamp(max=total_q - 1)
    group = H // H_kv
    Qb = q[q_idx].float()  # [N, Q, H, D]
    Kb = k[key_idx].float().repeat_interleave(group, dim=2)  # [N, w, H, D]
    Vb = v[key_idx].float().repeat_interleave(group, dim=2)  # [N, w, H, D_v]
    scores = torch.einsum("nqhd,nkhd->nhqk", Qb, Kb) * scale  # [N, H, Q, w]
    allowed = key_valid[:, None, None, :] & q_valid[:, None, :, None]
    if causal:
        prefix = (k_lens_t - q_lens_t)[row]  # [N]
        allowed = allowed & (key_pos[:, None, None, :] <= prefix[:, None, None, None] + i[None, None, :, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [N, H, Q] per-block log-sum-exp
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    partial = torch.einsum("nhqk,nkhd->nhqd", torch.exp(scores - lse_safe[..., None]), Vb)  # [N, H, Q, D_v]
    # Eq. 13: O_b = sum_{n in b} e^{lse_n - lse_b} O_n,  lse_b = ln sum_{n in b} e^{lse_n}
    index = row[:, None, None].expand_as(lse)
    row_max = torch.full((B, H, Q), float("-inf"), device=dev).scatter_reduce(0, index, lse, "amax")
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weight = torch.exp(lse - row_max[row])  # [N, H, Q], 0 for blocks a query does not see
    denom = torch.zeros(B, H, Q, device=dev).index_add(0, row, weight)
    merged = torch.zeros(B, H, Q, D_v, device=dev).index_add(0, row, weight[..., None] * partial)
    merged = merged / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    rows_valid = i[None, :] < q_lens_t[:, None]  # [B, Q]
    out[:] = merged.permute(0, 2, 1, 3)[rows_valid].to(q.dtype)  # rows in order: the packed layout
    return out
