"""A model drafter on the static layout (`AssistantPool(cache="static")`): it drafts through its own
`StaticRowCache` and the fixed-shape forward, compiled with the pool's `compile`. Greedy output equals plain
`generate`, its drafts equal the same drafter's on its dynamic cache (so a wrong rollback or logits slot,
which stays lossless, still fails), its compiled forward has no graph break and compiles once per width,
and a drafter the static path cannot take drafts eagerly instead.
"""

import functools

import pytest
import torch

import hf_spin
from hf_spin.cache.static import StaticRowCache
from hf_spin.cache.static_forward import StaticOptions, run_static_draft
from hf_spin.drafters import ModelDrafter
from hf_spin.drafters.model import COMPILED_CHUNK

from .speculation import DRAFT_TOKENS, assert_speculated, greedy_case, perturbed
from .speculation import pool as spin_pool
from .test_equivalence import _models
from .test_static_engine import MAX_NEW_TOKENS, PROMPT_LENGTH, graphs

ARCHS = ("llama", "qwen2")
EAGER_DYNAMO = dict(compile=True, backend="eager", query_slots=DRAFT_TOKENS + 1)  # dynamo alone (test_static_engine)

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    return greedy_case(_models(arch)[0], batch, PROMPT_LENGTH, MAX_NEW_TOKENS)


def record(monkeypatch) -> tuple[list, list]:
    """(the caches model drafters run `forward_static` on, the tokens of every draft), as the call goes."""
    from hf_spin.drafters import model

    caches, drafts = [], []
    forward, draft = model.forward_static, ModelDrafter.draft
    monkeypatch.setattr(model, "forward_static", lambda m, cache, *a: caches.append(cache) or forward(m, cache, *a))
    monkeypatch.setattr(ModelDrafter, "draft", lambda self, request: drafts.append(draft(self, request)) or drafts[-1])
    return caches, drafts


def drafted(arch: str, batch: int, cache: str, tree=False, **options) -> None:
    """A greedy call drafting with the arch's model drafter on `cache`: equal to plain generate's, with speculation."""
    target, other = _models(arch)
    inputs, reference = _case(arch, batch)
    static = dict(compile=StaticOptions(**{"compile": False, **options})) if cache == "static" else {}
    pool = spin_pool([other], tree=tree, cache=cache, **static)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)


@pytest.mark.parametrize("tree", (False, "auto"), ids=("chains", "trees"))
@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("arch", ARCHS)
def test_static_drafter_is_lossless_and_drafts_as_on_its_dynamic_cache(
    arch, batch, compiled, tree, monkeypatch, fresh_dynamo
):
    """Greedy output equals plain generate's; every draft forward ran on a StaticRowCache, and the drafter
    drafted exactly what it drafts on the rectangular cache (same k, same greedy drafts, step by step): chains,
    and token trees grown depth by depth (tree_expansion.py), node for node."""
    caches, drafts = record(monkeypatch)
    drafted(arch, batch, "static", tree, **(EAGER_DYNAMO if compiled else {}))
    assert caches and all(isinstance(c, StaticRowCache) for c in caches)
    static = [(d.tokens, _nodes(d)) for d in drafts]
    drafts.clear()
    drafted(arch, batch, "rectangular", tree)
    assert static == [(d.tokens, _nodes(d)) for d in drafts]
    assert any(t for _, nodes in static for t in nodes or ()) == bool(tree)  # trees grew where asked
    assert (graphs(run_static_draft) > 0) == compiled


def _nodes(draft) -> list | None:
    """A draft's trees as (parent, token) lists, None where it drafted chains."""
    return None if draft.trees is None else [t and list(zip(t.parents, t.tokens)) for t in draft.trees]


def test_compiled_drafter_compiles_once_per_width_and_never_again(fresh_dynamo):
    """One graph per query width the drafter runs compiled (1: a draft token; 2: the catch-up after a whole
    draft was accepted) at one row-slot bucket, whatever the lengths and rollbacks; a second call compiles
    nothing (fullgraph: a graph break would have raised)."""
    drafted("llama", 4, "static", **EAGER_DYNAMO)
    assert 1 <= graphs(run_static_draft) <= COMPILED_CHUNK
    compiled = fresh_dynamo["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        drafted("llama", 4, "static", **EAGER_DYNAMO)
    assert fresh_dynamo["stats"]["unique_graphs"] == compiled


def test_compiled_tree_drafting_compiles_a_few_widths_and_never_again(fresh_dynamo):
    """Growing trees, the drafter's frontier forwards (and catch-ups no longer than them) run compiled over a
    sticky query width: besides the chain's widths, one graph per width the trees reached (query buckets up
    to width x k + k), and a second call compiles nothing."""
    drafted("llama", 4, "static", "auto", **EAGER_DYNAMO)
    assert COMPILED_CHUNK < graphs(run_static_draft) <= COMPILED_CHUNK + 4  # 3, 5, 9, 17: k = DRAFT_TOKENS
    compiled = fresh_dynamo["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        drafted("llama", 4, "static", "auto", **EAGER_DYNAMO)
    assert fresh_dynamo["stats"]["unique_graphs"] == compiled


def test_a_drafter_the_static_path_cannot_take_drafts_eagerly(monkeypatch):
    """A sliding-window drafter (refused by check_static_support) on a static-layout pool keeps its dynamic
    cache and eager forwards, without an error; the target still verifies on the static layout."""
    target = _models("llama")[0]
    windowed = ModelDrafter(perturbed("mistral", sliding_window=6))
    windowed.static = StaticOptions()
    assert windowed._static_run() is None
    caches, _ = record(monkeypatch)
    inputs, reference = _case("llama", 4)
    pool = spin_pool([windowed], tree=False, cache="static", compile=False)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference) and not caches
    assert_speculated(pool.last_stats, accepted=False, rejected=False)


def test_the_drafters_capacity_follows_the_targets():
    """The drafter's StaticRowCache takes the capacity of the target's (sized for the rows' length limit), so
    its rows growing past a capacity bucket reallocate and recompile nothing mid-call."""
    from hf_spin.cache.static import CAPACITY_BUCKET
    from hf_spin.drafters import DraftRequest

    target, other = _models("llama")
    target_cache = StaticRowCache()
    target_cache.add_empty_rows(2)
    target_cache.reserve(2 * CAPACITY_BUCKET)
    drafter = ModelDrafter(other)
    drafter.static = StaticOptions()
    sequences = [[5, 6, 7], [8, 9]]
    drafter.start(target, sequences, target_cache=target_cache)
    drafter.draft(DraftRequest(rows=[0, 1], sequences=sequences, k=[2, 2], do_sample=False, score=None))
    assert drafter.cache.capacity == target_cache.capacity == 2 * CAPACITY_BUCKET


@pytest.mark.parametrize("layout", ("static", "packed"))
def test_a_self_speculating_streaming_drafter_drafts_on_its_own_cache(layout, monkeypatch):
    """A streaming drafter (its own caches and forwards) is handed the target's static or packed cache at
    start: it starts unseeded, drafts on its own StreamingCache and never fails (it read a rectangular
    cache's lengths off any cache it was given, and was dropped)."""
    from hf_spin.drafters.streaming import StreamingDrafter

    target = _models("llama")[0]
    caches, _ = record(monkeypatch)
    inputs, reference = _case("llama", 4)
    pool = spin_pool([StreamingDrafter(target, sink_tokens=2, window_tokens=8)], tree=False, cache=layout)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference) and not caches
    assert_speculated(pool.last_stats, rejected=False)
