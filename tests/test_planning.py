"""The cost profile and the planner, on injected costs: no real timing anywhere.

A `CostClock` stands in for the engine's clock: every forward of a model advances it by that
model's injected cost (t(N) of the positions it ran), nothing else does. So the engine times what
the injected costs say, the profile's online refinement sees them, and a run's clock total is what
the run would take on a machine with those costs. Each case checks the planner's decision and that
the output is still plain `generate`'s.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

import hf_spin
from benchmarks.injected_costs import STRUCTURES, CostClock, profile_of, table
from hf_spin.drafters import Draft, Drafter
from hf_spin.planning.acceptance import EVIDENCE_ONLY, LEVEL_WEIGHT, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, Acceptance
from hf_spin.planning.cost_profile import DRAFTING, PLAIN, UNMEASURED_PREMIUM, CostProfile, ForwardCost
from hf_spin.planning.estimates import acceptance_with_prior
from hf_spin.planning.grid import measure
from hf_spin.planning.planner import Planner, plan_k
from hf_spin.planning.profiling import build_profile, complete
from hf_spin.planning.row_lengths import RowLengths
from hf_spin.verify.token_tree import TokenTree

from .archs import EOS, VOCAB, tiny_encoder_decoder, tiny_model
from .speculation import perturbed


def linear(n):  # an AVX2 CPU in bf16: 8 tokens cost ~6 plain steps
    return 0.1 * (0.3 + 0.7 * n)


def flat(n):  # a GPU or an AMX CPU: up to 64 tokens cost one step
    return 0.1


class Scripted(Drafter):
    """A model-free drafter that knows plain `generate`'s output and proposes it, each token right
    with its row's probability (`acceptance` by the row's position in `references`), else wrong:
    drafts with a known per-position acceptance, whatever the tiny model."""

    kind = "scripted"

    def __init__(self, references: list[list[int]], acceptance: list[float], seed: int = 0):
        self.references, self.acceptance = references, acceptance
        self.rng = random.Random(seed)
        self.name = "scripted"

    def draft(self, request):
        tokens = []
        for row, k in zip(request.rows, request.k):
            seq = request.sequences[row]
            i = next(i for i, ref in enumerate(self.references) if ref[: len(seq)] == seq)
            truth = self.references[i][len(seq) : len(seq) + k]
            tokens.append([t if self.rng.random() < self.acceptance[i] else (t + 1) % VOCAB or 3 for t in truth])
        return Draft(tokens=tokens, q=[None] * len(tokens))


def case(batch: int, new_tokens: int = 40, seed: int = 0, prompt_length: int = 8):
    """(target, prompts [batch, prompt_length], plain output, reference sequences per row), no EOS stop."""
    target = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (batch, prompt_length), generator=g)
    plain = target.generate(
        prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS
    )
    return target, prompts, plain, [row.tolist() for row in plain]


def run(target, prompts, pool, clock, new_tokens=40):
    with clock.installed():
        return target.generate(
            prompts,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            custom_generate=hf_spin.generate,
            assistant_pool=pool,
        )


# --- the profile ---------------------------------------------------------------------------------


def test_forward_cost_interpolates_between_knots_and_extrapolates_by_the_last_rising_slope():
    cost = ForwardCost.from_table({1: 1.0, 4: 1.0, 8: 3.0})
    assert cost.predict(2) == pytest.approx(1.0)
    assert cost.predict(6) == pytest.approx(2.0)
    assert cost.predict(16) == pytest.approx(7.0)  # the last slope beyond the last knot
    falling = ForwardCost.from_table({1: 1.0, 2: 1.5, 4: 0.9})  # ends falling: flat beyond, never below
    assert falling.predict(4) == pytest.approx(0.9) and falling.predict(64) == pytest.approx(0.9)


def test_a_verification_runs_at_a_wider_knot_where_that_costs_less():
    # whisper-base's decoder on an AMD EPYC in float32, relative to one token: 2-3 tokens run a slow small GEMM
    uneven = ForwardCost.from_table({1: 1.0, 2: 1.7, 4: 1.5, 8: 1.4, 16: 2.0})
    assert uneven.predict(2) == pytest.approx(1.7)  # what a forward at N itself costs, as measured
    assert [uneven.width(n) for n in (1, 2, 3, 4, 5, 6, 8, 9)] == [1, 8, 8, 8, 8, 8, 8, 9]
    assert uneven.verify(2) == uneven.verify(3) == pytest.approx(1.4)
    assert all(uneven.verify(n) <= UNMEASURED_PREMIUM * uneven.predict(n) for n in range(1, 20))
    assert uneven.width(4, rows=4) == 8 and uneven.width(6, rows=3) == 6  # a multiple of the rows, or none
    assert uneven.flatness(2) == pytest.approx(1.4)
    profile = CostProfile(uneven, [], [])
    assert profile.verify_seconds(1, 3) == pytest.approx(1.4)
    # an unmeasured width a few percent cheaper on the line than the next knot runs at the knot, where its cost
    # is known; proportional costs stay at N
    assert ForwardCost.from_table({1: 1.0, 4: 1.0, 8: 1.03}).width(5) == 8
    linear = ForwardCost.from_table({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    assert [linear.width(n) for n in (2, 3, 5, 7)] == [2, 3, 5, 7]


def test_online_refinement_follows_a_change_and_shrugs_off_a_stall():
    cost = ForwardCost.from_table({1: 1.0, 8: 1.0})
    for _ in range(150):
        cost.observe(8, 1, 2.0)  # the machine is now twice as slow at 8 tokens
    assert cost.predict(8) == pytest.approx(2.0, rel=0.1)
    steady = ForwardCost.from_table({1: 1.0, 8: 1.0})
    for _ in range(100):
        steady.observe(1, 1, 1.0)
    steady.observe(1, 1, 100.0)  # one stall of 100x
    assert steady.predict(1) < 1.1
    steady.observe(1000, 1, 5.0)  # far beyond the grid: a knot of its own at what it took, the small N untouched
    assert 1000 in steady.knots and steady.predict(1000) == pytest.approx(5.0) and steady.predict(1) < 1.1


def test_a_drift_seen_on_plain_steps_moves_every_knot_and_a_knot_keeps_its_own_shape():
    """Most steps are plain: what they show of a drift (a long prompt's attention, the engine's own work around a
    forward) moves the knots drafting reads too, else an 8-token draft would look cheaper than a plain step (AMD
    EPYC, bf16, a 700-token RAG prompt: 1 token 0.20 -> 0.26 s, 8 tokens left at the grid's 0.23 s). A knot
    observed often keeps its own deviation from the shared shift."""
    cost = ForwardCost.from_table({1: 0.20, 2: 0.18, 8: 0.23})
    for _ in range(100):
        cost.observe(1, 1, 0.26)
    assert cost.predict(1) == pytest.approx(0.26, rel=0.03)
    assert cost.predict(8) == pytest.approx(0.23 * 1.3, rel=0.05) and cost.verify(8) > cost.predict(1)
    assert cost.width(1) == 2  # the shape the grid measured stands: two positions still cost less than one
    for _ in range(200):  # now the 8-token forwards are as the grid said, the plain steps still 1.3x
        cost.observe(1, 1, 0.26)
        cost.observe(8, 1, 0.23)
    assert cost.predict(8) == pytest.approx(0.23, rel=0.05) and cost.predict(1) == pytest.approx(0.26, rel=0.05)
    drafter = ForwardCost.from_table({1: 0.01, 64: 0.3})
    for _ in range(100):  # a drafter's call, its own work inside, timed per draft token: its knot alone
        drafter.observe(1, 1, 0.02, shared=False)
    assert drafter.predict(1) == pytest.approx(0.02, rel=0.05) and drafter.predict(64) == pytest.approx(0.3)


def test_a_width_off_the_grid_becomes_a_knot_once_three_runs_agree_the_grid_misprices_it():
    """Between knots a CPU's cost is jagged: an AMD EPYC in float32 ran the 1.5B target over 1 / 2 / 3 / 4 / 8
    positions in 389 / 840 / 1211 / 829 / 843 ms, and its grid read 444 / 989 / 1078 ms at 1 / 2 / 8. Three forwards at
    a width off the knots, each off its price by more than 15%, make it a knot at their median; then a verification of
    three positions pads to a measured knot that costs less. A stall in one run, or a width within 15% of its price,
    makes none. Plain steps, most of a run's forwards, run at one position as the grid read it."""
    cost = ForwardCost.from_table({1: 0.444, 2: 0.989, 8: 1.078})

    def run(n_tokens: int, seconds: float) -> None:  # a forward at n_tokens, then plain steps
        cost.observe(n_tokens, 1, seconds)
        for _ in range(5):
            cost.observe(1, 1, 0.444)

    assert cost.width(3) == 3  # interpolated: 1.004 s, under 8 positions' 1.078
    for seconds in (1.21, 1.19):
        run(3, seconds)
    assert 3 not in cost.knots  # two runs are not yet three
    run(3, 1.20)
    assert 3 in cost.knots and cost.predict(3) == pytest.approx(1.20, rel=0.02)
    assert cost.width(3) == 8
    for seconds in (0.83, 0.85, 0.84):  # four positions (a batch of four's plain step), priced between 3 and 8
        run(4, seconds)
    assert 4 in cost.knots and cost.predict(4) == pytest.approx(0.84, rel=0.02) and cost.width(3) == 4
    priced = cost.predict(6)
    for ratio in (1.0, 3.0, 1.0):  # a stall in one run
        run(6, priced * ratio)
    priced = cost.predict(5)
    for _ in range(3):  # inside the noise
        run(5, priced * 1.1)
    assert 5 not in cost.knots and 6 not in cost.knots


def test_an_idle_catch_up_teaches_the_drafters_cost_at_its_length(monkeypatch):
    """A drafter's grid ends at a few positions, flat (a 0.5B drafter in bf16 on a CPU reads 8 tokens at about one's
    cost), and `bound` extrapolates past it; a 150-token catch-up runs compute-bound at several forwards' cost. The
    engine times each idle catch-up as a forward over the positions it ran, so the next catch-up of that length is
    priced at what it took, and drafting's own forwards stay at the grid's."""
    from .test_plans import Scripted as Fixed

    target, prompts, plain, _ = case(batch=1, new_tokens=12, prompt_length=150)
    drafters = [tiny_model("llama", seed=1), tiny_model("llama", seed=2)]
    real = lambda n: 0.01 * max(1.0, n / 4)  # noqa: E731 - compute-bound past 4 positions
    clock = CostClock()
    clock.hook(target, table(flat))
    for d in drafters:
        clock.hook(d, table(real, knots=(1, 2, 4, 8, 16, 32, 64, 128, 256)))
    grid = table(lambda n: 0.01, knots=(1, 2, 4, 8))  # what a short grid measured: flat
    profile = profile_of(table(flat), [grid, grid], ["drafting", "idle"])
    pool = hf_spin.AssistantPool(drafters, policy=Fixed((0,), catch_up=[1]), profile=profile)
    monkeypatch.setattr(Planner, "worth_catching_up", lambda self, rows, *a, **kw: [True] * len(rows))
    assert grid.bound(150) < 0.25 * real(150)  # the grid's reading
    out = run(target, prompts, pool, clock, new_tokens=12)
    assert torch.equal(out, plain)
    learned = pool.planner.profile.drafters[1]
    assert learned.bound(150) == pytest.approx(real(150), rel=0.15)
    assert learned.predict(1) == pytest.approx(0.01, rel=0.1)  # one position, as the grid said


def test_a_drafters_first_draft_on_a_row_teaches_its_catch_up_cost():
    """A draft model's first draft on a row reads the prompt first (its catch-up inside its first forward), and a
    draft model that does not pay sits out the steps between its probes, so every probe carries a catch-up. Its
    seconds beyond the draft's one-token forwards are that catch-up's cost at the row's lag: learned, the next
    catch-up of that length is priced at what it took, not at the grid's flat extrapolation."""
    from .test_plans import Scripted as Fixed

    target, prompts, plain, _ = case(batch=1, new_tokens=12, prompt_length=150)
    drafter = tiny_model("llama", seed=1)
    real = lambda n: 0.01 * max(1.0, n / 4)  # noqa: E731 - compute-bound past 4 positions
    clock = CostClock()
    clock.hook(target, table(flat))
    clock.hook(drafter, table(real, knots=(1, 2, 4, 8, 16, 32, 64, 128, 256)))
    grid = table(lambda n: 0.01, knots=(1, 2, 4, 8))  # what a short grid measured: flat
    pool = hf_spin.AssistantPool([drafter], policy=Fixed((0,)), profile=profile_of(table(flat), [grid], ["drafter"]))
    assert grid.bound(150) < 0.25 * real(150)  # the grid's reading
    out = run(target, prompts, pool, clock, new_tokens=12)
    assert torch.equal(out, plain)
    assert pool.last_stats.drafters[pool.names[0]].steps >= 1  # it drafted, its first draft reading the prompt
    learned = pool.planner.profile.drafters[0]
    assert learned.bound(150) == pytest.approx(real(150), rel=0.15)
    assert learned.predict(1) == pytest.approx(0.01, rel=0.1)  # one position, as the grid said


def test_measure_reads_the_injected_costs_within_its_budget():
    model = tiny_model("llama", seed=0)
    clock = CostClock()
    clock.hook(model, table(lambda n: 0.1 * n))
    cost = measure(model, budget=3.0, clock=clock)  # after a warm-up forward the budget does not count
    # two timed runs a point, N = 1, 8, 2, 4: 0.2 + 1.6 + 0.4 + 0.8 s; N = 16 (3.2 s more) would overrun
    assert cost.knots == [1, 2, 4, 8]
    assert cost.seconds == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert cost.per_row == pytest.approx(0.0)  # 4 rows of one token cost what one row of 4 tokens does here


def test_a_catch_up_past_the_grid_grows_at_least_by_the_grids_mean_slope():
    """A grid that ends flat at 8 tokens says nothing of a 700-token prompt: a catch-up over it grows past the
    last knot by at least the grid's mean slope (first to last knot), never stays at one forward's cost."""
    cost = ForwardCost.from_table({1: 0.15, 2: 0.32, 8: 0.32})
    assert cost.predict(700) == pytest.approx(0.32)  # what interpolation alone says
    assert cost.bound(700) == pytest.approx(0.32 + (0.32 - 0.15) / 7 * 692)
    assert cost.bound(4) == pytest.approx(cost.predict(4))  # inside the grid, the grid
    rising = ForwardCost.from_table({1: 0.1, 8: 0.2, 64: 1.0})
    assert rising.bound(4) == pytest.approx(rising.predict(4))  # not the last knot's cost
    planner = Planner(profile_of(table(flat), [cost], ["drafter"]))
    assert planner._catch_up_seconds({0: 700}) == pytest.approx(cost.bound(700) - 0.15)


def test_a_drafters_own_encoder_is_measured_and_priced_with_its_first_catch_up():
    """An encoder-decoder drafter runs its encoder before its first catch-up of a row (encoder_decoder.py):
    the profile measures one row's encoder pass, and the planner charges it where the row is unencoded. At
    batch 1 on a CPU-like profile, a drafter the pool knows (acceptance 0.6) drafts on a row it has read,
    and not on one whose encoder pass (5 target steps) a 31-token answer cannot repay."""
    whisper = tiny_encoder_decoder("whisper", max_target_positions=256)  # the grid reads 128 + 64 positions
    clock = CostClock()
    whisper.get_encoder().register_forward_pre_hook(lambda *a: setattr(clock, "now", clock.now + 1.05))
    whisper.get_decoder().register_forward_pre_hook(lambda *a: setattr(clock, "now", clock.now + 0.5))  # 3 points
    cost = measure(whisper, budget=3.0, clock=clock)
    assert cost.encoder == pytest.approx(1.05)
    assert ForwardCost.from_dict(cost.to_dict()).encoder == pytest.approx(1.05)
    assert not complete(whisper, {k: v for k, v in cost.to_dict().items() if k != "encoder"})  # measured again
    assert complete(tiny_model("llama"), {"knots": [1], "seconds": [0.1]})

    target = ForwardCost.from_table({1: 0.211, 2: 0.225, 4: 0.267, 8: 0.345})
    drafter = ForwardCost.from_table({1: 0.091, 2: 0.091, 4: 0.107, 8: 0.136})
    drafter.encoder = 1.05
    planner = Planner(profile_of(target, [drafter], ["drafter"]))
    planner.acceptance.pooled[0] = [6.0, 4.0]
    assert planner._catch_up_seconds({0: 1}, {0}) == pytest.approx(1.05)
    assert planner.size([0], [{0: 1}], [31], [(0,)], [8], padded=True)[0] > 0
    assert planner.size([0], [{0: 1}], [31], [(0,)], [8], padded=True, unencoded=[{0}]) == [0]
    assert planner.worth_catching_up([0], 0, [1], [31], [True]) == [False]


def test_an_idle_catch_up_on_padded_rows_is_priced_over_every_row_it_pads():
    """A rectangular drafter cache runs a catch-up over every row of the batch, padded to the longest chunk: one
    row's 113-token catch-up at batch 4 costs a forward over 452 positions. Priced per row it fit the budget (one
    plain step); priced over the padded rows it does not (costs replay, schema requests, batch 4: 0.96x plain).
    A catch-up the budget buys is a probe's first half: bought only where the budget covers the probe's first rung
    after it too (one draft token verified: 0.019 s here), or it is spent for nothing."""
    linear = table(lambda n: 0.1 * (1 + 0.8 * (n - 1) / 7))  # AVX2 float32-like
    planner = Planner(profile_of(linear, [table(lambda n: 0.076 * (0.1 * (1 + 0.8 * (n - 1) / 7)))], ["drafter"]))
    planner.budget.plain_seconds = 6.0  # the call's plain time so far: a budget of 0.12 s, 1.2 plain steps
    assert planner._catch_up_seconds({0: 113}, (), 4) > 3.5 * planner._catch_up_seconds({0: 113})
    assert planner.worth_catching_up([0], 0, [113], [31], padded_rows=4) == [False]
    assert planner.budget.spent == 0.0
    assert planner.worth_catching_up([0], 0, [113], [31]) == [True]  # one row's own forward: the budget buys it
    planner = Planner(profile_of(linear, [table(lambda n: 0.076 * (0.1 * (1 + 0.8 * (n - 1) / 7)))], ["drafter"]))
    planner.budget.plain_seconds = 5.0  # 0.1 s: the catch-up (0.097 s) fits, the probe after it does not
    assert planner.worth_catching_up([0], 0, [113], [31]) == [False]
    assert planner.budget.spent == 0.0


def avx2_fp32(n: float) -> float:
    """A 1.5B model in float32 under the AVX2 emulation (AMD EPYC, 2 threads; seconds): one token a GEMV, 2-16
    a GEMM of about one cost (0.84 / 0.80 / 0.82 / 0.86 s for 2 / 4 / 8 / 16), then 0.02 s a position."""
    return 0.39 if n <= 1 else 0.8 if n <= 8 else 0.8 + 0.02 * (n - 8)


def test_a_fall_the_grid_reads_by_chance_is_timed_again():
    """Flat forwards (a GPU, an AMX CPU in bf16) whose first runs over 8 tokens ran while the machine was quieter
    (20% cheaper): read as a fall, 8 tokens would widen every plain step to 8 positions (on an AMX Xeon those cost a
    709-token prompt's steps 3-5% more). The grid times the fall's knots again, in turns, and reads them flat, so a
    plain step runs one position. A real fall (one token a GEMV, dearer than a two-token GEMM) stays a fall."""

    class Noisy:
        def __init__(self, cost, cheap_runs):
            self.cost, self.cheap_runs, self.calls = cost, cheap_runs, {}

        def predict(self, n_tokens, rows=1):
            self.calls[n_tokens] = self.calls.get(n_tokens, 0) + 1
            lucky = rows == 1 and n_tokens == 8 and self.calls[n_tokens] <= self.cheap_runs
            return self.cost(n_tokens) * (0.8 if lucky else 1.0)

    clock = CostClock()
    model = tiny_model("llama", seed=0)
    clock.hook(model, Noisy(lambda n: 0.2, cheap_runs=2))  # the grid's two runs of N = 8
    cost = measure(model, budget=3.0, clock=clock)
    assert cost.predict(8) == pytest.approx(cost.predict(1))
    assert CostProfile(cost, [], []).plain_width(1) == 1
    gemv = tiny_model("llama", seed=0)
    clock.hook(gemv, Noisy(lambda n: 0.192 if n == 1 else 0.172, cheap_runs=0))
    cost = measure(gemv, budget=3.0, clock=clock)
    assert cost.width(1, 1) > 1  # a fall the plain steps then check (`test_widths.py`)


def test_a_short_grid_brackets_the_draft_widths_instead_of_extrapolating():
    """A slow machine whose GEMV path makes one token cheap and any wider forward cost about two (an AMD
    EPYC in float32: 431 / 913 / 935 / 897 ms for 1 / 2 / 4 / 8 tokens): the grid measures 1, 8, 2 and 32
    even past its budget (and 32, past 2 and 8 that cost the same), so 8 tokens read at about 2 plain steps
    (not 8.8 from extrapolating 1 and 2) and a one-token probe (N = 2) at about 2 too (not 1.2 from
    interpolating 1 and 8)."""
    model = tiny_model("llama", seed=0)
    clock = CostClock()
    clock.hook(model, table(lambda n: 0.43 if n == 1 else 0.9))
    cost = measure(model, budget=3.0, clock=clock)
    assert cost.knots == [1, 2, 8, 32]
    assert cost.predict(8) / cost.predict(1) == pytest.approx(0.9 / 0.43)
    assert cost.predict(2) / cost.predict(1) == pytest.approx(0.9 / 0.43)


def test_a_short_grid_reaches_the_positions_a_batch_of_four_verifies():
    """Where 2 to 8 positions cost about the same (the knots falling from 2 to 8, so the curve past 8 would
    read flat), the grid measures 32 past its budget: 4 rows of 5 tokens (20 positions) are priced from the
    line to 32, within 5% of their cost, not at the cost of 8 (a third too cheap, which had the default pool
    draft at batch 4 under the AVX2 emulation for 0.91x plain). A rising grid stops at its budget."""
    model = tiny_model("llama", seed=0)
    clock = CostClock()
    clock.hook(model, table(avx2_fp32))
    cost = measure(model, budget=3.0, clock=clock)
    assert cost.knots == [1, 2, 8, 32]
    assert cost.predict(20) == pytest.approx(avx2_fp32(20), rel=0.05)
    assert cost.verify(20, 4) >= 0.95 * avx2_fp32(20)  # no wider knot read as cheaper
    rising = tiny_model("llama", seed=0)
    clock.hook(rising, table(lambda n: 0.39 * n))
    assert measure(rising, budget=3.0, clock=clock).knots == [1, 2, 8]  # the line beyond 8 is the slope's


def test_profile_is_cached_per_model_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPIN_PROFILES", str(tmp_path))
    target, drafter = tiny_model("llama", seed=0), tiny_model("qwen2", seed=0)
    forwards = []
    for m in (target, drafter):
        m.register_forward_pre_hook(lambda *a: forwards.append(1))
    first = build_profile(target, [drafter, None], ["drafter", "prompt_lookup"])
    measured = len(forwards)
    assert measured > 0 and first.source == "measured" and first.drafters[1] is None
    second = build_profile(target, [drafter, None], ["drafter", "prompt_lookup"])
    assert len(forwards) == measured and second.source == "cached"  # read from disk; measured here: warm already
    assert second.target.seconds == first.target.seconds
    target, drafter = tiny_model("llama", seed=0), tiny_model("qwen2", seed=0)  # the same models, not run here yet
    for m in (target, drafter):
        m.register_forward_pre_hook(lambda *a: forwards.append(1))
    for _ in range(2):  # a pool per call: the first warms each model with one forward, the next runs none
        assert build_profile(target, [drafter, None], ["drafter", "prompt_lookup"]).source == "cached"
        assert len(forwards) == measured + 2
    build_profile(tiny_model("llama", seed=0).to(torch.float64), [None], ["prompt_lookup"])  # float64 measured...
    target.to(torch.float64)  # ...then the warm target cast to it: its cost read, and warmed once in the new dtype
    try:
        for _ in range(2):  # one warm-up forward in float64, then none
            assert build_profile(target, [None], ["prompt_lookup"]).source == "cached"
            assert len(forwards) == measured + 2 + 1
    finally:
        target.to(torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        build_profile(target, [drafter, None], ["drafter", "prompt_lookup"])
    finally:
        torch.set_num_threads(threads)
    assert len(forwards) > measured  # another thread count is another machine
    path = tmp_path / "one.json"
    build_profile(target, [drafter], ["drafter"], path)
    assert len(json.loads(path.read_text())) == 2  # one file: both models
    assert build_profile(target, [drafter], ["drafter"], path).source.startswith("cached")


def test_profile_prints_as_a_table_with_its_outlook():
    profile = profile_of(table(linear), [table(lambda n: 0.02 * n), None], ["draft-model", "prompt_lookup"])
    text = str(profile)
    assert "| target |" in text and "| draft-model |" in text and "model-free" in text
    assert profile.outlook().startswith("speculate") and "prompt_lookup" in profile.outlook()
    assert not profile.pays(0)  # a model drafter costing 20% of the target per token cannot pay on linear costs
    hopeless = profile_of(table(lambda n: 0.1 * n), [table(lambda n: 0.02 * n)], ["draft-model"])
    hopeless.dtype, hopeless.other_dtypes = "bfloat16", {"float32": table(flat)}
    assert hopeless.outlook().startswith("plain: speculation cannot pay here in bfloat16")
    assert "it would in float32" in hopeless.outlook()


# --- the planner's decisions ---------------------------------------------------------------------


def test_plain_when_verification_grows_linearly_at_moderate_acceptance():
    """Linear verification (8 tokens ~6 steps) with drafts right 60% of the time: after a few
    probes the planner decodes plainly, and the run costs no more than plain decoding."""
    target, prompts, plain, refs = case(batch=1, new_tokens=60)
    clock = CostClock()
    clock.hook(target, table(linear))
    pool = hf_spin.AssistantPool([Scripted(refs, [0.6])], profile=profile_of(table(linear), [None], ["scripted"]))
    out = run(target, prompts, pool, clock, new_tokens=60)
    assert torch.equal(out, plain)
    stats = pool.last_stats
    assert stats.steps > 40  # mostly one token a step: plain
    plain_seconds = 60 * linear(1)  # the prefill aside, a plain step per token
    assert stats.verify_seconds <= 1.03 * plain_seconds, f"{stats.verify_seconds:.2f}s vs plain {plain_seconds:.2f}s"


def test_long_drafts_when_verification_is_flat():
    target, prompts, plain, refs = case(batch=1)
    clock = CostClock()
    clock.hook(target, table(flat))
    pool = hf_spin.AssistantPool(
        [Scripted(refs, [0.6])], draft_length=8, profile=profile_of(table(flat), [None], ["scripted"])
    )
    out = run(target, prompts, pool, clock)
    assert torch.equal(out, plain)
    d = pool.last_stats.drafters["scripted"]
    assert d.longest_draft == 8 and d.drafted >= 0.85 * 8 * d.steps  # at the cap but where the length limit is nearer


def test_model_drafter_sized_by_its_cost():
    """A real draft model priced by the profile: flat verification, drafting at 5% of a step a token:
    drafts of several tokens, accepted and rejected, output unchanged."""
    target, prompts, plain, _ = case(batch=2, new_tokens=60)  # a budget for the first probe's catch-up
    drafter = perturbed("llama")
    clock = CostClock()
    clock.hook(target, table(flat))
    clock.hook(drafter, table(lambda n: 0.005 * n))
    profile = profile_of(table(flat), [table(lambda n: 0.005 * n)], ["drafter"])
    pool = hf_spin.AssistantPool(
        [drafter], draft_length=hf_spin.policies.FixedLength(6, min_confidence=0), profile=profile
    )
    out = run(target, prompts, pool, clock, new_tokens=60)
    assert torch.equal(out, plain)
    d = pool.last_stats.drafters[pool.names[0]]
    assert d.longest_draft >= 2 and d.accepted > 0 and d.drafted > d.accepted


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_batch_budget_goes_to_the_rows_whose_tokens_are_worth_most(closed, monkeypatch):
    """Batch 8, packed rows, verification flat up to 24 positions and steep beyond; four rows' drafts survive (95%),
    four rows' fail (20%). In an open batch (a server's: a retired row's slot takes the next request) every token is
    worth the same, and the draft slots go to the rows likely to survive. In a closed one (a `generate` call's) the
    likely rows soon run ahead, and the batch ends with the unlikely ones: the slots go to those (closed_batch.py)."""
    target, prompts, plain, refs = case(batch=8, new_tokens=60)
    clock = CostClock()
    budget = table(lambda n: 0.1 if n <= 24 else 0.1 * (1 + (n - 24) / 4), knots=(1, 2, 4, 8, 16, 24, 32, 64))
    clock.hook(target, budget)
    acceptance = [0.95] * 4 + [0.2] * 4
    pool = hf_spin.AssistantPool(
        [Scripted(refs, acceptance)], draft_length=8, cache="packed", profile=profile_of(budget, [None], ["scripted"])
    )
    trims, trim, size = [], Planner.trim, Planner.size
    monkeypatch.setattr(
        Planner,
        "trim",
        lambda self, *a, **kw: trims.append(trim(self, *a, **kw)[0]) or (trims[-1], [None] * len(trims[-1])),
    )
    if not closed:  # a `generate` call's batch is closed: this is a server's rule
        monkeypatch.setattr(Planner, "size", lambda self, *a: size(self, *a[:7], closed=False))
    out = run(target, prompts, pool, clock, new_tokens=60)
    assert torch.equal(out, plain)
    full = [ks for ks in trims[3:] if len(ks) == 8]  # after a few steps of learning, while every row runs
    high, low = sum(sum(ks[:4]) for ks in full), sum(sum(ks[4:]) for ks in full)
    summary = f"verified draft tokens: likely rows {high}, unlikely rows {low} over {len(full)} steps"
    assert len(full) >= 3 and (low > 2 * high if closed else high > 3 * low), summary
    assert all(8 + sum(ks) <= 28 for ks in full)  # within the flat part, give or take one slot


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "open_control"])
def test_a_closed_batch_waiting_for_a_row_that_accepts_nothing_decodes_plainly(closed, monkeypatch):
    """Batch 4 on the rectangular cache, a step's cost rising gently with its positions (an AMX CPU in bf16): three
    rows' drafts half right, one row's never. The batch runs as long as that row, whatever the others gain, so a
    `generate` call (a closed batch) is within 3% of plain decoding once the three run ahead, the pool having seen
    in a first call that rows run to their limit (before, a row may stop at any token: any may end the batch). The
    control values every row's tokens alike (an open batch's rule) and drafts for the three to the end: slower."""
    new_tokens, gentle = 40, (lambda n: 0.1 * (1 + 0.03 * n))
    target, prompts, plain, refs = case(batch=4, new_tokens=new_tokens)
    clock = CostClock()
    clock.hook(target, table(gentle))
    pool = hf_spin.AssistantPool(
        [Scripted(refs, [0.0, 0.5, 0.5, 0.5])], draft_length=4, profile=profile_of(table(gentle), [None], ["scripted"])
    )
    if not closed:
        size = Planner.size
        monkeypatch.setattr(Planner, "size", lambda self, *a: size(self, *a[:7], closed=False))
    for _ in range(2):  # the first call teaches the pool how long rows run
        out = run(target, prompts, pool, clock, new_tokens=new_tokens)
        assert torch.equal(out, plain)
    plain_seconds, seconds = new_tokens * gentle(4), pool.last_stats.verify_seconds  # a plain step per token
    if closed:
        assert seconds <= 1.03 * plain_seconds, f"{seconds:.3f} s against plain {plain_seconds:.3f} s"
    else:
        assert seconds > 1.04 * plain_seconds, f"{seconds:.3f} s against plain {plain_seconds:.3f} s"


def test_a_pool_that_cannot_win_says_so_once_and_decodes_plainly():
    target, prompts, plain, _ = case(batch=1)
    drafter = perturbed("llama")
    clock = CostClock()
    clock.hook(target, table(lambda n: 0.1 * n))
    clock.hook(drafter, table(lambda n: 0.02 * n))
    pool = hf_spin.AssistantPool(
        [drafter], profile=profile_of(table(lambda n: 0.1 * n), [table(lambda n: 0.02 * n)], ["drafter"])
    )
    with pytest.warns(UserWarning, match="speculation cannot pay here"):
        out = run(target, prompts, pool, clock)
    assert torch.equal(out, plain)
    assert pool.last_stats.drafters[pool.names[0]].drafted == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(target, prompts, pool, clock)  # said once per pool and target


def test_policies_read_the_profile():
    profile = profile_of(table(linear), [table(lambda n: 0.01 * n), None], ["drafter", "prompt_lookup"])
    drafter = perturbed("llama")
    pool = hf_spin.AssistantPool([drafter, "prompt_lookup"], policy="lbss", profile=profile)
    pool.bind(tiny_model("llama", seed=0))
    costs = pool.policy.costs
    assert costs.verify_seconds(4, 12) == profile.verify_seconds(4, 12)
    assert costs.plain_seconds(4) == profile.plain_seconds(4)
    assert costs.draft_seconds(0, 3, 6) == pytest.approx(profile.draft_seconds_for_rows(0, 3, 2))


def test_acceptance_learns_per_position_and_per_row():
    acc = Acceptance(1)
    for _ in range(30):
        acc.observe(0, row=7, proposed=4, matched=4, committed=5)  # row 7: always right
        acc.observe(0, row=8, proposed=4, matched=0, committed=1)  # row 8: never
    assert acc.survival(0, 7, 4)[-1] > 0.5 > 0.1 > acc.survival(0, 8, 4)[0]
    acc.observe(0, row=9, proposed=4, matched=2, committed=2)  # censored: 2 right, the third unchecked
    assert acc.rows[(0, 9)] == [2.0, 0.0]


def test_a_request_that_holds_the_pools_evidence_is_not_counted_twice():
    """Batch 1: the pool's evidence is the running request's own. Its factor would count it again (three
    early rejections reading as 0.20 where the pool's levels say 0.34, and the planner decoding plainly
    for twenty steps at 0.6 acceptance); beside other requests' evidence its deviation from them counts."""
    alone = Acceptance(1)
    for _ in range(3):
        alone.observe(0, row=0, proposed=4, matched=0, committed=1)
    assert alone.conditionals(0, 0, 1)[0] == pytest.approx(
        alone.conditionals(0, 1, 1)[0]
    )  # as a request with no evidence of its own
    # as the pool's levels read three rejections: the prior (0.6, two observations) against them, 0.24; counted
    # twice: 0.14
    assert alone.conditionals(0, 0, 1)[0] == pytest.approx(
        acceptance_with_prior(0.0, 3.0, PRIOR_ACCEPTANCE, PRIOR_WEIGHT)
    )
    among = Acceptance(1)
    for _ in range(30):
        among.observe(0, row=1, proposed=4, matched=2, committed=3)
    for _ in range(3):
        among.observe(0, row=0, proposed=4, matched=0, committed=1)
    assert (
        among.conditionals(0, 0, 1)[0] < 0.8 * among.conditionals(0, 2, 1)[0]
    )  # below a request the pool knows nothing of


def test_each_level_reads_its_own_counts_once():
    """A level's prior is the level above without the level's own counts, worth at most what that holds: where
    one position holds all the pool's evidence (a fresh pool whose first drafts died at position 1, a pool whose
    probes are one token), the position reads its counts once, against the prior at the prior's own weight, as
    the pooled level does; not shrunk toward a pooled value that already holds them (three rejections read as 0.14
    that way, three acceptances as 0.91), nor against the prior at LEVEL_WEIGHT pseudo-observations, which it does
    not hold (the evidence-only prior read four acceptances at position 1 as 0.5, not the pooled level's 0.67)."""
    for matched, committed in ((0, 1), (4, 5)):
        acc = Acceptance(1)
        for _ in range(3):
            acc.observe(0, row=0, proposed=1, matched=matched, committed=committed)
        a, r = acc.counts[(0, None, 1)]
        assert (a, r) in ((0.0, 3.0), (3.0, 0.0))
        assert acc.conditionals(0, 1, 1)[0] == pytest.approx(
            acceptance_with_prior(a, r, PRIOR_ACCEPTANCE, PRIOR_WEIGHT)
        )
    acc = Acceptance(1)
    for _ in range(4):
        acc.observe(0, row=0, proposed=1, matched=1, committed=2)
    assert acc.conditionals(0, 1, 1, prior=EVIDENCE_ONLY)[0] == pytest.approx(4 / 6)
    # beside other positions' evidence the level's prior is the rest, at LEVEL_WEIGHT observations
    acc.observe(0, row=0, proposed=3, matched=2, committed=2)  # positions 1 and 2 right, the third unchecked
    rest = acceptance_with_prior(5.0, 0.0, *EVIDENCE_ONLY)  # the pool's other counts: position 1's five
    assert acc.conditionals(0, 1, 2, prior=EVIDENCE_ONLY)[1] == pytest.approx(
        acceptance_with_prior(1.0, 0.0, rest, LEVEL_WEIGHT)
    )


def test_planner_sizes_zero_and_full():
    flat_planner = Planner(profile_of(table(flat), [None], ["lookup"]))
    assert flat_planner.size([0, 1], [{}, {}], [None, None], [(0,), (0,)], [8, 8], padded=False) == [8, 8]
    with pytest.warns(
        UserWarning, match="speculation cannot pay here"
    ):  # even free drafts cannot beat proportional costs
        linear_planner = Planner(profile_of(table(lambda n: 0.1 * n), [None], ["lookup"]))
    assert linear_planner.size([0, 1], [{}, {}], [None, None], [(0,), (0,)], [8, 8], padded=False) == [0, 0]
    assert linear_planner.trim([0, 1], [[5, 6], [7]], [(0,), (0,)], [{}, {}], padded=False)[0] == [0, 0]


def test_optimism_buys_a_probe_but_not_a_catch_up_the_mean_cannot_repay():
    """Batch 4 on a CPU-like profile (rectangular cache; measured costs of a 1.5B target and a 0.5B
    drafter in bf16), four requests new to the drafter, whose pooled acceptance is 0.86 (100 observations). Caught up,
    drafting pays at that mean; but reading four 50-80-token prompts first repays over a 30-token
    answer only on the optimistic bound: the step is plain. With nothing to catch up, or an answer
    long enough to repay the catch-up at the mean, the rows draft."""
    target = ForwardCost.from_table({1: 0.211, 2: 0.225, 4: 0.267, 8: 0.345})
    drafter = ForwardCost.from_table({1: 0.091, 2: 0.091, 4: 0.107, 8: 0.136})
    planner = Planner(profile_of(target, [drafter], ["drafter"]))
    planner.acceptance.pooled[0] = [86.0, 14.0]

    def size(lags, room):
        return planner.size([0, 1, 2, 3], [{0: lag} for lag in lags], [room] * 4, [(0,)] * 4, [8] * 4, padded=True)

    assert size([52, 76, 57, 78], 31) == [0, 0, 0, 0]
    assert min(size([1, 1, 1, 1], 31)) > 0
    assert min(size([52, 76, 57, 78], 1000)) > 0
    # batch 1, a drafter the pool rates at 0.6 (10 observations) or has never seen: reading a 52-token prompt for
    # a 31-token answer is not what the evidence pays for, so the row drafts where nothing is to read, and on the
    # new prompt only as a probe, once the budget covers it with the whole catch-up (2.2 plain steps: 2% of the
    # plain time of 111 steps, the call's so far and its 31 to come), a never-seen drafter's first probe too
    for pooled, steps, probes in ((p, n, n == 90) for p in ([6.0, 4.0], [0.0, 0.0]) for n in (60, 90)):
        for lag, drafts in ((52, probes), (1, True)):
            planner = Planner(profile_of(target, [drafter], ["drafter"]))
            planner.acceptance.pooled[0] = list(pooled)
            planner.budget.plain_seconds = steps * target.predict(1)
            sized = planner.size([0], [{0: lag}], [31], [(0,)], [8], padded=True)
            assert (sized[0] > 0) == drafts, (pooled, steps, lag)
    # ...unless the pool has never seen the drafter: its first probe may draw on the pool's account too (2% of every
    # call's plain time so far: after 200 plain steps, 1.9 of the 2.2 its probe costs beyond the call's share)
    for pooled, probes in (([6.0, 4.0], False), ([0.0, 0.0], True)):
        planner = Planner(profile_of(target, [drafter], ["drafter"]))
        planner.acceptance.pooled[0] = list(pooled)
        planner.budget.plain_seconds = 60 * target.predict(1)
        planner.budget.pool_plain_seconds = 200 * target.predict(1)
        assert (planner.size([0], [{0: 52}], [31], [(0,)], [8], padded=True)[0] > 0) == probes, pooled
        assert planner.budget.learning_spent > 0 if probes else planner.budget.learning_spent == 0
    # the account lends a call at most the call's own share: however much it holds, a call of 31 tokens to come (a
    # share of 0.62 plain steps, 1.24 with the loan) cannot try the 2.2-step probe; after 60 steps of its own it can
    for steps, probes in ((0, False), (60, True)):
        planner = Planner(profile_of(target, [drafter], ["drafter"]))
        planner.budget.plain_seconds = steps * target.predict(1)
        planner.budget.pool_plain_seconds = 10_000 * target.predict(1)
        assert (planner.size([0], [{0: 52}], [31], [(0,)], [8], padded=True)[0] > 0) == probes, steps
        assert planner.budget.lent == planner.budget.learning_spent


def test_batch_4_catch_ups_are_priced_as_the_forward_that_runs_them():
    """On the CPU-like profile above, at batch 4. A padded drafter cache feeds a catch-up to every row at the
    longest lag: one new 300-token prompt costs a forward over 1200 positions, which its 1000-token answer does not
    repay, while packed rows read its 300 tokens alone, which it does. The rows that need no catch-up are ranked
    before it too: packed, over a 50-token answer, they draft though the new row does not. A drafter the pool
    has never seen is probed first on one row, the one with the shortest prompt: four prompts at once (a
    forward over 240 positions) are beyond the budget of 100 plain steps."""
    target = ForwardCost.from_table({1: 0.211, 2: 0.225, 4: 0.267, 8: 0.345})
    drafter = ForwardCost.from_table({1: 0.091, 2: 0.091, 4: 0.107, 8: 0.136})

    def size(pooled, lags, room, padded, steps=1):
        planner = Planner(profile_of(target, [drafter], ["drafter"]))
        planner.acceptance.pooled[0] = list(pooled)
        planner.budget.plain_seconds = steps * target.predict(1)
        return planner.size([0, 1, 2, 3], [{0: lag} for lag in lags], [room] * 4, [(0,)] * 4, [8] * 4, padded)

    known, fresh = [86.0, 14.0], [0.0, 0.0]
    assert size(known, [300, 1, 1, 1], 1000, padded=True)[0] == 0
    assert size(known, [300, 1, 1, 1], 1000, padded=False)[0] > 0
    assert size(known, [300, 1, 1, 1], 50, padded=False) == [0, 2, 1, 1]
    assert size(fresh, [60, 8, 40, 30], 1000, padded=True, steps=100) == [0, 1, 0, 0]


def test_a_catch_up_is_spread_over_the_steps_rows_are_expected_to_run():
    """Batch 4 on the CPU-like profile above, four 52-78-token prompts new to a drafter the pool knows (0.86):
    spread over a 1000-token room the catch-ups pay, but once the pool has seen rows end after 30 tokens
    (short answers, transcripts, whatever the length limit), they are spread over ~30 and the step is plain."""
    target = ForwardCost.from_table({1: 0.211, 2: 0.225, 4: 0.267, 8: 0.345})
    drafter = ForwardCost.from_table({1: 0.091, 2: 0.091, 4: 0.107, 8: 0.136})
    planner = Planner(profile_of(target, [drafter], ["drafter"]))
    planner.acceptance.pooled[0] = [86.0, 14.0]

    def size():
        return planner.size([0, 1, 2, 3], [{0: lag} for lag in (52, 76, 57, 78)], [1000] * 4, [(0,)] * 4, [8] * 4, True)

    assert min(size()) > 0
    planner.end_rows([10, 11, 12], [30, None, 30])  # the cancelled row's length teaches nothing
    assert planner.lengths.ended.mean == pytest.approx(30)
    assert size() == [0, 0, 0, 0]


def test_row_lengths_expect_the_mean_of_rows_that_ended():
    lengths = RowLengths()
    assert lengths.left(0, 448) == 448 and lengths.left(0, None) is None  # nothing ended yet: the room
    lengths.end([5], [20])
    assert lengths.left(0, 448) == 20 and lengths.left(0, 8) == 8
    lengths.committed([0], [15])
    assert lengths.left(0, 448) == 5
    lengths.committed([0], [10])
    assert lengths.left(0, 448) == 20  # past the mean: about as long again
    lengths.end([0], [25])
    assert 0 not in lengths.generated


def test_trees_are_sized_node_by_node_by_estimated_acceptance():
    """A node's heaviest child is worth its parent times the chain's conditional acceptance at its depth; its
    other children share, by weight, its parent's value where that child fails times the learned acceptance of
    such siblings; trim keeps the likeliest nodes while the next one pays: all of them when verification is flat,
    fewer when it grows, and the kept nodes are the likeliest (a heavy chain before its lighter siblings)."""
    tree = TokenTree()
    a = tree.add(-1, 10, weight=1.0)
    b = tree.add(-1, 11, weight=0.25)
    tree.add(a, 12, weight=0.8)
    tree.add(a, 13, weight=0.1)
    tree.add(b, 14, weight=0.25)
    c = rho = PRIOR_ACCEPTANCE  # no evidence yet: the prior at each position, and for siblings
    expected = [c, (1 - c) * rho, c * c, c * (1 - c) * rho, (1 - c) * rho * c]
    flat_planner = Planner(profile_of(table(flat), [None], ["lookup"]))
    ks, values = flat_planner.trim([0], [tree.tokens], [(0,)], [{}], padded=False, trees=[tree])
    assert values[0] == pytest.approx(expected) and ks == [5]
    steep = Planner(profile_of(table(lambda n: 0.1 * (1 + 0.3 * (n - 1))), [None], ["lookup"]))
    steep.budget.plain_seconds = 10.0  # a call's hundred plain steps: nothing seen yet, a node is a probe it affords
    ks, values = steep.trim([0], [tree.tokens], [(0,)], [{}], padded=False, trees=[tree])
    assert 1 <= ks[0] < 5
    kept = tree.pruned(2, by=values[0])
    assert kept.tokens == [10, 12] and kept.parents == [-1, 0]
    with pytest.raises(ValueError, match="node scores that do not grow from parent to child"):
        tree.pruned(2, by=[0.1, 0.2, 0.9, 0.0, 0.0])
    # one of siblings at most is accepted: four equal continuations (prompt lookup's of a one-token match) are not
    # each as likely as the chain, and together never above their parent's value
    wide = TokenTree()
    for token in (20, 21, 22, 23):
        wide.add(-1, token, weight=1.0)
    _, values = flat_planner.trim([0], [wide.tokens], [(0,)], [{}], padded=False, trees=[wide])
    assert values[0] == pytest.approx([c] + [(1 - c) * rho / 3] * 3) and sum(values[0]) <= 1.0
    # siblings seen failing where the chain failed lose their value; the chain's is what its own evidence says
    for _ in range(20):
        flat_planner.acceptance.observe_alternatives(0, accepted=False)
    _, learned = flat_planner.trim([0], [wide.tokens], [(0,)], [{}], padded=False, trees=[wide])
    assert learned[0][0] == pytest.approx(c) and max(learned[0][1:]) < 0.01
    evidence_only = flat_planner._node_values(0, (0,), wide, {}, EVIDENCE_ONLY)
    assert max(evidence_only[1:]) == 0.0  # nothing yet says a sibling is right


class Varying(hf_spin.policies.DraftLength):
    """A cap that changes with the step and the row: 1..6."""

    def k(self, drafter, row, view):
        return 1 + (view.step + 2 * row) % 6


@pytest.mark.parametrize("profile", ["flat", "off"])
def test_no_step_drafts_past_the_policys_cap_or_the_rows_room(profile, monkeypatch):
    """`plan_k` owns k: whatever the planner, every draft a step verifies (a tree: its depth) is at
    most the policy's k for the row and the draft tokens the row has room for before its length limit."""
    target, prompts, plain, refs = case(batch=3, new_tokens=15)
    clock = CostClock()
    clock.hook(target, table(flat))
    costs = profile_of(table(flat), [None], ["scripted"]) if profile == "flat" else "off"
    pool = hf_spin.AssistantPool([Scripted(refs, [0.9, 0.6, 0.3])], draft_length=Varying(), profile=costs)
    seen = []  # (draft length, policy's cap, row's room, planned length) per row and step
    propose = hf_spin.step.engine.SpinEngine.propose

    def checked(engine):
        rooms = [r.draft_room for r in engine.rows]
        proposal = propose(engine)
        trees = proposal.trees or [None] * len(rooms)
        for b, (draft, tree) in enumerate(zip(proposal.drafts, trees)):
            length = max(tree.depths(), default=0) if tree is not None else len(draft)
            seen.append((length, proposal.plan.k[b], rooms[b], proposal.ks[b]))
        return proposal

    monkeypatch.setattr(hf_spin.step.engine.SpinEngine, "propose", checked)
    out = run(target, prompts, pool, clock, new_tokens=15)
    assert torch.equal(out, plain)
    assert all(length <= k <= min(cap, room) for length, cap, room, k in seen), seen
    assert any(length == cap < room for length, cap, room, _ in seen)  # the policy's cap binds
    assert any(length == room < cap for length, cap, room, _ in seen)  # the row's room binds


def test_plan_k_caps_by_the_policy_and_the_room_with_or_without_a_planner():
    caps, rooms, chosen = [8, 8, 3, 5], [2, 9, 9, 9], [(0,), (0,), (0,), ()]
    assert plan_k(caps, rooms, chosen) == [2, 8, 3, 0]
    flat_planner = Planner(profile_of(table(flat), [None], ["lookup"]))
    assert plan_k(caps, rooms, chosen, flat_planner, [0, 1, 2, 3], lambda: [{}] * 4, padded=False) == [2, 8, 3, 0]
    linear_planner = Planner(profile_of(table(linear), [None], ["lookup"]))
    assert plan_k(caps, rooms, chosen, linear_planner, [0, 1, 2, 3], lambda: [{}] * 4, padded=False) == [0, 0, 0, 0]


def test_profile_argument_is_checked():
    with pytest.raises(ValueError, match="profile='of' is not supported; give 'auto', 'off', a path to a .json file"):
        hf_spin.AssistantPool(["prompt_lookup"], profile="of")
    assert hf_spin.AssistantPool(["prompt_lookup"], profile="off").planner is None


@pytest.mark.parametrize("new_tokens, drafts", [(12, False), (150, True)])
def test_a_drafter_reads_a_long_prompt_only_where_the_answer_pays_for_it(new_tokens, drafts):
    """A draft model new to a 150-token prompt must read it first (15 plain steps' worth here). The pool has seen
    it draft well on a short prompt (its catch-up bought by the exploration budget). Over 12 new tokens the long
    catch-up never pays back: plain decoding. Over 150 it does: the row drafts. A fresh pool, which knows
    nothing of the drafter, does not buy 15 plain steps to learn it."""
    target, drafter = tiny_model("llama", seed=0), perturbed("llama")
    prompts = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(0))
    clock = CostClock()
    clock.hook(target, table(flat))
    clock.hook(drafter, table(lambda n: 0.01 * n))
    profile = profile_of(table(flat), [table(lambda n: 0.01 * n)], ["drafter"])
    pool = hf_spin.AssistantPool(
        [drafter], draft_length=hf_spin.policies.FixedLength(4, min_confidence=0), profile=profile
    )
    run(target, prompts[:, :8], pool, clock, new_tokens=150)  # (rows here run 150 tokens: row_lengths.py)
    assert pool.last_stats.drafters[pool.names[0]].accepted > 0
    fresh = hf_spin.AssistantPool(
        [drafter], draft_length=hf_spin.policies.FixedLength(4, min_confidence=0), profile=profile
    )
    run(target, prompts, fresh, clock, new_tokens=new_tokens)
    assert fresh.last_stats.drafters[fresh.names[0]].drafted == 0
    plain = target.generate(
        prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS
    )
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    assert (pool.last_stats.drafters[pool.names[0]].drafted > 0) == drafts


class ScriptedTree(Scripted):
    """`Scripted`'s chain plus, when the step takes trees, a second branch: the true continuation
    behind a wrong first token's sibling (one child of the root right, one wrong, 60/40)."""

    def draft(self, request):
        draft = super().draft(request)
        if request.trees:
            trees = []
            for row, chain in zip(request.rows, draft.tokens):
                seq = request.sequences[row]
                truth = next(ref for ref in self.references if ref[: len(seq)] == seq)[len(seq) : len(seq) + len(chain)]
                trees.append(
                    TokenTree.merge([TokenTree.chain(chain, weight=2.0), TokenTree.chain(truth)]) if chain else None
                )
            draft.trees = trees
        return draft


@pytest.mark.parametrize("costs", ["linear", "flat"])
def test_trees_cost_what_the_planner_lets_a_chain_cost(costs, monkeypatch):
    """On packed rows, a tree verifies as many nodes as its chain would verify tokens: plain-like under
    linear verification (within 3% of plain's time), branching trees under flat verification."""
    import hf_spin.step.tree_step as tree_step

    target, prompts, plain, refs = case(batch=2, new_tokens=30)
    fn = linear if costs == "linear" else flat
    clock = CostClock()
    clock.hook(target, table(fn))
    seen = []
    real = tree_step.verify
    monkeypatch.setattr(tree_step, "verify", lambda engine, trees: seen.extend(trees) or real(engine, trees))
    pool = hf_spin.AssistantPool(
        [ScriptedTree(refs, [0.6, 0.6])],
        draft_length=6,
        cache="packed",
        profile=profile_of(table(fn), [None], ["scripted"]),
    )
    out = run(target, prompts, pool, clock, new_tokens=30)
    assert torch.equal(out, plain)
    stats = pool.last_stats
    if costs == "linear":
        plain_seconds = 30 * table(fn).predict(2, 1)  # a plain packed step: both rows' one token
        assert stats.verify_seconds <= 1.03 * plain_seconds, (
            f"{stats.verify_seconds:.2f}s vs plain {plain_seconds:.2f}s"
        )
    else:
        assert any(len(t.children(n)) >= 2 for t in seen for n in range(-1, len(t))), "no tree branched"
        assert stats.mean_accepted_length > 1.5
        # the true continuation is a sibling wherever the chain fails: its siblings are learned right every time
        accepted, rejected = pool.planner.acceptance.alternatives[0]
        assert accepted > 1 and rejected == 0


def test_the_step_log_records_each_idle_catch_up_and_what_paid_it(tmp_path, monkeypatch):
    """`HF_SPIN_STEP_LOG`: an idle catch-up the planner buys is a line of its own (the step's record does not
    show it), naming the row, the drafter, its lag, the seconds priced and what paid; one it refuses, none."""
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("HF_SPIN_STEP_LOG", str(log))
    profile = profile_of(table(lambda n: 0.1), [table(lambda n: 0.001 * n), None], ["draft-model", "prompt_lookup"])
    planner = Planner(profile)
    planner.budget.plain_seconds = 5.0  # the call's plain time so far: a budget of 0.1 s, one plain step
    assert planner.worth_catching_up([7], 0, [40], [100]) == [True]  # within the budget
    assert planner.worth_catching_up([8], 0, [4000], [100]) == [False]  # 4 s: beyond it, and no evidence
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [{k: e[k] for k in ("event", "row", "drafter", "lag", "paid_by")} for e in events] == [
        {"event": "idle_catch_up", "row": 7, "drafter": "draft-model", "lag": 40, "paid_by": "budget"}
    ]
    assert 0.03 < events[0]["seconds"] <= 0.1  # priced: about 40 draft positions, within the budget


def test_a_restored_snapshot_plans_as_the_pool_did_when_it_was_taken():
    """`AssistantPool.snapshot` / `restore` (a benchmark's repeated runs start from one learned state): after a
    restore the same request costs the same clock time and drafts the same tokens as the first run from that
    state, though a run in between taught the pool more (and would plan otherwise)."""
    target, prompts, plain, refs = case(batch=2)
    clock = CostClock()
    cost = table(STRUCTURES["avx512_bf16"])  # where what the pool learned moves its plans
    clock.hook(target, cost)
    drafter = Scripted(refs, [0.7, 0.2])
    pool = hf_spin.AssistantPool([drafter], profile=profile_of(cost, [None], ["scripted"]))

    def timed_run():
        drafter.rng = random.Random(0)  # the drafter's own randomness, outside the pool's learned state
        start = clock.now
        out = run(target, prompts, pool, clock)
        assert torch.equal(out, plain)
        return round(clock.now - start, 9), [row.drafted for row in pool.last_stats.rows]

    run(target, prompts, pool, clock)  # something learned before the snapshot
    snapshot = pool.snapshot()
    first = timed_run()
    learned_more = timed_run()
    pool.restore(snapshot)
    assert timed_run() == first != learned_more
    pool.restore(snapshot)  # one snapshot restores again
    assert timed_run() == first


def test_a_kept_verification_price_follows_every_observation():
    """`ForwardCost.verify` keeps its answers (the planner asks tens of thousands a run) only until the next
    observation, which moves them, and apart per rows and width setting."""
    cost = ForwardCost.from_table({1: 0.1, 8: 0.1})
    before = cost.verify(8)
    assert cost.verify(8) == before and cost.verify(8, rows=4) == before  # no per-row cost yet
    cost.observe(8, 1, 0.3)
    assert cost.verify(8) > before
    cost.per_row = 0.01
    assert cost.verify(8, rows=4) == pytest.approx(cost.verify(8) + 0.03)


def test_the_bound_that_skips_ranking_never_changes_a_plan(monkeypatch):
    """`Planner._nothing_pays` answers most steps of a drafter that is rarely right without ranking every slot: it
    must only ever skip where `_best_prefix` finds nothing. 400 random cases (jagged target and drafter grids,
    host work, model drafters and model-free ones, before and after drafting, padded rows and packed ones): `_best`
    plans the same with the bound as without it, and the bound decides a sixth of them (a quarter of those where
    nothing pays: it is loose where verification grows with its positions)."""
    # prompt lookup (free) on a row it copies, a draft model on one it does not: the cheap drafter's row pays
    planner = Planner(profile_of(table(flat), [None, table(lambda n: 0.05)], ["lookup", "model"]))
    assert planner._best([[0.9, 0.8, 0.7, 0.6], [0.1]], [(0,), (1,)], True, [{0: 0.0}, {1: 0.0}]) == [4, 0]
    rng = random.Random(0)
    decided, plain, bound = 0, 0, Planner._nothing_pays
    for case_ in range(400):
        knots = [1, 2, 4, 8, 16]
        target = ForwardCost.from_table({n: rng.uniform(0.05, 0.1) * (1 + rng.uniform(0, 1) * n / 8) for n in knots})
        drafters = [
            None if rng.random() < 0.3 else ForwardCost.from_table({n: rng.uniform(0.001, 0.06) for n in knots})
            for _ in range(2)
        ]
        planner = Planner(profile_of(target, drafters, ["a", "b"]))
        planner.profile.observe_host(4, DRAFTING, rng.uniform(0, 0.02))
        for d in range(2):
            planner.profile.calls[d].add(rng.uniform(0, 0.01))
        B = rng.choice([1, 2, 4])
        chosen = [tuple(rng.sample([0, 1], rng.choice([1, 2]))) for _ in range(B)]
        curves = []
        for _ in range(B):
            survival, curve = 1.0, []
            for _ in range(rng.randint(0, 8)):
                survival *= rng.uniform(0.0, 0.9) if case_ % 2 else rng.uniform(0.0, 0.3)
                curve.append(survival)
            curves.append(curve)
        catch_up = [{d: rng.uniform(0, 0.05) for d in ds} for ds in chosen] if rng.random() < 0.5 else None
        padded = rng.random() < 0.5
        with_bound = planner._best(curves, chosen, padded, catch_up)
        monkeypatch.setattr(Planner, "_nothing_pays", lambda *args: False)
        assert planner._best(curves, chosen, padded, catch_up) == with_bound, case_
        monkeypatch.setattr(Planner, "_nothing_pays", bound)
        decided += bound(planner, curves, chosen, catch_up is not None)
        plain += not any(with_bound)
    assert decided >= 50, (decided, plain)  # 67 of the 275 plain plans


def test_the_engines_own_work_a_step_shrugs_off_a_stall():
    """`CostProfile.observe_host`: a step's own work, plain and drafting apart, per batch-size bucket. A stall (a
    garbage collection, a call's first step) moves it by a bounded amount, and never seeds it: the first
    observations answer with their least, then their median seeds the mean."""
    profile = CostProfile(ForwardCost.from_table({1: 0.1}), [], [])
    assert profile.host_seconds(1, DRAFTING) == 0.0
    profile.observe_host(1, PLAIN, 0.040)  # a first step doing lazy set-up
    profile.observe_host(1, PLAIN, 0.001)
    assert profile.host_seconds(1, PLAIN) == pytest.approx(0.001)
    for _ in range(20):
        profile.observe_host(1, PLAIN, 0.001)
        profile.observe_host(4, DRAFTING, 0.004)
    assert profile.host_seconds(1, PLAIN) == pytest.approx(0.001)
    profile.observe_host(1, PLAIN, 0.025)
    assert profile.host_seconds(1, PLAIN) < 0.0012
    assert profile.host_seconds(1, DRAFTING) == 0.0 and profile.host_seconds(5, DRAFTING) == pytest.approx(0.004)
    assert profile.plain_seconds(1) == pytest.approx(0.1 + profile.host_seconds(1, PLAIN))
