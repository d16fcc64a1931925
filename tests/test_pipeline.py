"""Pipelined speculation: micro-batches drafted on one thread while another verifies, a result pool of
one with back-pressure, and Spin's micro-batch count heuristic. Lossless: the same tokens as plain
`generate` (greedy) and as the unpipelined engine (seeded sampling)."""

from __future__ import annotations

import time

import pytest
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_spin.drafters import Draft, Drafter
from hf_spin.policies.micro_batches import WINDOW_SECONDS, WINDOW_STEPS, MicroBatchCount
from hf_spin.stats import DrafterStats
from hf_spin.step.engine import SpinEngine
from hf_spin.step.pipeline import Pipeline
from hf_spin.step.rows import Request

from .speculation import assert_speculated
from .speculation import pool as spin_pool
from .test_engine import Wrapped, alone, prompts, request, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("policy", ["round_robin", "lbss"])
@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_pipelined_greedy_equals_plain_generate(target, drafter, micro_batches, cache, policy):
    """Lanes share one policy (LBSS: its per-request state and what ended requests taught it)."""
    pool = spin_pool([drafter, "prompt_lookup"], policy=policy, cache=cache)
    pipe = Pipeline(target, pool, micro_batches=micro_batches)
    ps = prompts(7, seed=11)
    lengths = [18, 6, 14, 20, 9, 3, 16]
    schedule = {
        0: [request(ps[i], lengths[i]) for i in range(3)],
        2: [request(ps[3], lengths[3])],
        5: [request(ps[i], lengths[i]) for i in (4, 5, 6)],
    }
    rows = run(pipe, schedule)
    for row, p, n in zip(rows, ps, lengths):
        assert row.generated == alone(target, p, n), f"row {row.id}"
    assert pipe.steps > 0
    assert_speculated(DrafterStats.total(pipe.drafter_stats.values()))
    assert pipe._thread is None  # closed


def test_pipelined_seeded_sampling_equals_the_unpipelined_engine(target, drafter):
    ps = prompts(4, seed=12)
    procs = LogitsProcessorList(
        [lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(3)]
    )  # top-3: greedy drafts are sometimes the sampled token

    def reqs():
        return {
            0: [
                Request(prompt=p, max_new_tokens=12, do_sample=True, processors=procs, seed=100 + i)
                for i, p in enumerate(ps)
            ]
        }

    pipe = Pipeline(target, spin_pool([drafter]), micro_batches=2)
    piped = run(pipe, reqs())
    plain = run(SpinEngine(target, spin_pool([drafter])), reqs())
    assert [r.generated for r in piped] == [r.generated for r in plain]
    assert_speculated(DrafterStats.total(pipe.drafter_stats.values()))


class Ticking(Drafter):
    """A fast drafter proposing nothing; counts its calls."""

    name = "ticking"
    calls = 0

    def draft(self, request):
        Ticking.calls += 1
        return Draft(tokens=[[] for _ in request.rows], q=[None] * len(request.rows))


class SlowTarget(Wrapped):
    """Every forward takes at least 20 ms (verification slower than drafting)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        time.sleep(0.02)
        return self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)


def test_result_pool_holds_one_micro_batch_and_drafting_pauses(target):
    """With verification slower than drafting, the drafting thread spends its time blocked on the full
    result pool (back-pressure) instead of running ahead; the pool never holds more than one."""
    pipe = Pipeline(SlowTarget(target), spin_pool([Ticking()]), micro_batches=3)
    rows = [pipe.add(request(p, 10)) for p in prompts(6, seed=13)]
    largest = 0
    while pipe.has_work:
        pipe.step()
        largest = max(largest, pipe._results.qsize())
        assert len(pipe._in_flight) <= 3
    pipe.close()
    assert largest <= 1 and pipe._results.maxsize == 1
    assert pipe.pool_wait_seconds > 0.05  # the drafter waited for the target, not the other way round
    assert all(r.generated == alone(target, r.request.prompt, 10) for r in rows)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def drive(
    count: MicroBatchCount, clock: FakeClock, throughput: dict[int, float], rows: int = 16, windows: int = 10
) -> None:
    """Feed `windows` windows of verification steps at the throughput each count gets."""
    for _ in range(windows):
        steps = WINDOW_STEPS * count.current
        dt = WINDOW_SECONDS / steps
        count.observe(0, rows)  # opens the window if none is open
        tokens_per_step = throughput[count.current] * dt
        for _ in range(steps):
            clock.now += dt * 1.001  # a hair over, so the window closes on its last step
            count.observe(tokens_per_step, rows)


def test_spin_heuristic_splits_while_throughput_does_not_drop():
    clock = FakeClock()
    count = MicroBatchCount(maximum=8, clock=clock)
    drive(count, clock, {1: 100.0, 2: 120.0, 3: 121.0, 4: 110.0, 5: 200.0})
    assert count.settled and count.current == 3  # 4 lost more than 5%: back to 3, never tries 5
    assert [m for m, _ in count.history][:4] == [1, 2, 3, 4]


def test_spin_heuristic_keeps_one_when_splitting_hurts_and_probes_again_when_the_batch_grows():
    clock = FakeClock()
    count = MicroBatchCount(maximum=8, clock=clock)
    drive(count, clock, {1: 100.0, 2: 80.0, 3: 150.0}, rows=4, windows=4)
    assert count.settled and count.current == 1
    drive(count, clock, {1: 100.0, 2: 130.0, 3: 150.0, 4: 90.0}, rows=8, windows=8)  # doubled: probe again
    assert count.settled and count.current == 3
    assert MicroBatchCount(fixed=2).current == 2
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        MicroBatchCount(fixed=0)
