"""Step 5 with token trees: every row's tree verified in one target forward, each tree
walked (tree_verification.py), the accepted path kept in the target's cache (docs/design.md, "token tree").

A step verifies trees where the pool's `tree` allows them and its rows can take them (`usable`):
packed rows (the kernel's tree masks), or a rectangular or static cache under a model that takes 4D masks, no
sliding-window, chunked or slot-biased layers (a tree's tokens are not at consecutive slots; the static layout
runs the tree in its fixed-shape forward's query slots, `StaticTarget.tree`). Processors that
read token ids score each slot after its own path; a seeded row walks its tree greedily over log p plus its noise
at each slot's position (Gumbel-max). A chain row in a tree step is a tree with one child per node, so such a step
has one way to verify every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache import PackedCache, RowCache, forward_tree, needs_contiguous_slots, takes_4d_masks
from ..host_syncs import to_device
from ..verify.chains import gumbel_noise
from ..verify.token_tree import TokenTree
from ..verify.trees import decide, walk_greedy, walk_sampling
from .faults import Faults
from .processors import GenerateBatch, ids_free, target_scores
from .rows import Row


def capability(model) -> tuple[bool, bool]:
    """(trees on packed rows, trees on a rectangular or static cache): what the model allows (module docstring),
    read once per engine: reading a config's attributes costs microseconds a step."""
    slots_free = not needs_contiguous_slots(model.config)
    return slots_free, slots_free and takes_4d_masks(model)


def usable(tree, capability: tuple[bool, bool], cache: RowCache | None) -> bool:
    """Whether this step may verify trees (module docstring): the pool's `tree` setting, the model's
    `capability` and the target's cache."""
    return tree is not False and capability[0 if isinstance(cache, PackedCache) else 1]


@dataclass
class TargetStep:
    """What a tree verification reads and touches: the active rows (a row that fails is failed in
    place, `Row.fail`), the target, its cache (the trees appended, then each row's accepted path kept),
    the fault policy of the forward and of each row's scoring, the `generate` batch when every row
    belongs to it (the processors' whole-batch fast path), else None, and the static layout's verification
    forward (`StaticTarget`) where the target's cache is a `StaticRowCache`."""

    rows: list[Row]
    model: Any
    cache: RowCache
    faults: Faults
    batch: GenerateBatch | None
    static: Any = None


def verify(target: TargetStep, trees: list[TokenTree]) -> tuple[list[list[int]], list[int], torch.Tensor] | None:
    """One forward over [last committed token] + tree per row; returns (accepted path per row, next
    token per row, processed scores `[B, 1 + N_max, V]`), the target's cache holding the root and the
    accepted path of every row; None when every row failed in the forward."""
    rows = target.rows
    bases = [len(r.sequence) - 1 for r in rows]  # tokens in the target's cache: all committed but the last
    chunks = [[r.sequence[-1]] + tree.tokens for r, tree in zip(rows, trees)]

    def forward(fed: list[list[int]]) -> torch.Tensor:
        roots = [c[0] if c else None for c in fed]
        run = target.static.tree if target.static is not None else forward_tree
        return run(target.model, target.cache, roots, trees).to(dtype=torch.float32)

    logits = target.faults.target_forward(target.cache, rows, forward, chunks)  # [B, 1 + N_max, V]
    if logits is None:
        return None
    reads_ids = any(len(r.request.processors) and not ids_free(r.request.processors) for r in rows)
    before = (
        [[[]] + [[tree.tokens[n] for n in tree.path(i)] for i in range(len(tree))] for tree in trees]
        if reads_ids
        else None
    )  # [B] draft tokens before each slot
    scores = target_scores(rows, target.batch, logits, [t.tokens for t in trees], target.faults.row, before)
    sampled = [b for b, r in enumerate(rows) if r.request.do_sample and r.request.seed is None and not r.done]
    parts = [_argmax(rows, trees, scores).reshape(-1)]  # [B * T] every slot's argmax (perturbed for seeded rows)
    for b in sampled:
        n = len(trees[b]) + 1
        coins, fallback = decide(torch.softmax(scores[b, :n], dim=-1), trees[b])
        parts += [coins.long(), fallback]
    host = torch.cat(parts).tolist()  # the step's one read of the device
    T = scores.shape[1]
    best, at = [host[b * T : (b + 1) * T] for b in range(len(rows))], len(rows) * T
    paths, next_tokens = [], []
    for b, (row, tree) in enumerate(zip(rows, trees)):
        if b in sampled:
            c = len(tree.order)
            verdict = walk_sampling([bool(x) for x in host[at : at + c]], host[at + c : at + c + len(tree) + 1], tree)
            at += c + len(tree) + 1
        else:
            verdict = walk_greedy(best[b], tree)
        paths.append([] if row.done else verdict.path)
        next_tokens.append(verdict.next_token)
    target.cache.keep_paths(bases, paths)
    return paths, next_tokens, scores


def _argmax(rows, trees: list[TokenTree], scores: torch.Tensor) -> torch.Tensor:
    """`[B, T]` each slot's argmax; a seeded row's of log p plus its Gumbel noise at the slot's position
    (verification.verify_seeded): slots at one depth share a position, hence a noise row, so the row's
    tokens stay a function of its seed alone, tree or chain."""
    best = scores.argmax(dim=-1)
    for b, row in enumerate(rows):
        if row.request.do_sample and row.request.seed is not None and not row.done:
            depths = [0] + trees[b].depths()  # [n] slot -> position after the row's last committed token
            noise = gumbel_noise(
                row.request.seed, len(row.generated), max(depths) + 1, scores.shape[-1], scores.device
            )  # [D + 1, V]
            at = to_device(depths, noise.device, torch.long)  # [n] (a list index would wait on CUDA)
            perturbed = torch.log_softmax(scores[b, : len(depths)], dim=-1) + noise.index_select(0, at)  # [n, V]
            best[b, : len(depths)] = perturbed.argmax(dim=-1)
    return best


def path_scores(scores: torch.Tensor, paths: list[list[int]]) -> list[torch.Tensor]:
    """[B] each row's scores at the slots it committed from, `[len(path) + 1, V]`: the root, then each accepted
    node, of scores `[B, T, V]`. A path down first children is a slice; the others' slots cross in one
    asynchronous copy (a Python list as an index would be a blocking copy on CUDA, one a row)."""
    slots = [[0] + [node + 1 for node in path] for path in paths]  # [B] [len + 1]
    if all(s == list(range(len(s))) for s in slots):
        return [scores[b, : len(s)] for b, s in enumerate(slots)]
    flat = to_device([b * scores.shape[1] + i for b, s in enumerate(slots) for i in s], scores.device, torch.long)
    return list(scores.flatten(0, 1).index_select(0, flat).split([len(s) for s in slots]))
