"""A model drafter's token trees (hf_spin/drafters/tree_expansion.py), against plain forwards of the
drafter: every node's children are the drafter's likeliest tokens after the node's path, each weighs its
path probability, the cache afterwards drafts as a fresh drafter does, and width 1 is the chain; on the
drafter's rectangular cache and on its static one (`AssistantPool(cache="static")`)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_spin.cache import RectangularCache
from hf_spin.cache.static import StaticRowCache
from hf_spin.cache.static_forward import StaticOptions
from hf_spin.drafters import DraftRequest, ModelDrafter
from hf_spin.verify.token_tree import TokenTree

from .archs import tiny_model

STATIC_ARCHS = ("llama", "qwen2")  # models the static layout takes (full attention, explicit positions)
LAYOUTS = ("rectangular", "static")


def _drafter(arch: str, width: int, sequences: list[list[int]], layout: str = "rectangular") -> ModelDrafter:
    drafter = ModelDrafter(tiny_model(arch, seed=3), tree_width=width)
    if layout == "static":
        drafter.static = StaticOptions()  # as the engine sets it on the static layout (eager forwards)
    drafter.start(drafter.model, sequences)  # the drafter as its own target: the same vocabulary
    assert isinstance(drafter.cache, StaticRowCache if layout == "static" else RectangularCache)
    return drafter


def _cases(archs=("llama", "qwen2", "gpt2", "phi3")) -> list:
    return [(a, "rectangular") for a in archs] + [(a, "static") for a in STATIC_ARCHS if a in archs]


def _request(sequences, rows, k, trees=True, min_confidence=0.0) -> DraftRequest:
    return DraftRequest(rows, sequences, k, False, None, min_confidence, None, trees)


@torch.no_grad()
def _next_logp(model, ids: list[int]) -> torch.Tensor:
    """[V] log-probabilities of the token after `ids`, from a plain forward without a cache."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


SEQUENCES = [[5, 9, 14, 3, 77, 41, 9, 14], [60, 61, 8, 9], [30, 31, 32, 33, 34, 35]]


@pytest.mark.parametrize("arch, layout", _cases())
def test_children_are_the_drafters_likeliest_tokens_after_their_path(arch, layout, monkeypatch):
    """Rows of different lengths and depths, one of them not served, the whole grown tree (not cut):
    each node with children has the drafter's `width` likeliest next tokens, in order, weighing their
    path probability; the chain follows the heaviest child down; trees branch and reach their row's k.
    Then cut: the width * k heaviest nodes, holding the chain's first nodes."""
    width, rows, ks = 3, [0, 2], [4, 2]
    with monkeypatch.context() as m:
        m.setattr(TokenTree, "pruned", lambda self, n, by=None: self)
        draft = _drafter(arch, width, SEQUENCES, layout).draft(_request(SEQUENCES, rows, ks))
    model = tiny_model(arch, seed=3)
    for row, k, tree, chain in zip(rows, ks, draft.trees, draft.tokens):
        assert max(tree.depths()) == k
        for node in [-1] + list(range(len(tree))):
            kids = tree.children(node)
            if not kids:
                continue
            prefix = SEQUENCES[row] + [tree.tokens[n] for n in tree.path(node)]
            logp = _next_logp(model, prefix)
            top = logp.topk(width)
            assert [tree.tokens[c] for c in kids] == top.indices.tolist(), (row, node)
            before = math.exp(sum(logp_at(model, SEQUENCES[row], tree, n) for n in tree.path(node)))
            for c, lp in zip(kids, top.values.tolist()):
                assert tree.weights[c] == pytest.approx(before * math.exp(lp), rel=1e-4)
        assert any(len(tree.children(n)) >= 2 for n in tree.children(-1))
        heaviest, node = [], -1
        while kids := tree.children(node):
            node = max(kids, key=lambda c: tree.weights[c])
            heaviest.append(tree.tokens[node])
        assert chain == heaviest and 1 <= len(chain) <= k
    cut = _drafter(arch, width, SEQUENCES, layout).draft(_request(SEQUENCES, rows, ks))
    for k, tree, chain in zip(ks, cut.trees, cut.tokens):
        assert len(tree) == width * k and tree.tokens[0] == chain[0]


def logp_at(model, sequence, tree, node) -> float:
    """log q of `node`'s token after its parent's path."""
    prefix = sequence + [tree.tokens[n] for n in tree.path(node)[:-1]]
    return float(_next_logp(model, prefix)[tree.tokens[node]])


@pytest.mark.parametrize("arch, layout", _cases(("llama", "gpt2")))
def test_after_a_tree_the_drafter_drafts_as_a_fresh_one(arch, layout):
    """The cache keeps only the heaviest path's KV: a next step (some of the path accepted, a new token
    after it) drafts the same chain as a drafter that never grew a tree. On the static cache the kept path
    is what it holds after its committed tokens (`cached`), which the next catch-up builds on."""
    drafter = _drafter(arch, 3, SEQUENCES, layout)
    draft = drafter.draft(_request(SEQUENCES, [0, 1, 2], [4, 3, 2]))
    if layout == "static":
        assert drafter.cache.lengths == [len(c) for c in drafter.cached]
        assert any(len(c) > len(s) for c, s in zip(drafter.cached, SEQUENCES))  # some path's KV kept
    later = [
        s + c[:a] + [50 + a] for s, c, a in zip(SEQUENCES, draft.tokens, (2, 0, 1))
    ]  # accepted 2 / 0 / 1, then a new token
    again = drafter.draft(_request(later, [0, 1, 2], [3, 3, 3], trees=False))
    fresh = _drafter(arch, 1, later).draft(_request(later, [0, 1, 2], [3, 3, 3], trees=False))
    assert again.tokens == fresh.tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_width_one_grows_the_chain_and_stops_where_the_chain_does(layout):
    """The expansion at width 1 (a drafter at width 1 drafts chains itself: called directly here)."""
    from hf_spin.drafters.tree_expansion import grow_trees

    rows, ks = [0, 1, 2], [5, 3, 5]
    for confidence in (0.0, 0.05):
        request = _request(SEQUENCES, rows, ks, min_confidence=confidence)
        chain = _drafter("llama", 1, SEQUENCES, layout).draft(
            _request(SEQUENCES, rows, ks, trees=False, min_confidence=confidence)
        )
        drafter = _drafter("llama", 1, SEQUENCES, layout)
        grown = grow_trees(drafter, request, *drafter._catch_up(rows, SEQUENCES))
        assert grown.tokens == chain.tokens and [t.tokens for t in grown.trees] == chain.tokens
        assert drafter.cached == [s + c[:-1] for s, c in zip(SEQUENCES, chain.tokens)]  # the chain's fed tokens
        if layout == "static":  # the rows that stopped early were fed their path again: the cache holds it
            assert drafter.cache.lengths == [len(c) for c in drafter.cached]
    assert any(len(c) < k for c, k in zip(chain.tokens, ks)), "the confidence stop never stopped a chain"


def test_only_drafters_that_can_grow_trees_do():
    """Packed caches, fuzzy or sparse forwards, other vocabularies and slot-biased models draft chains."""
    for layout in LAYOUTS:
        assert _drafter("llama", 3, SEQUENCES, layout).grows_trees()
    on_device = _drafter("llama", 3, SEQUENCES, "static")
    on_device.read_each_draft_token = False  # an accelerator's default: a chain's draft loop reads once
    assert not on_device.grows_trees()
    drafter = _drafter("llama", 3, SEQUENCES)
    drafter.tree_width = 1
    assert not drafter.grows_trees()
    packed = ModelDrafter(tiny_model("llama"), tree_width=3)
    packed.cache_layout = "packed"
    packed.start(packed.model, SEQUENCES)
    assert not packed.grows_trees()
    draft = packed.draft(_request(SEQUENCES, [0], [3]))
    assert draft.trees is None and len(draft.tokens[0]) == 3
    with pytest.raises(ValueError, match="tree_width must be at least 1, got 0"):
        ModelDrafter(tiny_model("llama"), tree_width=0)
