"""Injected costs: a clock that only forwards move, and the cost structures of machines you may not have.

A `CostClock` stands in for the engine's clock: every forward of a hooked model advances it by that model's
injected cost (t(N) over the N positions it ran), nothing else does. So the engine times what the injected costs
say, the cost profile's online refinement sees them, and a run's clock total is what the run would take on a
machine with those costs. The tests of the planner (tests/test_planning.py, tests/test_exploration.py) and the
replay on cost structures (benchmarks/replay/costs.py) run on it; docs/planning.md says why decisions are tested
this way. `pace` is the wall clock's counterpart: every forward of a hooked model lasts its injected cost in real
time, so the host's own work counts beside it (a GPU's forwards, waited on by this CPU's host).
"""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager
from typing import Callable

from hf_spin.planning.cost_profile import CostProfile, ForwardCost

# The modules that read `perf_counter` to time forwards and drafting (what a `CostClock` replaces).
TIMED_MODULES = ("hf_spin.step.engine", "hf_spin.step.admission", "hf_spin.step.faults")

# t(N), seconds of a target forward over N positions (a plain step = 0.1 s), on the machines hf_spin meets:
# flat (a GPU, an AMX CPU), AVX-512 bf16 (8 tokens ~1.3 steps), AVX2 float32 (~1.8), AVX2 bf16 (~6: linear), and
# float32 where 2-3 tokens run a slow small GEMM, dearer than 8 (an AMD EPYC: Qwen2.5-Coder-0.5B 1 / 2 / 8 tokens
# at 1 / 2.2 / 1.8 steps, whisper-base's decoder 1 / 1.7 / 1.6; docs/planning.md, "Verification width").
STRUCTURES: dict[str, Callable[[float], float]] = {
    "flat": lambda n: 0.1,
    "avx512_bf16": lambda n: 0.1 * (1 + 0.3 * (n - 1) / 7),
    "avx2_fp32": lambda n: 0.1 * (1 + 0.8 * (n - 1) / 7),
    "avx2_bf16": lambda n: 0.1 * (0.3 + 0.7 * n),
    "small_gemm_fp32": lambda n: 0.1 if n <= 1 else 0.1 * (2.1 if n < 4 else 1.6 + 0.04 * (n - 4)),
}


class CostClock:
    """A clock that only forwards move: each hooked model's forward adds cost.predict(N, rows)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def hook(self, model, cost: ForwardCost):
        """Charge every forward of `model` (input_ids [B, T]: B x T positions in B rows). Returns the hook's
        handle (`.remove()` undoes it)."""

        def advance(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.now += cost.predict(ids.numel(), ids.shape[0])

        return model.register_forward_pre_hook(advance, with_kwargs=True)

    @contextmanager
    def installed(self):
        """Within the block, the engine reads this clock instead of `time.perf_counter`."""
        modules = [importlib.import_module(name) for name in TIMED_MODULES]
        saved = [m.perf_counter for m in modules]
        for m in modules:
            m.perf_counter = self
        try:
            yield self
        finally:
            for m, original in zip(modules, saved):
                m.perf_counter = original


# `pace` sleeps until this many seconds before a forward's end and spins the rest (a sleep overshoots by ~0.1 ms).
SPIN_SECONDS = 3e-4


class Overrun:
    """Seconds the paced forwards' own work ran past their injected cost, summed (`pace`): time a device with
    those costs would not have taken (a stand-in's prefill over hundreds of positions on this CPU)."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def pace(model, cost: ForwardCost, overrun: Overrun | None = None) -> list:
    """Make every forward of `model` (input_ids [B, T]) last cost.predict(B x T, B) seconds of wall time (longer
    only where its own work takes longer, by what `overrun` adds up): a device whose forwards cost what `cost`
    says, waited on by a real host. Unlike a `CostClock`, the host's own work (the engine's, `generate`'s loop)
    counts as it runs. Returns the hooks' handles (`.remove()` each to undo)."""
    due = []  # the ends of the forwards in flight (a stack: a forward may run inside another's hooks)

    def begin(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        due.append(time.perf_counter() + cost.predict(ids.numel(), ids.shape[0]))

    def wait(module, args, kwargs, out):
        end = due.pop()
        left = end - time.perf_counter()
        if left > SPIN_SECONDS:  # sleep to near the end, then spin: a sleep alone overshoots
            time.sleep(left - SPIN_SECONDS)
        elif left < 0 and overrun is not None:
            overrun.seconds -= left
        while time.perf_counter() < end:
            pass

    return [
        model.register_forward_pre_hook(begin, with_kwargs=True),
        model.register_forward_hook(wait, with_kwargs=True),
    ]


def table(fn: Callable[[float], float], knots=(1, 2, 4, 8, 16, 32, 64)) -> ForwardCost:
    """A `ForwardCost` with fn(N) at each knot."""
    return ForwardCost.from_table({n: fn(n) for n in knots})


def profile_of(target_cost: ForwardCost, drafters: list[ForwardCost | None], names: list[str]) -> CostProfile:
    """An injected `CostProfile` (copies: the planner's online corrections never move the clock's costs)."""
    copy = [ForwardCost.from_dict(c.to_dict()) if c is not None else None for c in drafters]
    return CostProfile(ForwardCost.from_dict(target_cost.to_dict()), copy, names)
