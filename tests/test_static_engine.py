"""The static cache layout in the engine (`AssistantPool(cache="static", compile=...)`): greedy output equals plain
`generate` (float32), batch 1 and 4 with ragged prompts, a model drafter and prompt lookup, chains and token
trees (trees across architectures: tests/test_token_trees.py); rows leave the batch as they stop (freed slots)
and models the layout cannot run are refused.
"""

import contextlib
import functools
import os
import warnings

import pytest
import torch

import hf_spin
from hf_spin.cache.static_forward import StaticOptions
from hf_spin.drafters import ModelDrafter
from hf_spin.planning.plan import StepFeedback
from hf_spin.policies.lengths import HeuristicLength, HeuristicLengthConfig
from hf_spin.stats import DrafterStats
from hf_spin.step.engine import SpinEngine

from .archs import ARCHS as ALL_ARCHS
from .archs import tiny_model
from .speculation import DRAFT_TOKENS, assert_speculated, greedy_case, perturbed
from .speculation import pool as spin_pool

MAX_NEW_TOKENS = 24
PROMPT_LENGTH = 14  # ragged rows at batch 4: 14, 12, 10, 8 real tokens
ARCHS = {"llama": {}, "qwen2": {}, "gemma": {}, "mistral": dict(sliding_window=None)}
UNTRACEABLE = {"ctrl"}  # torch 2.13's dynamo breaks on its positional encoding: eager, with a warning

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, perturbed drafter) of one architecture."""
    return tiny_model(arch, seed=0, **ARCHS[arch]), perturbed(arch, **ARCHS[arch])


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    return greedy_case(_models(arch)[0], batch, PROMPT_LENGTH, MAX_NEW_TOKENS)


def assert_static_lossless(target, entry, inputs: dict, reference: torch.Tensor, **options) -> hf_spin.AssistantPool:
    """Output of a static-layout pool drafting with `entry` equals plain generate's, with speculation."""
    pool = spin_pool([entry], tree=False, cache="static", compile=StaticOptions(**{"compile": False, **options}))
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    return pool


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("drafter", ("model", "prompt_lookup"))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_equals_plain_generate(arch, drafter, batch):
    target, other = _models(arch)
    entry = other if drafter == "model" else "prompt_lookup"
    assert_static_lossless(target, entry, *_case(arch, batch))


def test_the_target_runs_on_a_static_cache(monkeypatch):
    """The engine's verification goes through forward_static (not a silent fallback to the rectangular cache)."""
    from hf_spin.cache import static_forward

    calls = []
    real = static_forward.forward_static
    monkeypatch.setattr(static_forward, "forward_static", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    target, other = _models("llama")
    assert_static_lossless(target, other, *_case("llama", 4))
    assert calls and all(type(c).__name__ == "StaticRowCache" for c in calls)


def test_layouts_and_models_it_cannot_run_are_refused():
    with pytest.raises(ValueError, match="conflict"):
        spin_pool(["prompt_lookup"], cache="static", ragged_attention=True)
    with pytest.raises(ValueError, match="needs cache='static'"):
        spin_pool(["prompt_lookup"], compile=True)
    with pytest.raises(ValueError, match="compile="):
        spin_pool(["prompt_lookup"], cache="static", compile="always")
    with pytest.raises(ValueError, match="query_slots="):
        StaticOptions(query_slots=0)
    assert spin_pool(["prompt_lookup"], cache="static").static == StaticOptions("auto")
    model = tiny_model("mistral", sliding_window=6)
    pool = spin_pool(["prompt_lookup"], cache="static")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="full attention only"):
        model.generate(input_ids=ids, max_new_tokens=4, custom_generate=hf_spin.generate, assistant_pool=pool)


# -- compiled ---------------------------------------------------------------------------------------------
# The "eager" backend runs dynamo alone: a graph break fails fullgraph=True and a recompilation fails
# error_on_recompile exactly as with inductor, without its code generation (a minute and more on a CPU).
# HF_SPIN_SLOW_TESTS=1 runs the inductor case too.


@torch.no_grad()
def test_the_compiled_forward_has_no_graph_break_and_no_recompilation(fresh_dynamo):
    """One graph for a run where lengths, acceptance and the rows present change (rollbacks, a row
    leaving, one joining its slot), logits equal to the eager forward's."""
    from hf_spin.cache import RectangularCache, forward_ragged
    from hf_spin.cache.static import StaticRowCache
    from hf_spin.cache.static_forward import compile_static, forward_static

    model = tiny_model("llama")
    caches = []
    for _ in range(2):  # eager, compiled
        ragged = RectangularCache(torch.zeros(3, 0, dtype=torch.bool))
        forward_ragged(model, ragged, [[5, 6, 7, 8], [9, 10], [11, 12, 13]])
        caches.append(StaticRowCache())
        caches[-1].append_rows(ragged)
    joining = RectangularCache(torch.zeros(1, 0, dtype=torch.bool))
    forward_ragged(model, joining, [[40, 41, 42]])
    compiled = compile_static(backend="eager")
    steps = [([[20, 21, 22], [23], [24, 25]], [6, 3, 5]), ([[30], [31, 32, 33], [34]], [7, 5, 6])]
    steps += [("leave", [0, 2]), ("join", joining), ([[50, 51], [52], [53, 54, 55]], [9, 7, 6])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for chunks, keep in steps:
            for cache in caches:
                if chunks == "leave":
                    cache.select_rows(keep)
                elif chunks == "join":
                    cache.append_rows(keep)
            if isinstance(chunks, str):
                continue
            eager = forward_static(model, caches[0], chunks)
            torch.testing.assert_close(forward_static(model, caches[1], chunks, forward=compiled), eager)
            for cache in caches:
                cache.rollback(keep)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


def graphs(forward) -> int:
    """Graphs dynamo holds for `forward`'s code object (`run_static`: the target's; `run_static_draft`: drafters')."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(forward.__code__))


INDUCTOR = pytest.param(
    "inductor",
    marks=pytest.mark.skipif(not os.environ.get("HF_SPIN_SLOW_TESTS"), reason="inductor compiles for minutes on a CPU"),
)


@pytest.mark.parametrize("backend", ("eager", INDUCTOR))
@pytest.mark.parametrize("drafter", ("model", "prompt_lookup"))
def test_compiled_verification_keeps_greedy_output_without_recompiling(drafter, backend, fresh_dynamo):
    """The first call compiles one graph per query width it meets (the target: k + 1, and 1 after a step
    that drafted nothing; a model drafter: 1 and 2), whatever the lengths and acceptance; a second call
    compiles nothing."""
    from hf_spin.cache.static_forward import run_static, run_static_draft
    from hf_spin.drafters.model import COMPILED_CHUNK

    target, other = _models("llama")
    entry = other if drafter == "model" else "prompt_lookup"
    options = dict(compile=True, backend=backend, query_slots=DRAFT_TOKENS + 1)
    assert_static_lossless(target, entry, *_case("llama", 4), **options)
    compiled = fresh_dynamo["stats"]["unique_graphs"]
    assert 1 <= graphs(run_static) <= 2
    assert (1 <= graphs(run_static_draft) <= COMPILED_CHUNK) if drafter == "model" else not graphs(run_static_draft)
    with torch._dynamo.config.patch(error_on_recompile=True):
        pool = assert_static_lossless(target, entry, *_case("llama", 4), **options)
    assert fresh_dynamo["stats"]["unique_graphs"] == compiled, str(pool.last_stats)


def test_a_step_that_compiles_a_graph_is_marked_cold(fresh_dynamo, monkeypatch):
    """A step whose forwards (the target's or a model drafter's) ran a compiled graph at a shape and storage for
    the first time tells the planner so (`StepFeedback.cold`: its seconds are set-up, not a price); the first call
    compiles, and its steps that did are cold; a second call over the same storage compiles nothing and has none."""
    from hf_spin.cache.static_forward import FIRST_RUNS
    from hf_spin.step import engine

    told = []
    monkeypatch.setattr(engine, "StepFeedback", lambda **kw: told.append(kw["cold"]) or StepFeedback(**kw))
    FIRST_RUNS.seen.clear()  # dynamo forgot its graphs (fresh_dynamo): so does the record of first runs
    target, other = _models("llama")
    options = dict(compile=True, backend="eager", query_slots=DRAFT_TOKENS + 1)
    assert_static_lossless(target, other, *_case("llama", 1), **options)
    first = FIRST_RUNS.count
    assert 1 <= sum(told) <= len(told) - 1, told  # the first runs' steps; steps after them are timed
    told.clear()
    assert_static_lossless(target, other, *_case("llama", 1), **options)
    assert FIRST_RUNS.count == first and not any(told), told


@pytest.mark.parametrize("kind", ["lookup", "vote"])
def test_compiled_token_trees_keep_greedy_output_without_recompiling(kind, fresh_dynamo):
    """Token trees on the static layout (prompt lookup's continuations; a vote of two drafters and prompt
    lookup, merged): greedy output is plain `generate`'s, trees branch, and the target runs one graph per query
    width it meets, chains and trees alike; a second call compiles nothing."""
    import hf_spin.step.tree_step as tree_step
    from hf_spin.cache.static_forward import run_static

    from .test_token_trees import CASE, _pool

    target = _models("llama")[0]
    inputs, reference = greedy_case(target, 4, *CASE[kind])
    seen, real, compiled = [], tree_step.verify, 0
    options = StaticOptions(compile=True, backend="eager", query_slots=DRAFT_TOKENS + 1)
    for call in range(2):
        pool = _pool("llama", kind, cache="static")
        pool.static = options
        with pytest.MonkeyPatch.context() as m, torch._dynamo.config.patch(error_on_recompile=call == 1):
            m.setattr(tree_step, "verify", lambda step, trees: seen.extend(trees) or real(step, trees))
            out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out, reference), f"\n{out}\n{reference}"
        assert_speculated(pool.last_stats)
        compiled = compiled or graphs(run_static)  # after the first call
    assert any(len(t.children(n)) >= 2 for t in seen for n in range(-1, len(t))), "no tree branched"
    assert graphs(run_static) == compiled and 1 <= compiled <= 3  # widths 1, k + 1 and one tree bucket at most


@pytest.mark.parametrize("arch", sorted(ALL_ARCHS))
def test_every_architecture_compiles_exactly_or_is_refused_with_the_reason(arch, fresh_dynamo):
    """Across the tiny architectures: compiled (dynamo alone), prompt lookup's chains and trees give plain
    `generate`'s output; a model dynamo cannot trace whole runs eagerly with a warning; one the static layout
    cannot run exactly is refused with the reason and the layouts that can."""
    from hf_spin.cache.static_forward import check_static_support

    target = tiny_model(arch)
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, 16)
    options = StaticOptions(compile=True, backend="eager", query_slots=DRAFT_TOKENS + 1)
    pool = spin_pool(["prompt_lookup"], cache="static", compile=options)
    try:
        check_static_support(target)
    except ValueError as e:
        assert "cache" in str(e) and arch in str(e), e
        with pytest.raises(ValueError, match=arch):
            target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    eager = [str(w.message) for w in caught if "cannot trace" in str(w.message)]
    assert bool(eager) == (arch in UNTRACEABLE), eager


def test_a_step_that_drafts_nothing_is_the_one_token_decode(monkeypatch):
    """The plain step on the static layout is the fixed-shape forward with one query slot (its own graph
    under compile), not the verification's k + 1 slots; a step with drafts keeps the sticky k + 1."""
    from hf_spin.cache import static_forward

    widths = []
    real = static_forward.forward_static
    monkeypatch.setattr(static_forward, "forward_static", lambda *a: widths.append(a[4]) or real(*a))
    target = _models("llama")[0]
    assert_static_lossless(target, "prompt_lookup", *_case("llama", 1), query_slots=DRAFT_TOKENS + 1)
    assert set(widths) == {1, DRAFT_TOKENS + 1}, widths


def test_compile_auto_is_on_for_cuda_only():
    from hf_spin.cache.static_forward import StaticTarget

    target = _models("llama")[0]
    assert not StaticTarget(target, StaticOptions("auto")).compiled
    assert StaticTarget(target, StaticOptions(True, backend="eager")).compiled


def test_rows_joining_a_running_batch_take_free_slots_and_stay_exact(fresh_dynamo):
    """Continuous batching on the static layout: rows join at different steps (free slots, then more row
    slots) and stop at different steps; each row's tokens equal plain generate on its prompt alone."""
    from hf_spin.cache.static_forward import run_static, run_static_draft
    from hf_spin.drafters.model import COMPILED_CHUNK

    from .test_engine import alone, prompts, request, run

    target, other = _models("llama")
    pool = spin_pool([other, "prompt_lookup"], policy="round_robin", tree=False, cache="static")
    pool.static = StaticOptions(compile=True, backend="eager", query_slots=DRAFT_TOKENS + 1)
    engine = SpinEngine(target, pool)
    shapes, compiled = set(), engine.static.forward  # [R, T] of the target's forwards
    engine.static.forward = lambda model, cache, ids, dtype: shapes.add(ids.shape) or compiled(model, cache, ids, dtype)
    ps, lengths = prompts(6), [20, 7, 16, 1, 12, 18]
    schedule = {0: [request(ps[0], 20), request(ps[1], 7)], 3: [request(ps[2], 16)]}
    schedule.update({4: [request(ps[3], 1), request(ps[4], 12)], 9: [request(ps[5], 18)]})
    rows = run(engine, schedule)
    for row, p, n in zip(rows, ps, lengths):
        assert row.generated == alone(target, p, n), f"row {row.id}"
    assert_speculated(DrafterStats.total(engine.drafter_stats.values()))
    slots = {R for R, _ in shapes}
    assert graphs(run_static) == len(shapes) and len(slots) > 1  # one graph per (row-slot bucket, width) met
    assert 1 <= graphs(run_static_draft) <= COMPILED_CHUNK * len(slots)  # the model drafter's: widths 1 and 2


def test_generate_honours_cache_implementation_static(monkeypatch):
    """`generate(..., cache_implementation="static")` with a rectangular pool verifies on the static layout
    (not refused, not silently rectangular), greedy output still plain generate's; a packed pool is refused."""
    from hf_spin.cache import static_forward

    calls = []
    real = static_forward.forward_static
    monkeypatch.setattr(static_forward, "forward_static", lambda *a, **k: calls.append(1) or real(*a, **k))
    target, other = _models("llama")
    inputs, reference = _case("llama", 4)
    pool = spin_pool([other], tree=False)
    out = target.generate(
        **inputs, custom_generate=hf_spin.generate, assistant_pool=pool, cache_implementation="static"
    )
    assert torch.equal(out, reference) and calls
    assert_speculated(pool.last_stats)
    packed = spin_pool(["prompt_lookup"], cache="packed")
    with pytest.raises(ValueError, match="two layouts"):
        target.generate(
            **inputs, custom_generate=hf_spin.generate, assistant_pool=packed, cache_implementation="static"
        )


@pytest.mark.parametrize("per_call", [True, False], ids=["per-call limit", "process-wide limit"])
def test_a_compiled_static_forward_holds_more_graphs_than_dynamos_default(fresh_dynamo, per_call):
    """A graph per (row-slot bucket, width): a growing server batch passes dynamo's default of 8, which
    fullgraph=True would turn into an error. A torch.compile with no per-call limit (2.11) gets the
    process-wide one raised."""
    from hf_spin.cache import static_forward
    from hf_spin.cache.static_forward import RECOMPILE_LIMIT, compile_static

    if per_call != static_forward._PER_CALL_LIMIT:  # each torch takes one of the two paths
        pytest.skip(f"this torch's torch.compile {'takes no' if per_call else 'takes a'} per-call recompile_limit")
    # the process-wide limit at dynamo's default, restored afterwards (its config's own patch)
    with contextlib.nullcontext() if per_call else torch._dynamo.config.patch(recompile_limit=8):
        double = compile_static(lambda x: x * 2, backend="eager")
        for n in range(1, 13):
            torch.testing.assert_close(double(torch.ones(n)), torch.full((n,), 2.0))
    assert fresh_dynamo["stats"]["unique_graphs"] == 12 < RECOMPILE_LIMIT


CUT = 0.014  # a min_confidence a little over uniform (1 / 96): it cuts some of the perturbed drafters' drafts


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("arch", ("llama", "gemma"))
def test_the_draft_loop_on_the_device_proposes_what_the_host_loop_does(arch, batch, compiled, monkeypatch):
    """`read_each_draft_token=False` (an accelerator's default): every row drafts the longest k on the device
    and is cut after one read, at its own k and after its first token below min_confidence. Output equals
    plain generate's, and each drafter drafts and gets accepted exactly what the host loop's early stops give,
    with k per row (transformers' heuristic) and confidence stops that cut drafts."""
    target, other = _models(arch)
    inputs, reference = _case(arch, batch)
    counts = {}
    for reads, confidence in ((True, CUT), (False, CUT), (False, 0.0)):
        monkeypatch.setattr(ModelDrafter, "read_each_draft_token", reads)
        pool = spin_pool(
            [other],
            tree=False,
            cache="static",
            compile=StaticOptions(compiled, "eager"),
            draft_length=HeuristicLength(HeuristicLengthConfig(min_confidence=confidence)),
        )
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out, reference), f"\n{out}\n{reference}"
        counts[reads, confidence] = [(s.drafted, s.accepted) for s in pool.last_stats.drafters.values()]
    assert_speculated(pool.last_stats)  # uncut: k per row from transformers' heuristic, up to 8 here
    assert counts[True, CUT] == counts[False, CUT]
    assert counts[False, CUT][0][0] < counts[False, 0.0][0][0], f"no draft cut by its confidence: {counts}"
