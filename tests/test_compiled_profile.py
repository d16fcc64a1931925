"""The cost profile on the static compiled layout: each model measured through the compiled fixed-shape forward
the engine runs (`forward_static` on a StaticRowCache, at the engine's query widths), cached apart from its eager
costs, its graphs warmed for the engine. Compiled with backend "eager" (dynamo alone) as tests/test_static_engine.py
does; no timing is asserted (an injected clock, or the source of a profile).
"""

from __future__ import annotations

import pytest
import torch

import hf_spin
from benchmarks.injected_costs import table
from hf_spin.cache.static_forward import StaticOptions, run_static, run_static_draft
from hf_spin.planning import grid
from hf_spin.planning.profiling import build_profile, forward_kind, model_key, static_forwards

from .speculation import pool as spin_pool
from .test_static_engine import INDUCTOR, _case, _models, graphs

pytestmark = pytest.mark.usefixtures("one_thread")

COMPILED = StaticOptions(True, backend="eager")


@pytest.fixture
def static_calls(monkeypatch):
    """Every `forward_static` of the profile's grid as (model, forward, [R, T] query slots), run for real."""
    calls = []
    real = grid.forward_static

    def recording(model, cache, chunks, forward, width):
        calls.append((model, forward, (cache.num_slots, width)))
        return real(model, cache, chunks, forward, width)

    monkeypatch.setattr(grid, "forward_static", recording)
    return calls


@torch.no_grad()
def test_the_compiled_profile_times_the_compiled_static_forward(static_calls, fresh_dynamo, monkeypatch):
    """Each grid point runs the compiled forward at the engine's query width (N = 8 in 9 slots), once untimed
    (compiling) and then twice timed: on a clock that only static forwards move, at t(slots) = 0.1 s a slot, the
    warm-ups count in the budget (the grid stops after its first three points) and never in a point's seconds.
    The per-row point runs eagerly: no graph for a row bucket a batch-1 call never meets."""
    target = _models("llama")[0]
    clock, slot_cost = [0.0], table(lambda n: 0.1 * n)
    real = grid.forward_static

    def charged(model, cache, chunks, forward, width):
        clock[0] += slot_cost.predict(cache.num_slots * width, cache.num_slots)
        return real(model, cache, chunks, forward, width)

    monkeypatch.setattr(grid, "forward_static", charged)
    cost = grid.measure(target, 3.0, clock=lambda: clock[0], static=static_forwards(target, COMPILED, False))
    assert cost.knots == [1, 2, 8]
    assert cost.seconds == pytest.approx([0.1, 0.2, 0.9])  # query slots 1, 2 and 9
    assert cost.per_row == pytest.approx(0.0)
    compiled = COMPILED.forward_for(target)
    assert compiled is not run_static and {forward for _, forward, _ in static_calls} == {compiled}
    shapes = [shape for _, _, shape in static_calls]
    assert shapes == [(1, 1)] * 6 + [(1, 9)] * 3 + [(1, 2)] * 3  # warm-up point, grid; the rows' point eager
    assert graphs(run_static) == fresh_dynamo["stats"]["unique_graphs"] == 3  # one per (rows, slots), warmed


def test_compiled_and_eager_costs_are_cached_apart(static_calls, tmp_path, monkeypatch, fresh_dynamo):
    """The key says how the forwards run: a compiled profile is measured (through forward_static), never read
    from the eager one of the same model, and both stay cached. A drafter compiles only its draft chunks
    (1-2 tokens); wider points run `run_static` eagerly, as its catch-ups do."""
    monkeypatch.setenv("HF_SPIN_PROFILES", str(tmp_path))
    target, drafter = _models("llama")
    assert model_key(target)["forward"] == "eager"
    assert model_key(target, forward=forward_kind(target, COMPILED))["forward"] == "static-compiled:eager"
    assert forward_kind(target, StaticOptions("auto")) == "eager"  # "auto" compiles on CUDA only

    eager = build_profile(target, [drafter, None], ["drafter", "prompt_lookup"])
    assert eager.source == "measured" and not static_calls
    compiled = build_profile(target, [drafter, None], ["drafter", "prompt_lookup"], static=COMPILED)
    assert compiled.source == "measured" and static_calls
    # the drafter, the target's perturbed copy, shares its eager cost; compiled, its role is a key of its own
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert forward_kind(drafter, COMPILED, drafter=True) == "static-compiled:eager:drafter"
    draft_forward = COMPILED.forward_for(drafter, run_static_draft)
    assert {model for model, _, _ in static_calls} == {target, drafter}
    for model, forward, (_, width) in static_calls:
        if model is target:
            assert forward is COMPILED.forward_for(target)
        else:
            assert forward is (draft_forward if width <= 2 else run_static), width

    measured = len(static_calls)
    for static in (None, COMPILED):
        again = build_profile(target, [drafter, None], ["drafter", "prompt_lookup"], static=static)
        assert again.source == "cached"
    # a drafter keeping its eager caches on the static layout (fuzzy, streaming) is priced eagerly
    fuzzy = build_profile(target, [drafter], ["fuzzy"], static=COMPILED, static_drafters=[False])
    assert fuzzy.source == "cached" and fuzzy.drafters[0].seconds == eager.drafters[0].seconds
    assert len(static_calls) == measured  # read from disk: nothing run
    assert again.target.seconds == compiled.target.seconds != eager.target.seconds


@pytest.mark.filterwarnings("ignore:hf_spin. plain")  # a tiny drafter costs what the tiny target does
@pytest.mark.parametrize("backend", ("eager", INDUCTOR))
@pytest.mark.parametrize("batch", (1, 4))
def test_a_compiled_pool_profiled_auto_keeps_greedy_output(batch, backend, tmp_path, monkeypatch, fresh_dynamo):
    """profile="auto" on the static compiled layout: the profile compiles through the forwards the engine then
    runs (one compiled callable, shared), and the output is plain generate's, whatever the measured costs make
    the planner draft. The target's grid runs at the engine's widths (N = 2 and 4 in its 5 query slots; one
    slot): two graphs (the per-row point runs eagerly), and at batch 1 the run meets no other shape (the
    drafter's 1 and 2 warmed too), so generate compiles nothing."""
    monkeypatch.setenv("HF_SPIN_PROFILES", str(tmp_path))
    target, other = _models("llama")
    inputs, reference = _case("llama", batch)
    options = StaticOptions(True, backend=backend, query_slots=5)
    pool = spin_pool([other, "prompt_lookup"], tree=False, cache="static", compile=options, profile="auto")
    pool.bind(target)
    assert pool.cost_profile.source == "measured" and pool.cost_profile.target.knots == [1, 2, 4]
    assert graphs(run_static) == 2 and graphs(run_static_draft) >= 2
    warmed = fresh_dynamo["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=batch == 1):
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert batch > 1 or fresh_dynamo["stats"]["unique_graphs"] == warmed
