"""Verification: which draft tokens the target accepts, and the one token it adds.

Notation (docs/design.md, glossary): p = target distribution, q = draft distribution, k = draft length.
Row b brings `k[b]` draft tokens x_1..x_k; the target scored k + 1 positions (after the last
accepted token and after each draft). Each row gets `accepted[b]` in 0..k[b] and one `next_token`:
the *recovered* token after a rejection, or the *bonus* token when every draft was accepted.

Greedy: x_j is accepted while x_j == argmax p_j; the next token is argmax p_a.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept x_j with probability min(1, p_j(x_j) / q_j(x_j)),
stop at the first rejection and draw the recovered token from norm(max(0, p_j - q_j)); with all
accepted draw the bonus token from p_k. The output then has exactly distribution p whatever q is.
A drafter that gives no q (prompt lookup, token translation) made a deterministic proposal given
the prefix: q_j is one-hot at x_j, so the test reads "accept with probability p_j(x_j)" and the
recovered token comes from p_j with x_j removed. Summing over x shows the result is still p:
P(y) = q(y) p(y) + sum_{x != y} q(x) (1 - p(x)) p(y) / (1 - p(x)) = p(y) for any proposal q.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..host_syncs import to_device


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] long, number of draft tokens accepted per row
    next_token: torch.Tensor  # [B] long, recovered or bonus token per row


def _draft_mask(draft_lengths: torch.Tensor, K: int) -> torch.Tensor:
    """[B, K] True where slot j < k[b] holds a real draft token."""
    return torch.arange(K, device=draft_lengths.device)[None, :] < draft_lengths[:, None]


def _first_rejection(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool "draft j accepted" -> [B] length of the all-True prefix."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_scores: torch.Tensor, drafts: torch.Tensor, draft_lengths: torch.Tensor) -> Verdict:
    """Greedy verification.

    target_scores: [B, K + 1, V] processed target scores at each position.
    drafts: [B, K] draft tokens (slots past `draft_lengths[b]` are ignored).
    draft_lengths: [B] number of real drafts per row.

    Example: target argmax [[5, 7, 9]] and drafts [[5, 8]] -> accepted [1], next_token [7].
    """
    K = drafts.shape[1]
    target_tokens = target_scores.argmax(dim=-1)  # [B, K + 1]
    ok = (drafts == target_tokens[:, :K]) & _draft_mask(draft_lengths, K)  # [B, K]
    accepted = _first_rejection(ok)  # [B]
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return Verdict(accepted, next_token)


def verify_sampling(
    p: torch.Tensor,
    drafts: torch.Tensor,
    draft_lengths: torch.Tensor,
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Rejection sampling that keeps the target distribution exactly.

    p: [B, K + 1, V] target probabilities (after logits processors and softmax).
    drafts: [B, K] draft tokens; draft_lengths: [B].
    q: [B, K, V] draft probabilities, or None for deterministic proposals (one-hot at the draft);
       rows of q that are all zero are read as one-hot too (a batch mixing both kinds).
    """
    B, K = drafts.shape
    valid = _draft_mask(draft_lengths, K)  # [B, K]
    p_draft = p[:, :K].gather(2, drafts[:, :, None]).squeeze(2)  # [B, K] p_j(x_j)
    one_hot = torch.zeros_like(p[:, :K]).scatter_(2, drafts[:, :, None], 1.0)  # [B, K, V]
    if q is None:
        q = one_hot
    else:
        deterministic = q.sum(dim=-1, keepdim=True) == 0  # [B, K, 1]
        q = torch.where(deterministic, one_hot, q)
    q_draft = q.gather(2, drafts[:, :, None]).squeeze(2)  # [B, K] q_j(x_j)
    r = torch.rand(B, K, device=p.device, generator=generator)  # [B, K] uniform draws
    # r < p/q written without division; q_draft > 0 for any token q proposed.
    ok = (r * q_draft < p_draft) & valid  # [B, K]
    accepted = _first_rejection(ok)  # [B]

    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]  # [B, V] target distribution at the first unaccepted position
    rejected = accepted < draft_lengths  # [B] False where every draft was accepted (bonus token)
    q_next = q[rows, accepted.clamp(max=K - 1)] if K > 0 else torch.zeros_like(p_next)  # [B, V]
    residual = (p_next - q_next).clamp(min=0)  # [B, V]
    # A residual that is all zero happens only when p == q at that position, where rejection has
    # probability zero; guard against rounding by falling back to p.
    residual_ok = residual.sum(dim=-1, keepdim=True) > 0
    dist = torch.where(rejected[:, None] & residual_ok, residual, p_next)  # [B, V]
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(1)  # [B]
    return Verdict(accepted, next_token)


def gumbel_noise(seed: int, first_position: int, n: int, V: int, device=None) -> torch.Tensor:
    """[n, V] standard Gumbel noise for positions first_position .. first_position + n - 1 of a row,
    each position's noise fixed by (seed, position) alone, drawn on `device` (default: the CPU) by a
    generator there: no host work or copy per token. The noise depends on the device type too (CUDA's
    generator is not the CPU's), so a seed gives the same tokens on every run on the same kind of device."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    out = torch.empty(n, V, device=device)
    for i in range(n):
        key = hashlib.blake2b(f"{seed}:{first_position + i}".encode(), digest_size=8).digest()
        g = torch.Generator(device=device).manual_seed(int.from_bytes(key, "little") >> 1)
        u = torch.rand(V, generator=g, device=device).clamp_(min=torch.finfo(torch.float32).tiny)
        out[i] = -torch.log(-torch.log(u))
    return out


def verify_seeded(
    target_scores: torch.Tensor, drafts: torch.Tensor, draft_lengths: torch.Tensor, noise: torch.Tensor
) -> Verdict:
    """Sampling by the Gumbel-max trick with noise fixed per position: the token at a position is
    argmax(log p + g), which is distributed as p (g iid Gumbel), so the sequence has the target's
    distribution. Verification is greedy on the perturbed scores: a draft is accepted iff it is that
    token, and the next token is that token at the first mismatch. The tokens are a function of the
    noise alone, so a seeded request yields the same tokens whatever was drafted and whoever shared
    its batch.

    target_scores: [B, K + 1, V] processed scores; noise: [B, K + 1, V] (gumbel_noise per row);
    drafts: [B, K]; draft_lengths: [B].
    """
    return verify_greedy(torch.log_softmax(target_scores, dim=-1) + noise, drafts, draft_lengths)


class RowSampling(NamedTuple):
    """How one row's tokens are chosen: greedy, sampled from torch's RNG, or seeded Gumbel-max."""

    do_sample: bool
    seed: int | None  # seeded rows: noise fixed by (seed, position)
    position: int  # tokens the row generated so far: the position of its next token


def verify_rows(
    rows: list[int],
    sampling: list[RowSampling],
    scores: torch.Tensor,
    drafts: list[list[int]],
    qs: list[torch.Tensor | None],
) -> Verdict:
    """Verdicts for batch rows `rows` of a mixed batch: greedy rows by argmax, sampled rows by rejection
    sampling, seeded rows by Gumbel-max with their own noise.

    sampling: [B] per batch row; scores: [B, K + 1, V] processed target scores; drafts: [B] draft
    token lists (k_b <= K); qs: [B] q [k_b, V] of a model drafter when sampling, else None (one-hot).
    Returns accepted / next_token for `rows`, in their order ([B] when `rows` is every row).
    """
    B, K = scores.shape[0], scores.shape[1] - 1
    greedy = [b for b in rows if not sampling[b].do_sample]
    shared = [b for b in rows if sampling[b].do_sample and sampling[b].seed is None]
    seeded = [b for b in rows if sampling[b].do_sample and sampling[b].seed is not None]
    everyone = rows == list(range(B))
    if everyone and len(greedy) == B and K == 0:  # a plain step: `generate`'s argmax, no draft tensors to build
        next_token = scores[:, 0].argmax(dim=-1)  # [B]
        return Verdict(torch.zeros_like(next_token), next_token)
    device = scores.device
    draft_lengths = to_device([len(d) for d in drafts], device, torch.long)  # [B]
    draft_tokens = to_device([d + [0] * (K - len(d)) for d in drafts], device, torch.long).view(B, K)  # [B, K]
    if everyone and len(greedy) == B:
        return verify_greedy(scores, draft_tokens, draft_lengths)
    if everyone and len(shared) == B:
        return _sample(scores, draft_tokens, draft_lengths, qs, drafts)
    accepted = torch.zeros(B, dtype=torch.long, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    for group, kind in ((greedy, "greedy"), (shared, "sampled"), (seeded, "seeded")):
        if not group:
            continue
        idx = to_device(group, device, torch.long)
        if kind == "greedy":
            v = verify_greedy(scores[idx], draft_tokens[idx], draft_lengths[idx])
        elif kind == "sampled":
            v = _sample(
                scores[idx], draft_tokens[idx], draft_lengths[idx], [qs[b] for b in group], [drafts[b] for b in group]
            )
        else:
            noise = torch.zeros(len(group), *scores.shape[1:], device=device)  # [b, K + 1, V]
            for i, b in enumerate(group):  # positions past a row's drafts are never read
                noise[i, : len(drafts[b]) + 1] = gumbel_noise(
                    sampling[b].seed, sampling[b].position, len(drafts[b]) + 1, scores.shape[-1], device
                )
            v = verify_seeded(scores[idx], draft_tokens[idx], draft_lengths[idx], noise)
        accepted[idx], next_token[idx] = v.accepted, v.next_token
    if everyone:
        return Verdict(accepted, next_token)
    picked = to_device(rows, device, torch.long)
    return Verdict(accepted[picked], next_token[picked])


def _sample(scores, draft_tokens, draft_lengths, qs, drafts) -> Verdict:
    """Rejection sampling of rows whose scores are [b, K + 1, V], q stacked from the rows' own."""
    K = draft_tokens.shape[1]
    p = torch.softmax(scores, dim=-1)  # [b, K + 1, V]
    q = _stack_q(qs, drafts, K, p) if any(x is not None for x in qs) else None
    return verify_sampling(p, draft_tokens, draft_lengths, q)


def _stack_q(qs: list[torch.Tensor | None], drafts: list[list[int]], K: int, p: torch.Tensor) -> torch.Tensor:
    """Per-row q [k_b, V] (or None: deterministic proposal) -> [B, K, V], zero rows meaning one-hot."""
    q = torch.zeros(p.shape[0], K, p.shape[2], dtype=p.dtype, device=p.device)
    for b, qb in enumerate(qs):
        if qb is not None and len(drafts[b]):
            q[b, : len(drafts[b])] = qb[: len(drafts[b])].to(device=p.device, dtype=p.dtype)
    return q
