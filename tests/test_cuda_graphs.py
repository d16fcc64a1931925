"""The static layout's forwards captured as CUDA graphs without torch.compile (`StaticOptions(backend="cuda_graphs")`,
cache/cuda_graphs.py), tested without a GPU: the capture is replaced by `baked_capture`, which holds a graph to what a
CUDA graph holds it to. A graph replays kernels over the addresses it was captured with, so:

- the eager forward must read nothing on the host (a capture fails on a host read or a blocking copy): counted by
  the instrumented sync counter inside every capture;
- every tensor the forward reads that it did not make must be the one it read at capture time (same storage): the
  replay runs the forward again under a dispatch mode that records those storages and fails on any difference.

Also: greedy output equals plain `generate` through captured forwards; the target's and the drafters' storage is
kept between calls (`take_cache`), so a second call replays the first call's graphs; a model that cannot be
captured runs eagerly, said once. On a GPU, tests/test_static_engine.py runs the real capture (CUDA only).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_spin
from hf_spin.cache import capture, cuda_graphs, static, static_forward
from hf_spin.cache.cuda_graphs import GraphedForward, storage_key
from hf_spin.cache.static import StaticRowCache, give_back, take_cache
from hf_spin.cache.static_forward import CUDA_GRAPHS, StaticOptions, run_static, run_static_draft, split_backend
from hf_spin.host_syncs import count_syncs

from .archs import tiny_model
from .speculation import assert_speculated, greedy_case, perturbed
from .speculation import pool as spin_pool

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 20
PROMPT_LENGTH = 14
ARCHS = ("llama", "qwen2", "gemma")


class _Reads(TorchDispatchMode):
    """The storages a block reads that it did not make (weights, caches, input buffers), by address."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().data_ptr() not in self.made:
                self.read.add(t.untyped_storage().data_ptr())
        self.made.update(t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def baked_capture(run, device, pool=None):
    """`capture.capture_graph` on a CPU: runs `run` once (no host read allowed, as in a capture) and returns a
    replay that runs it again, failing where it reads other storage than at capture."""
    with count_syncs("instrumented") as syncs, _Reads() as captured:
        out = run()
    assert syncs.count == 0, f"a CUDA graph capture would fail: host syncs at {syncs.sites.most_common(4)}"

    def replay():
        with _Reads() as now:
            fresh = run()
        assert now.read == captured.read, "a replayed graph would read storage other than the one it captured"
        out.copy_(fresh)

    return replay, out, pool


def traced_capture(run, device, pool=None):
    """`capture_graph` on a CPU, the other half of what a CUDA graph holds a forward to: the aten ops one
    run records (`make_fx`), replayed without running any Python (forward hooks, host state), over the tensors the
    run read (kept alive here, unlike a graph's addresses: `baked_capture` checks those)."""
    run()
    recorded = make_fx(run, tracing_mode="real")()
    out = recorded()

    def replay():
        out.copy_(recorded())

    return replay, out, pool


@pytest.fixture
def graphed(monkeypatch):
    """The cuda_graphs backend on a CPU: `baked_capture` for the capture, fresh graph sets for the test, and
    StaticOptions compiling wherever compile is on. Yields the captures counter (run_static's, run_static_draft's)."""
    monkeypatch.setattr(cuda_graphs, "capture_graph", baked_capture)
    monkeypatch.setattr(static_forward, "shared_graphed", functools.cache(GraphedForward))
    monkeypatch.setattr(StaticOptions, "compiles", lambda self, model, drafter=False: self.compile is True)
    yield lambda: tuple(static_forward.shared_graphed(f).captures for f in (run_static, run_static_draft))


def _pool(entry):
    options = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=5)
    return spin_pool([entry], tree=False, cache="static", compile=options)


@functools.lru_cache(maxsize=None)
def _models(arch: str):
    return tiny_model(arch), perturbed(arch)


@pytest.mark.parametrize("drafter", ("model", "prompt_lookup"))
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_forwards_give_plain_generates_output(graphed, arch, drafter):
    target, other = _models(arch)
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    pool = _pool(other if drafter == "model" else "prompt_lookup")
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    target_graphs, draft_graphs = graphed()
    assert 1 <= target_graphs <= 2  # the one-token decode and the verification's k + 1 slots
    assert (draft_graphs >= 1) == (drafter == "model")


def test_a_drafters_token_trees_through_captured_forwards_give_plain_generates_output(graphed):
    """A model drafter growing token trees on the static layout (tree_expansion._StaticFeed): its frontier forwards,
    tree layouts written in place, replay from graphs of its sticky widths beside the chain's, and greedy output
    is plain `generate`'s."""
    from hf_spin.drafters.model import COMPILED_CHUNK

    target, other = _models("llama")
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    options = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=5)
    pool = spin_pool([other], tree="auto", cache="static", compile=options)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    assert graphed()[1] > COMPILED_CHUNK  # a tree's widths captured beside a draft token's and a catch-up's


@pytest.mark.parametrize("batch", (1, 4))
def test_plain_steps_run_ahead_through_captured_forwards(graphed, batch):
    """Run-ahead (on by default where CUDA graphs capture the forwards): a plain step feeds its verdict's tokens to
    the next one-token forward, replayed from the plain step's graph before the host reads them; drafting steps
    take the forward run ahead as their first position. Greedy output is plain `generate`'s; no graph beyond
    the plain step's and the verification's is captured."""
    from hf_spin.step import engine

    target = _models("llama")[0]
    inputs, reference = greedy_case(target, batch, PROMPT_LENGTH, MAX_NEW_TOKENS)
    options = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=5, run_ahead=True)
    pool = spin_pool(["prompt_lookup"], tree=False, cache="static", compile=options)
    launched = []
    launch = engine.SpinEngine._launch_ahead
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine.SpinEngine, "_launch_ahead", lambda self, t: launched.append(1) or launch(self, t))
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    assert launched, "no forward ran ahead"
    assert graphed()[0] <= 2  # the one-slot graph (plain steps and the forwards run ahead) and k + 1 slots


def test_a_second_call_replays_the_first_calls_graphs(graphed):
    """The target's and the drafter's storage is given back at the end of a call and taken by the next one of the
    same row-slot bucket (`take_cache`): nothing is captured again, and the replays read only what they captured."""
    target, other = _models("llama")
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    pool = _pool(other)
    target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    first = graphed()
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert graphed() == first, f"captured again: {first} -> {graphed()}"


def test_new_storage_of_the_same_shapes_is_captured_again(graphed):
    """Batch 4, then 1 (another row-slot bucket: a new cache, kept instead), then 4 again: a new cache of the first
    call's shapes at other addresses; replaying the first call's graphs there would read freed storage."""
    target = _models("llama")[0]
    pool = _pool("prompt_lookup")
    for batch in (4, 1, 4):
        inputs, reference = greedy_case(target, batch, PROMPT_LENGTH, MAX_NEW_TOKENS)
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out, reference)


def test_the_storage_key_follows_reallocation_only():
    cache = StaticRowCache()
    cache.add_empty_rows(2)
    cache.reserve(8)
    for layer in range(2):
        cache.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), layer)
    cache.advance([3, 3])
    ids = torch.zeros(2, 5, dtype=torch.long)
    cache.use_layout(5, {})
    key = storage_key(cache, ids, torch.float32)
    cache.advance([2, 1])
    cache.rollback([4, 3])
    cache.use_layout(5, {0: ([0, 1, 1], torch.ones(3, 3, dtype=torch.bool))})  # a tree, written in place
    cache.select_rows([1])
    assert storage_key(cache, ids, torch.float32) == key
    cache.reserve(cache.capacity + 1)  # the storage grows: a new allocation
    cache.use_layout(5, {})
    assert storage_key(cache, ids, torch.float32) != key


class _Model(torch.nn.Module):
    device = torch.device("cpu")


def test_a_cache_is_taken_back_only_for_its_row_slot_bucket():
    model = _Model()
    cache = take_cache(model, 3)
    cache.add_empty_rows(3)
    cache.width = 5
    give_back(model, cache)
    assert take_cache(model, 2) is not cache  # 2 rows: 2 slots, not 4; the spare is dropped
    again = take_cache(model, 4)
    assert again is not cache
    again.add_empty_rows(4)
    give_back(model, again)
    kept = take_cache(model, 3)
    assert kept is again and kept.slot_of == [] and kept.width == 0 and kept.num_slots == 4


def test_a_model_that_cannot_be_captured_runs_eagerly_said_once(graphed, monkeypatch):
    def failing(run, device, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "capture_graph", failing)
    target = _models("llama")[0]
    inputs, reference = greedy_case(target, 1, PROMPT_LENGTH, MAX_NEW_TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=_pool("prompt_lookup"))
    assert torch.equal(out, reference)
    said = [w for w in caught if "cannot be captured" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]


def test_compiled_forwards_captured_by_hf_spin_give_plain_generates_output(graphed, monkeypatch, fresh_dynamo):
    """`backend="<compiler>+cuda_graphs"` (inductor's on a GPU; dynamo alone here): the forward torch.compile made,
    captured by `GraphedForward` as the eager one is (on CUDA; the stand-in capture here), so plain steps run ahead
    by default. The target's and a model drafter's forwards are captured, greedy output is plain `generate`'s, and
    dynamo traces the target's forward once per query width. The stand-in capture runs the forward again at each
    replay, without `baked_capture`'s dispatch modes (under which dynamo compiles nothing)."""
    from .test_static_engine import graphs

    def rerun_capture(run, device, pool=None):
        out = run()
        return (lambda: out.copy_(run())), out, pool

    monkeypatch.setattr(cuda_graphs, "capture_graph", rerun_capture)
    monkeypatch.setattr(  # as on CUDA
        StaticOptions, "captures", lambda self, model, drafter=False: split_backend(self.backend_for(drafter))[1]
    )
    options = StaticOptions(True, backend="eager+" + CUDA_GRAPHS, query_slots=5, run_ahead=True)
    target, other = _models("llama")
    target_forward, draft_forward = options.forward_for(target), options.forward_for(other, run_static_draft)
    assert target_forward is static_forward.shared_graphed(static_forward.shared_compiled(run_static, "eager", None))
    assert draft_forward.forward is static_forward.shared_compiled(run_static_draft, "eager", None)
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    pool = spin_pool([other], tree=False, cache="static", compile=options)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    assert 1 <= target_forward.captures <= 2 and draft_forward.captures >= 1
    assert 1 <= graphs(run_static) <= 2
    assert StaticOptions(True, backend=static_forward.INDUCTOR_GRAPHS).backend == "inductor+cuda_graphs"
    for wrong in ("inductor+trees", "+cuda_graphs"):
        with pytest.raises(ValueError, match="is not supported; give a torch.compile backend"):
            StaticOptions(True, backend=wrong)


def test_cuda_graphs_run_eagerly_off_cuda():
    target = _models("llama")[0]
    options = StaticOptions(True, backend=CUDA_GRAPHS)
    assert not options.compiles(target)
    assert options.forward_for(target) is run_static


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("batch", (1, 4))
def test_real_captures_give_plain_generates_output_and_replay_across_calls(batch):
    target = tiny_model("llama").cuda()
    inputs, reference = greedy_case(target, batch, PROMPT_LENGTH, MAX_NEW_TOKENS)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    graphed = static_forward.shared_graphed(run_static)
    pool = _pool("prompt_lookup")
    for call in range(2):
        before = graphed.captures
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out.cpu(), reference)
        assert (graphed.captures > before) == (call == 0), (call, before, graphed.captures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_real_inductor_forwards_captured_by_hf_spin_give_plain_generates_output():
    """`backend="inductor+cuda_graphs"` on a GPU: inductor's kernels replayed from hf_spin's graphs, for the target
    and a model drafter; greedy output is plain `generate`'s."""
    options = StaticOptions(True, backend=static_forward.INDUCTOR_GRAPHS, query_slots=5)
    target, other = tiny_model("llama").cuda(), perturbed("llama").cuda()
    target_forward, draft_forward = options.forward_for(target), options.forward_for(other, run_static_draft)
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    pool = spin_pool([other], tree=False, cache="static", compile=options)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out.cpu(), reference)
    assert_speculated(pool.last_stats)
    assert target_forward.captures >= 1 and draft_forward.captures >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_real_captures_of_a_drafters_token_trees_give_plain_generates_output(monkeypatch):
    from hf_spin.drafters import ModelDrafter

    monkeypatch.setattr(ModelDrafter, "read_each_draft_token", True)  # trees on an accelerator: a read a depth
    target, other = tiny_model("llama").cuda(), perturbed("llama").cuda()  # fresh: `_models` keeps its on the CPU
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    options = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=5)
    pool = spin_pool([other], tree="auto", cache="static", compile=options)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out.cpu(), reference)
    assert_speculated(pool.last_stats)


def test_model_drafters_run_under_their_own_backend():
    """`draft_backend`: the target's forwards under one backend (CUDA graphs: eager off CUDA), a model drafter's
    under another (dynamo here, inductor on a GPU: a small drafter's captured kernels are bound by their count);
    each measured under its own kind of forward, and greedy output stays plain `generate`'s."""
    from hf_spin.planning.profiling import forward_kind

    options = StaticOptions(True, backend=CUDA_GRAPHS, draft_backend="eager", query_slots=5)
    target, other = _models("llama")
    assert not options.compiles(target) and options.compiles(other, drafter=True)
    assert options.forward_for(target) is run_static
    drafting = options.forward_for(other, run_static_draft)
    assert drafting is static_forward.shared_compiled(run_static_draft, "eager", None)
    assert (forward_kind(target, options), forward_kind(other, options, True)) == (
        "eager",
        "static-compiled:eager:drafter",
    )
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    pool = spin_pool([other], tree=False, cache="static", compile=options)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert_speculated(pool.last_stats)
    with pytest.raises(ValueError, match="draft_backend=3"):
        StaticOptions(True, draft_backend=3)


@pytest.fixture
def captured_moves(monkeypatch):
    """`keep_paths`' KV moves from a graph off CUDA: `baked_capture` for the capture. Yields every GraphedMoves made."""
    made = []

    class Recorded(capture.GraphedMoves):
        def __init__(self, move):
            super().__init__(move)
            made.append(self)

    monkeypatch.setattr(capture, "capture_graph", baked_capture)
    monkeypatch.setattr(static, "captures_moves", lambda device: True)
    monkeypatch.setattr(static, "GraphedMoves", Recorded)
    yield made


def _filled_cache(rows: int, capacity: int, device: str = "cpu", layers: int = 3) -> StaticRowCache:
    """A StaticRowCache of `rows` slots holding random KV at every position, each row `capacity - 8` tokens long."""
    cache = StaticRowCache(device)
    cache.add_empty_rows(rows)
    cache.capacity = capacity
    g = torch.Generator().manual_seed(rows)
    for _ in range(layers):
        layer = static._StaticLayer()
        like = torch.empty(1, 2, 1, 4, device=device)
        layer.allocate(rows, capacity, like, like)
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=g))
        layer.values.copy_(torch.randn(layer.values.shape, generator=g))
        cache.layers.append(layer)
    cache.host_lengths = [capacity - 8] * rows
    return cache


def _kept_paths_match_eager_moves(device: str) -> list[int]:
    """keep_paths over four steps of three rows, from graphs and eagerly on `device`: the KV and lengths alike.
    Returns the captures after the steps and after a reallocation and one more step."""
    steps = [  # (bases, paths): moves of 3, 1 (and a row that keeps its base), 4, 3
        ([4, 6, 5], [[1, 3], [0], [0, 2]]),
        ([9, 8, 7], [[], [0, 2], [0, 1]]),
        ([3, 2, 1], [[2, 5], [1, 4], [0]]),
        ([5, 5, 5], [[0, 2], [1], [1]]),
    ]
    graphed, eager = _filled_cache(3, 24, device), _filled_cache(3, 24, device)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(static, "captures_moves", lambda device: False)
        for bases, paths in steps:
            eager.keep_paths(bases, paths)
    for bases, paths in steps:
        graphed.keep_paths(bases, paths)
    for mine, theirs in zip(graphed.layers, eager.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert graphed.host_lengths == eager.host_lengths
    captures = [graphed._moves.captures]
    graphed.reserve(32)  # a reallocation: new storage, the same move counts
    graphed.keep_paths(*steps[0])
    return captures + [graphed._moves.captures]


def test_kept_paths_move_the_same_kv_from_a_captured_graph(captured_moves):
    """keep_paths with its moves replayed from a graph (padded to a power of two by repeating the first move) leaves
    every layer's KV as the eager moves do; one capture per move count and storage, none at a step of a count seen
    before, a new one after a reallocation (a replay there would write freed storage)."""
    assert _kept_paths_match_eager_moves("cpu") == [2, 3]  # 4 moves (4, 4 again) and 1 (the second step's); again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_kept_paths_move_the_same_kv_from_a_real_graph():
    assert _kept_paths_match_eager_moves("cuda") == [2, 3]


def test_token_trees_through_captured_forwards_and_moves_give_plain_generates_output(graphed, captured_moves):
    """A vote tree of two drafters and prompt lookup on the static layout, the forwards and keep_paths' moves both
    replayed from (stand-in) graphs: greedy output is plain `generate`'s, and the accepted paths moved KV."""
    from .test_token_trees import CASE
    from .test_token_trees import _pool as tree_pool

    target = _models("llama")[0]
    inputs, reference = greedy_case(target, 4, *CASE["vote"])
    pool = tree_pool("llama", "vote", cache="static")
    pool.static = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=5)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    assert graphed()[0] >= 2 and sum(m.captures for m in captured_moves) >= 1
