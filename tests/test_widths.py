"""Verification at a cheaper width (hf_spin/step/widths.py, `ForwardCost.width`): where the cost profile says a
wider forward costs less (a CPU's slow small-M GEMM), a step's chunks are filled out with filler tokens to it.
Lossless (greedy identity with plain `generate` on every layout), the forward runs at the width priced, and the
planner, pricing it, drafts where it pays: on injected costs, so the decision is tested on machines we lack."""

from __future__ import annotations

import pytest
import torch

import hf_spin
from benchmarks.injected_costs import CostClock, profile_of, table
from hf_spin.cache.forward import FILLER_TOKEN as F
from hf_spin.drafters.base import Draft
from hf_spin.planning.cost_profile import CLEAR_CHECKS, WIDENED, WIDTH_CHECKS
from hf_spin.step.widths import widen

from .archs import EOS
from .test_planning import Scripted, case, run


def small_gemm(n: float) -> float:
    """t(N): a plain step 0.1 s; 2-15 positions a slow small GEMM (3 steps), 16 and more a packed one (1.5)."""
    return 0.1 if n <= 1 else 0.3 if n < 16 else 0.15 + 0.001 * (n - 16)


def test_widen_fills_each_row_after_its_tokens_within_its_room():
    assert widen([[5, 6], [7]], 8, [4, 4], packed=False) == [[5, 6, F, F], [7, F, F, F]]
    assert widen([[5, 6], [7]], 8, [4, 3], packed=False) is None  # row 1 may verify 3 tokens at most
    assert widen([[5, 6], [7]], 7, [8, 8], packed=False) is None  # not a multiple of the rows
    assert widen([[5, 6], [7]], 3, [1, 1], packed=False) == [[5, 6], [7]]  # already there
    # packed: the rows with the most room first, never past a row's room
    assert widen([[5, 6], [7]], 6, [2, 5], packed=True) == [[5, 6], [7, F, F, F]]
    assert widen([[5, 6], [7]], 6, [3, 3], packed=True) == [[5, 6, F], [7, F, F]]
    assert widen([[5, 6], [7]], 9, [3, 3], packed=True) is None


@pytest.mark.parametrize("batch,cache", [(1, "rectangular"), (4, "rectangular"), (4, "packed")])
def test_a_widened_verification_commits_what_plain_generate_does_and_pays(batch, cache):
    """On `small_gemm` every verification of 2-15 positions widens to 16: the output is plain `generate`'s, the
    forwards ran at 16 positions, and drafting at 70% acceptance beats plain decoding by far, where verifying at
    the drafts' own width (3 plain steps) would barely pay."""
    new_tokens = 60
    target, prompts, plain, refs = case(batch=batch, new_tokens=new_tokens)
    clock = CostClock()
    cost = table(small_gemm)
    clock.hook(target, cost)
    shapes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    profile = profile_of(cost, [None], ["scripted"])
    pool = hf_spin.AssistantPool([Scripted(refs, [0.7] * batch)], profile=profile, cache=cache)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    positions = [rows * width for rows, width in shapes]
    # widened (until a row's room is under 16 tokens; at batch 4 on padded rows the planner drafts past 16);
    # packed at batch 4 a plain step widens too (4 positions cost 3 plain steps, 16 cost 1.5): no forward runs below
    # 16 positions until the rows' rooms bind in the last steps: once their rooms hold fewer than 16 positions, at
    # most 4 steps remain (each commits a token a row), and the rooms never grow back
    if batch == 1:
        assert positions.count(16) >= 3, shapes
    elif cache == "packed":
        narrow = [i for i, p in enumerate(positions[1:], 1) if p < 16]
        assert narrow == list(range(len(positions) - len(narrow), len(positions))) and len(narrow) <= 4, shapes
    spin = clock.now
    start = clock.now
    target.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS)
    assert spin < (clock.now - start) / 1.5, f"{spin:.2f}s against plain {clock.now - start:.2f}s"


def test_the_static_layout_verifies_at_its_own_query_bucket_and_prices_it_there():
    """On the static layout the forward runs at its sticky query bucket, whatever the profile: widening would
    compile a wider graph (a CUDA graph capture) and keep it for every later step. Priced as run: at N. Here 2-15
    positions cost 1.5 plain steps and 16 cost 1.2: drafting pays at the bucket, and 16 would be cheaper still."""
    new_tokens = 30
    target, prompts, plain, refs = case(batch=1, new_tokens=new_tokens)
    clock = CostClock()
    cost = table(lambda n: 0.1 if n <= 1 else 0.15 if n < 16 else 0.12)
    clock.hook(target, cost)
    widths = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    profile = profile_of(cost, [None], ["scripted"])
    pool = hf_spin.AssistantPool([Scripted(refs, [0.9])], profile=profile, cache="static", compile=False)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    assert max(widths[1:]) <= 9 and len(set(widths[1:]) - {1}) == 1, widths  # drafted, at one bucket
    assert not profile.target.widens and profile.verify_seconds(1, 5) == profile.target.predict(5)


class Mute(Scripted):
    """A drafter with nothing to propose (prompt lookup without a match): every step is plain."""

    def draft(self, request):
        return Draft(tokens=[[] for _ in request.rows], q=[None] * len(request.rows))


def plain_steps(cache: str, cost, read=None, clock: CostClock | None = None, new_tokens: int = 30):
    """A call where nothing is drafted (`Mute`), every forward lasting `cost` on the clock, the pool's profile
    `read` (default: `cost`): asserts its output is plain `generate`'s and returns (pool, each forward's width,
    the call's seconds, plain `generate`'s seconds on the same clock)."""
    target, prompts, plain, refs = case(batch=1, new_tokens=new_tokens)
    clock = clock or CostClock()
    clock.hook(target, cost)
    widths = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    profile = profile_of(read or cost, [None], ["scripted"])
    pool = hf_spin.AssistantPool([Mute(refs, [0.0])], profile=profile, cache=cache)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin, start, ran = clock.now, clock.now, list(widths)  # the call's own forwards
    with clock.installed():
        target.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS
        )
    return pool, ran, spin, clock.now - start


@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_a_plain_step_runs_at_a_cheaper_width_too(cache):
    """Where one position costs more than two (an AVX-512 bf16 CPU: a GEMV slower than a small GEMM; AMD EPYC,
    1.5B, bf16: 192 / 172 ms), a plain step is filled out to two: with nothing drafted, once three plain steps at each
    width have confirmed the grid's fall (`CLEAR_CHECKS`: one position ran 18% dearer each time), every decoding
    forward runs at two positions, the output is plain `generate`'s and it took 13% less."""
    pool, widths, spin, plain = plain_steps(cache, table(lambda n: 0.2 if n <= 1 else 0.17 + 0.01 * (n - 2)))
    assert pool.last_stats.drafters["scripted"].drafted == 0
    checks = 2 * CLEAR_CHECKS
    assert widths[1 : 1 + checks] == [1, 2] * CLEAR_CHECKS, widths  # narrow first, in turns
    assert set(widths[1 + checks : -1]) == {2}, str(widths)  # the last step's row has no room for a filler
    assert spin < 0.89 * plain, f"{spin:.2f}s against plain {plain:.2f}s"


@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_a_fall_the_grid_read_by_noise_is_checked_by_the_steps_themselves(cache):
    """A float32 grid on an AMX Xeon read one / two positions at 355 / 348 ms where they run 269 / 290 (an earlier
    grid's reading): trusting it, every plain step ran two positions, 8% dearer, and the default pool ran 0.91-1.02x
    plain `generate` with nothing drafted. The plain steps take turns at the two widths until each has run
    `WIDTH_CHECKS` times, then run at the one that ran cheaper: within 1% of plain `generate`."""
    cost = table(lambda n: 0.269 if n <= 1 else 0.290 if n <= 2 else 0.767 * n / 8)
    read = table(lambda n: 0.355 if n <= 1 else 0.348 if n <= 2 else 0.954 * n / 8)  # the grid's noisy reading
    _, widths, spin, plain = plain_steps(cache, cost, read)
    assert set(widths[1 + 2 * WIDTH_CHECKS : -1]) == {1}, widths
    assert spin < 1.01 * plain, f"{spin:.2f}s against plain {plain:.2f}s"


@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_a_plain_step_widens_only_where_its_rollback_leaves_a_saving(monkeypatch, cache):
    """Flat forwards, the wider one 3% cheaper (a GPU's launch-bound step read through a few percent of noise), and
    a widened step's rollback of its fillers costing 10% of a step of the engine's own work: the first plain step
    widens, the profile learns what a widened step costs beyond its forward (`CostProfile.host_seconds`, WIDENED),
    and every later one runs at one position a row. Priced by its forward alone, every step would widen and the
    call run 7% slower than plain `generate`."""
    from hf_spin.cache.packed import PackedCache
    from hf_spin.cache.rectangular import RectangularCache

    rollback_seconds, clock = 0.01, CostClock()
    for layout in (RectangularCache, PackedCache):
        rollback = layout.rollback

        def costly_rollback(self, keep, rollback=rollback):  # the engine's own work, on the clock
            clock.now += rollback_seconds
            return rollback(self, keep)

        monkeypatch.setattr(layout, "rollback", costly_rollback)
    pool, widths, spin, plain = plain_steps(cache, table(lambda n: 0.1 if n <= 1 else 0.097), clock=clock)
    assert widths[1:-1].count(2) <= 1 and set(widths[1:-1]) <= {1, 2}, widths
    assert pool.cost_profile.host_seconds(1, WIDENED) >= rollback_seconds
    assert spin < 1.01 * plain, f"{spin:.2f}s against plain {plain:.2f}s"


@pytest.mark.parametrize("three", [0.3, 0.22])
def test_a_batch_that_lost_a_row_runs_beside_a_filler_row_where_fewer_rows_cost_more(three):
    """Float32 on an AMD EPYC: a linear layer over 3 positions costs 1.5x one over 4 (a GEMV a row against a GEMM);
    after one row of four ended, three rows' plain steps ran 1.2 s against four rows' 0.85 s, and the default pool
    0.86x plain `generate`, which keeps every row. Here 3 positions cost `three` seconds and 4 cost 0.2 s, which the
    profile (its grid times one row, at 1, 2, 4, 8 positions) cannot tell: once three-row plain steps have run
    CLEAR_CHECKS times each clearly dearer (0.3 s), else WIDTH_CHECKS times (0.22 s: 10% may be a stall), each runs
    beside a filler row, the output is plain `generate`'s, and the call loses only those checks."""
    cost = table(lambda n: 0.1 if n <= 1 else three if n == 3 else 0.2, knots=(1, 2, 3, 4, 8))
    read = table(lambda n: 0.1 if n <= 1 else 0.2, knots=(1, 2, 4, 8))
    target, prompts, _, refs = case(batch=4, new_tokens=30)
    P = prompts.shape[1]
    ends = [  # (row, its token at step j) that ends row `row` there and no other row: its EOS
        (b, refs[b][P + j])
        for b in range(4)
        for j in range(6, 14)
        if refs[b][P + j] not in refs[b][P : P + j]
        and all(refs[b][P + j] not in refs[o][P:] for o in range(4) if o != b)
    ]
    assert ends, "no token ends one row alone"
    row, eos = ends[0]
    gen = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    clock = CostClock()
    clock.hook(target, cost)
    shapes = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    with clock.installed():
        plain = target.generate(prompts, **gen)
    plain_seconds, start = clock.now, clock.now
    shapes.clear()
    pool = hf_spin.AssistantPool([Mute(refs, [0.0] * 4)], profile=profile_of(read, [None], ["scripted"]))
    with clock.installed():
        out = target.generate(prompts, **gen, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, plain)
    rows = [b for b, _ in shapes[1:]]  # each decoding forward's rows
    first, checks = rows.index(3), CLEAR_CHECKS if three > 0.2 * 1.3 else WIDTH_CHECKS
    assert rows[first : first + checks] == [3] * checks and checks >= 2, rows  # one run may be a stall's
    assert set(rows[first + checks :]) == {4}, rows  # the rest beside a filler row
    lost = checks * (three - 0.2)
    assert clock.now - start == pytest.approx(plain_seconds + lost), (clock.now - start, plain_seconds)
