"""The cost profile: what a forward of each model costs on the machine in front of us, measured.

Speculation pays only where verifying k + 1 tokens costs much less than k + 1 plain steps, and that
is a property of the machine, the dtype and the thread count, not of the model: on a CPU with AMX
(or a GPU) a bf16 forward over 8 tokens costs about one over 1 token; on an AVX2-only CPU it costs
6x (docs/planning.md#why). So the planner never assumes: it reads this profile.

One `ForwardCost` per model (the target and each model drafter), on its own device and dtype:

    t(N, B) = f(N) + r (B - 1)         N = token positions in the forward (rows x new tokens), B = rows

f is piecewise linear between measured knots N = 1, 2, 4, 8, ... (linear beyond the last, by its
last slope), r a per-row overhead (fitted from a batch-4 point). Measured on a small grid within a
time budget (`grid.measure`; on the static compiled layout through the compiled fixed-shape forward the engine
runs, at its query widths), cached on disk (`profiling.py`), then refined online from every timed forward:
log(measured / grid) as a shift shared by every knot plus each knot's own deviation from it, shrunk toward
none by KNOT_WEIGHT pseudo-observations, each surprise clipped to +-`MAX_LOG_RESIDUAL` so a stall (another
process, a page fault) moves it by a bounded amount. A forward far past the grid becomes a knot at what it
took: measured on this machine as it runs now, it takes no shift (the grid's correction). The context is
GRID_CONTEXT positions of random KV, not a grid axis (its cost is small next to the weights' at the lengths
drafting sees, and a prefill per point would overrun the budget on a slow machine): its drift as rows grow,
and the engine's own cost around a forward, move every knot alike, and most steps are plain, so the shift
carries what one knot learns to the others (docs/planning.md, "The cost profile").
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .estimates import DecayedMean, bucket, geometric_tokens

# Forgetting factor of the online correction per observation at a knot: ~50 observations of memory.
CORRECTION_DECAY = 0.98
# A residual is clipped to +-this in log seconds before it enters the correction: a 2.7x stall moves
# the correction by at most 1/50 of that, while a real change of the cost is followed in ~20 forwards.
MAX_LOG_RESIDUAL = 1.0
# Pseudo-observations of the shared shift behind each knot's own correction: a knot observed a few times
# keeps its own shape (2-3 tokens on a slow GEMM path), one never observed moves with the shift. Per knot
# alone, the plain steps' knot followed a 700-token RAG prompt (AMD EPYC, bf16: 1 token 0.20 -> 0.26 s)
# while 8 tokens stayed at the grid's 0.23 s, and an 8-token draft looked cheaper than a plain step.
KNOT_WEIGHT = 4.0
# A verification at a width the grid did not measure is priced at its interpolation times this when it is
# weighed against a measured wider knot (`ForwardCost.width`): the unmeasured width's true cost is a guess.
UNMEASURED_PREMIUM = 1.05
# Forwards at one width off the knots (not past twice the last: those are knots at once) after which, where each
# of them cost more than the profile priced N at before them by OFF_GRID_SURPRISE (or each less by as much), N becomes
# a knot at the median of what they took (`ForwardCost._watch_off_grid`). Between knots a CPU's cost is jagged: an AMD
# EPYC in float32 ran the 1.5B target over 1 / 2 / 3 / 4 / 8 positions in 389 / 840 / 1211 / 829 / 843 ms, where a
# grid of 1, 2 and 8 interpolates 3 positions at 841 (a batch of three rows' plain step, a two-token draft's check).
OFF_GRID_RUNS = 3
OFF_GRID_SURPRISE = 1.15


@dataclass
class ForwardCost:
    """Seconds of one forward of one model: t(N, B) = f(N) + r (B - 1), refined online.

    knots: [K] token positions N measured, increasing; seconds: [K] f at each knot; per_row: r.
    encoder: seconds of the model's own encoder over one row (an encoder-decoder drafter runs it before
        its first catch-up of a row); 0 for a model without one.
    widens: whether a verification may run at a wider knot (`width`). The pool sets it False on the static
        layout, whose forward runs at its own sticky query bucket: a wider one is another compiled graph
        (a CUDA graph capture), kept for every later step.
    grid: [K] whether each knot is the grid's (or given); the others were learned online (`observe`).
    """

    knots: list[int]
    seconds: list[float]
    per_row: float = 0.0
    encoder: float = 0.0
    observations: int = 0  # online observations so far
    widens: bool = True
    grid: list[bool] = field(default_factory=list)  # [K] the grid's knot, else learned online (empty: all the grid's)
    shift: DecayedMean = field(default_factory=lambda: DecayedMean(CORRECTION_DECAY))  # log(measured / grid)
    corrections: list[DecayedMean] = field(default_factory=list)  # [K] a knot's log(measured / grid) - shift
    _values: list[float] | None = field(
        default=None, repr=False, compare=False
    )  # `values()` until the next observation
    _verified: dict = field(default_factory=dict, repr=False, compare=False)  # `verify`'s answers for `_values`
    # N -> (f(N) as priced before them, seconds of the forwards at a width off the knots), until OFF_GRID_RUNS of them
    _off_grid: dict[int, tuple[float, list[float]]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if not self.knots or len(self.knots) != len(self.seconds) or sorted(set(self.knots)) != list(self.knots):
            raise ValueError(
                f"ForwardCost needs increasing knots with one time each, got {self.knots} / {self.seconds}"
            )
        if not self.corrections:
            self.corrections = [DecayedMean(CORRECTION_DECAY) for _ in self.knots]
        self.grid = self.grid or [True] * len(self.knots)

    @classmethod
    def from_table(cls, table: dict[int, float], per_row: float = 0.0) -> ForwardCost:
        """From {N: seconds} (injected costs in tests, or a profile read from disk)."""
        knots = sorted(table)
        return cls(knots, [float(table[n]) for n in knots], per_row)

    def values(self) -> list[float]:
        """[K] f at each knot with its online correction (the shared shift and the knot's own deviation, shrunk by
        KNOT_WEIGHT), as measured: not made non-decreasing, since a forward over more positions can cost less (one
        over 2-3 tokens runs a CPU's slow small-M GEMM, one over 8 a packed one); `width` runs a verification at such
        a knot. Kept until the next observation: the planner reads it for every draft slot."""
        if self._values is None or len(self._values) != len(self.knots):
            self._verified.clear()  # priced with the values before
            shift = self.shift.mean or 0.0
            prior = KNOT_WEIGHT if self.shift.weight > 0 else 0.0  # no shift learned (a drafter's): the knot's own
            self._values = [
                s * math.exp(self._shift_of(i, shift) + (c.mean or 0.0) * c.weight / (c.weight + prior or 1.0))
                for i, (s, c) in enumerate(zip(self.seconds, self.corrections))
            ]
        return self._values

    def _shift_of(self, knot: int, shift: float) -> float:
        """The shared shift as it applies to knot index `knot`: the grid's knots take it; a knot learned online
        was measured as the machine runs now, so the shift (learned mostly after it: a prefill precedes the steps
        that teach the shift) would count this hour's speed twice (an AVX2 Xeon in float32, a cached grid 1.5x
        fast: a 51-token prefill that took 1.6 s read 2.4 s, and similar prompts were split into two prefills)."""
        return shift if self.grid[knot] else 0.0

    def _interpolate(self, values: list[float], n_tokens: float) -> float:
        """Linear between knots, by the last slope beyond the last (0 where the knots end falling: the
        measured values are not made non-decreasing; proportional to N with one knot), flat below the first."""
        ks = self.knots
        if n_tokens <= ks[0]:
            return values[0]
        if len(ks) == 1:
            return values[0] * n_tokens / ks[0]
        if n_tokens >= ks[-1]:
            return values[-1] + max(values[-1] - values[-2], 0.0) / (ks[-1] - ks[-2]) * (n_tokens - ks[-1])
        i = bisect.bisect_left(ks, n_tokens)
        slope = (values[i] - values[i - 1]) / (ks[i] - ks[i - 1])
        return values[i - 1] + slope * (n_tokens - ks[i - 1])

    def _weights(self, n_tokens: float) -> list[tuple[int, float]]:
        """The knots bracketing N with linear-interpolation weights (one knot outside the range)."""
        ks = self.knots
        if n_tokens <= ks[0]:
            return [(0, 1.0)]
        if n_tokens >= ks[-1]:
            return [(len(ks) - 1, 1.0)]
        i = bisect.bisect_left(ks, n_tokens)
        w = (n_tokens - ks[i - 1]) / (ks[i] - ks[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def predict(self, n_tokens: float, rows: int = 1) -> float:
        """Seconds of a forward over `n_tokens` positions in `rows` rows, with the online correction."""
        return self._interpolate(self.values(), n_tokens) + self.per_row * max(rows - 1, 0)

    def width(self, n_tokens: int, rows: int = 1) -> int:
        """Positions to run a verification over `n_tokens` positions in `rows` rows at: the cheapest of N itself
        and the wider knots (multiples of `rows`, so rows padded alike reach them). N off the knots is priced at
        its interpolation times UNMEASURED_PREMIUM: between knots a CPU's cost is jagged (whisper-base's decoder,
        AMD EPYC, float32: 28 / 47 / 62 / 43 / 41 / 44 / 64 / 45 ms for 1-8 tokens; M = 3 mod 4 runs a slow GEMM
        path), so a measured knot a little dearer than the line through its neighbours is the safer width. The
        added positions are filler tokens after each row's real ones (`step/widths.py`): causal attention keeps
        them from the real tokens' logits, and the rollback drops them."""
        if not self.widens:
            return n_tokens
        values = self.values()
        measured = dict(zip(self.knots, values))
        cost = measured[n_tokens] if n_tokens in measured else self._interpolate(values, n_tokens) * UNMEASURED_PREMIUM
        best = n_tokens
        for knot, seconds in measured.items():
            if knot > n_tokens and knot % rows == 0 and seconds < cost:
                cost, best = seconds, knot
        return best

    def verify(self, n_tokens: int, rows: int = 1) -> float:
        """Seconds of a verification forward over `n_tokens` positions in `rows` rows, at its `width`. Kept until
        the next observation: the planner and the policies price every draft slot (and `break_even` every k at
        every acceptance) with it, tens of thousands of calls a run."""
        key = (n_tokens, rows, self.widens, self.per_row)  # what else the answer reads (a new knot clears it)
        self.values()  # recomputed after an observation, which clears what was kept
        seconds = self._verified.get(key)
        if seconds is None:
            seconds = self._verified[key] = self.predict(self.width(n_tokens, rows), rows)
        return seconds

    def floor(self, rows: int = 1) -> float:
        """The least a forward over `rows` rows may cost, at any positions: the cheapest knot (between knots the cost
        is interpolated, past the last it does not fall) and the per-row overhead (`Planner._best`'s bound)."""
        return min(self.values()) + self.per_row * max(rows - 1, 0)

    def bound(self, n_tokens: float) -> float:
        """Seconds of a forward over `n_tokens` positions in one row, read pessimistically past the last knot:
        growing by at least the grid's mean slope (first to last knot) from there. A grid that ends flat (a
        slow machine's short grid: an AMD EPYC in float32 costs the same for 2 and 8 tokens) would otherwise
        price a 700-token catch-up at one forward; its 0.5B drafter's catch-ups of four RAG prompts then cost
        tens of seconds where the planner expected one, and the default pool ran 0.86x plain at batch 4."""
        first, last = self.knots[0], self.knots[-1]
        if n_tokens <= last:  # inside the grid, the grid
            return self.predict(n_tokens)
        values = self.values()
        mean_slope = (values[-1] - values[0]) / (last - first) if last > first else values[0] / first
        return max(self.predict(n_tokens), self.predict(last) + mean_slope * (n_tokens - last))

    def observe(self, n_tokens: float, rows: int, seconds: float, shared: bool = True) -> None:
        """A timed forward: its log(measured / grid), the surprise over the prediction clipped, moves the shared
        shift (`shared`: a forward timed alone at the positions it ran) and the deviation of the knots around N.
        Far beyond the last knot (more than twice it: a long catch-up, a big batch) the forward becomes a knot of
        its own at what it took, since past the grid the cost is an extrapolation (a grid flat to 8 positions
        reads a compute-bound 150-token catch-up at one forward's cost); so what is learned at large N does not
        bend the cost of the small N the grid measured, and the positions between are interpolated. A width off
        the knots nearer them becomes a knot once its forwards agree that the interpolation is wrong there
        (`_watch_off_grid`)."""
        if seconds <= 0 or n_tokens <= 0:
            return
        extra = self.per_row * max(rows - 1, 0)
        self._values = None
        self.observations += 1
        if self.learns(n_tokens):
            self._add_knot(math.ceil(n_tokens), seconds - extra)
            return
        self._watch_off_grid(n_tokens, seconds - extra)
        predicted = self.predict(n_tokens, rows)
        surprise = max(-MAX_LOG_RESIDUAL, min(MAX_LOG_RESIDUAL, math.log(seconds / predicted)))
        # log(measured / grid) of the forward's f(N), with the surprise clipped
        grid = self._interpolate(self.seconds, n_tokens)
        observed = math.log(max(predicted * math.exp(surprise) - extra, 1e-3 * grid) / grid)
        if shared:
            self.shift.add(observed)
        shift = self.shift.mean or 0.0
        for i, w in self._weights(n_tokens):
            self.corrections[i].add(observed - self._shift_of(i, shift), w)
        self._values = None  # `predict` above kept the values from before this observation

    def _add_knot(self, n_tokens: int, seconds: float) -> None:
        """A knot learned online at `n_tokens` positions, at the seconds its forwards took: as measured, so it takes
        no shift (`_shift_of`) and starts with no deviation of its own."""
        i = bisect.bisect_left(self.knots, n_tokens)
        self.corrections.insert(i, DecayedMean(CORRECTION_DECAY))  # each list before knots: a reader indexes by knots
        self.grid.insert(i, False)
        self.seconds.insert(i, max(seconds, 1e-6))
        self.knots.insert(i, n_tokens)
        self._values = None

    def _watch_off_grid(self, n_tokens: float, seconds: float) -> None:
        """Keep the seconds of a forward at a whole width N off the knots; at OFF_GRID_RUNS of them, make N a knot at
        their median where each cost more than f(N) as priced before the first of them by OFF_GRID_SURPRISE (or each
        less by as much), then forget them. Every run must agree: a stall makes one run dearer, rarely three. Read
        against the price before them, not the prediction: N's own forwards move the shared shift and the knots
        beside N, so the prediction follows them, and every knot with it."""
        if n_tokens != int(n_tokens) or n_tokens in self.knots:
            return
        watched = self._off_grid.get(int(n_tokens))
        if watched is None:  # the price before the first run, read once
            watched = self._off_grid[int(n_tokens)] = (self._interpolate(self.values(), n_tokens), [])
        priced, runs = watched
        runs.append(seconds)
        if len(runs) < OFF_GRID_RUNS:
            return
        del self._off_grid[int(n_tokens)]
        if min(runs) > OFF_GRID_SURPRISE * priced or max(runs) * OFF_GRID_SURPRISE < priced:
            self._add_knot(int(n_tokens), sorted(runs)[len(runs) // 2])

    def learns(self, n_tokens: float) -> bool:
        """Whether a forward over `n_tokens` positions lies so far past the knots (more than twice the last) that
        `observe` makes it a knot of its own."""
        return n_tokens > 2 * self.knots[-1]

    def flatness(self, n_tokens: int) -> float:
        """t(N) / t(1) of a verification (at its `width`): 1 where it is free (memory-bound), N where it is
        proportional."""
        return self.verify(n_tokens) / self.predict(1)

    def to_dict(self) -> dict:
        return {
            "knots": list(self.knots),
            "seconds": list(self.seconds),
            "per_row": self.per_row,
            "encoder": self.encoder,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ForwardCost:
        return cls(
            list(data["knots"]), list(data["seconds"]), float(data.get("per_row", 0.0)), float(data.get("encoder", 0.0))
        )


class StepWork:
    """The engine's own seconds a step of one kind (`CostProfile.host_seconds`), robust to stalls: a step's own work
    is a floor plus positive noise (a garbage collection, another process's slice, a call's first step doing lazy
    set-up: 40 ms against 1-2 ms, AMD EPYC), so the first SEED observations answer with their least, then their
    median seeds a decayed mean, each later one clipped to within e (`MAX_LOG_RESIDUAL`) of it, as a forward's
    surprise is."""

    SEED = 3

    def __init__(self):
        self.first: list[float] = []
        self.mean = DecayedMean(CORRECTION_DECAY)
        self.seconds = 0.0  # the estimate, read ~80 times a step

    def add(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        if len(self.first) < self.SEED:
            self.first.append(seconds)
            if len(self.first) < self.SEED:
                self.seconds = min(self.first)
                return
            seconds = sorted(self.first)[self.SEED // 2]
        else:
            bound = math.exp(MAX_LOG_RESIDUAL)
            seconds = min(max(seconds, self.seconds / bound), self.seconds * bound)
        self.mean.add(seconds)
        self.seconds = self.mean.mean


# Plain steps a profile runs at each of two widths (one position a row, and the wider knot the grid read as cheaper)
# before it widens them, each width then read at the median of its runs: the grid's reading of a fall may be its
# noise, and a widened step never measures the narrow width again (`CostProfile.plain_width`).
WIDTH_CHECKS = StepWork.SEED
# ... unless it is clear sooner: a width whose first CLEAR_CHECKS runs each cost more than the other's estimate by
# CLEARLY_DEARER is settled then (`clearly_dearer`). Each check of the dearer width costs what it is dearer by: after a
# row of four ended (float32, AMD EPYC), each three-row check ran 1.17 s against four rows' 0.80 s, three of them
# 3.6% of a 31 s call. A stall makes one run dearer, rarely two in a row by 15%.
CLEAR_CHECKS = 2
CLEARLY_DEARER = 1.15


def clearly_dearer(work: StepWork, rival: float, own: float = 0.0) -> bool:
    """Whether every run of `work` so far, with `own` seconds beside each, cost more than `rival` seconds by
    CLEARLY_DEARER (a stall makes a run dearer, never cheaper, so its least run is the fair reading)."""
    return min(work.first) + own > CLEARLY_DEARER * rival


# The kinds of step whose own work (`CostProfile.host_seconds`) is learned apart: a plain step at one position a
# row, one widened to a cheaper width (`ForwardCost.width`: its fillers rolled back after), and one that drafted.
PLAIN, WIDENED, DRAFTING = "plain", "widened", "drafting"

# A drafter whose break-even per-token acceptance (`CostProfile.break_even`) is above this cannot
# pay on this machine in practice: the planner never drafts with it, and a pool left with none
# decodes plainly after saying so once. Same-family draft models reach 0.6-0.8 on chat and code.
CANNOT_PAY = 0.9


@dataclass
class CostProfile:
    """The costs of one pool on one target: the target's `ForwardCost` and, per drafter (pool
    order), a model drafter's `ForwardCost` or None for a model-free drafter, whose seconds per call
    are learned online. `machine`, `dtype`, `threads`, `source`: what it was measured on, and how
    (measured, read from a cache file, injected)."""

    target: ForwardCost
    drafters: list[ForwardCost | None]
    names: list[str]
    machine: str = ""
    dtype: str = ""
    threads: int = 0
    source: str = "injected"
    max_k: int = 16
    calls: list[DecayedMean] = field(default_factory=list)  # [num_drafters] seconds per call of a model-free drafter
    other_dtypes: dict[str, ForwardCost] = field(
        default_factory=dict
    )  # the target in other dtypes, where a cache file knows it
    # (batch-size bucket, step kind) -> the engine's own seconds a step (`observe_host`); learned online, never saved
    host: dict[tuple[int, str], StepWork] = field(default_factory=dict)
    # (rows, positions) -> seconds of the plain steps' forwards run there (`observe_verify`, `plain_width`)
    plain_forwards: dict[tuple[int, int], StepWork] = field(default_factory=dict)

    def __post_init__(self):
        if not self.calls:
            self.calls = [DecayedMean(CORRECTION_DECAY) for _ in self.drafters]

    # -- what a step costs ---------------------------------------------------------------------------
    def verify_seconds(self, rows: int, n_tokens: float) -> float:
        """A step verifying `n_tokens` positions in `rows` rows: the target's forward (at its `ForwardCost.width`)
        and the engine's own work around it (`host_seconds`, a drafting step's where n_tokens > rows)."""
        return self.target.verify(n_tokens, rows) + self.host_seconds(rows, DRAFTING if n_tokens > rows else PLAIN)

    def plain_seconds(self, rows: int) -> float:
        """A plain step: one position a row, or at a wider width where the whole step is cheaper there
        (`plain_width`), and the engine's own work around it."""
        return self._plain(rows)[0]

    def plain_width(self, rows: int) -> int:
        """The positions a plain step of `rows` rows runs over: a cheaper width of the target's (`ForwardCost.width`:
        on an AVX-512 bf16 CPU two positions cost less than one) where the widened step, its own work included
        (its fillers rolled back after), costs less than the narrow one; else one a row. Its forward alone would
        decide on a few percent of noise where the forwards are flat (a GPU's launch-bound step).
        The grid's reading of a fall is one measurement, and once widened the narrow width is never measured again
        (online observations at the wide knot move the shared shift, not the narrow knot's own deviation): an AMX
        Xeon's grid read 355 / 348 ms for one / two positions in float32 where an earlier grid read 269 / 290, and
        every plain step ran two positions, the default pool 0.91-1.02x plain `generate` with nothing drafted. So
        the two widths take turns, narrow first, until each has run WIDTH_CHECKS plain steps (CLEAR_CHECKS where one
        ran clearly dearer), and then the cheaper of the two as they ran, each step's own work included, is kept
        (docs/planning.md, "Verification width")."""
        wide = self.target.width(rows, rows) if self._plain(rows)[1] else rows
        if wide == rows:
            return rows
        ran = [self.plain_forwards.get((rows, n)) for n in (rows, wide)]  # [narrow, wide]
        counts = [len(work.first) if work is not None else 0 for work in ran]
        if min(counts) < WIDTH_CHECKS:
            if min(counts) >= CLEAR_CHECKS:  # each step's own work included, as below
                own = self.host_seconds(rows, PLAIN), self.host_seconds(rows, WIDENED)
                if clearly_dearer(ran[0], ran[1].seconds + own[1], own[0]):
                    return wide
                if clearly_dearer(ran[1], ran[0].seconds + own[0], own[1]):
                    return rows
            return rows if counts[0] <= counts[1] else wide
        narrow = ran[0].seconds + self.host_seconds(rows, PLAIN)
        return wide if ran[1].seconds + self.host_seconds(rows, WIDENED) < narrow else rows

    def plain_rows(self, rows: int) -> int:
        """The rows a plain step of `rows` rows runs its forward over: `rows`, or more (filler rows beside them:
        `SpinEngine._filler_rows`) where plain steps of that many rows ran cheaper, each read as the steps ran
        (`plain_forwards`, WIDTH_CHECKS of them at least, `rows` itself first, or CLEAR_CHECKS where each ran clearly
        dearer). Never from the grid, which times one row: a batch that loses a row meets a row count it never ran
        (docs/planning.md, "Filler rows")."""
        narrow = self.plain_forwards.get((rows, rows))
        if narrow is None or len(narrow.first) < CLEAR_CHECKS:
            return rows
        best, cost = rows, narrow.seconds
        for (more, positions), work in self.plain_forwards.items():
            if more == positions > rows and len(work.first) >= WIDTH_CHECKS and work.seconds < cost:
                best, cost = more, work.seconds
        if len(narrow.first) < WIDTH_CHECKS and not clearly_dearer(narrow, cost):
            return rows
        return best

    def _plain(self, rows: int) -> tuple[float, bool]:
        """(seconds of a plain step, whether it widens)."""
        forward = self.target.predict(rows, rows)
        narrow = forward + self.host_seconds(rows, PLAIN)
        wide = self.target.verify(rows, rows)  # at its cheapest width, rows itself where no wider one is cheaper
        if wide < forward and (wide := wide + self.host_seconds(rows, WIDENED)) < narrow:
            return wide, True
        return narrow, False

    def host_seconds(self, rows: int, kind: str) -> float:
        """The engine's own seconds in a step of `rows` rows of `kind` (PLAIN, WIDENED or DRAFTING), beyond the
        target's forward and the drafters' calls (planning, merging drafts, the verdict, committing, rolling back,
        learning): measured online (`observe_host`, `StepWork`), 0 before. Next to a forward on a CPU it is noise;
        on a GPU, whose captured 1.5B step takes 4-5 ms, a drafting step's few milliseconds of Python decide
        whether a draft pays, and a widened plain step's rollback whether widening does."""
        work = self.host.get((bucket(rows), kind))
        return work.seconds if work is not None else 0.0

    def observe_host(self, rows: int, kind: str, seconds: float) -> None:
        """A step of `rows` rows of `kind` spent `seconds` outside the target's forward and the drafters."""
        self.host.setdefault((bucket(rows), kind), StepWork()).add(seconds)

    def least_draft_seconds(self, drafter: int) -> float:
        """The least one forward of `drafter` may cost (0 for a model-free drafter, whose call may be free)."""
        cost = self.drafters[drafter]
        return cost.floor() if cost is not None else 0.0

    def draft_seconds_for_rows(self, drafter: int, forwards: float, rows: int) -> float:
        """`drafter` drafting for `rows` rows (not row tokens: `CostModel.draft_seconds` takes those) in
        `forwards` sequential forwards, one per draft token, each over one new position per row.
        A model-free drafter: its mean seconds per call, whatever the arguments."""
        cost = self.drafters[drafter]
        if cost is None:
            return self.calls[drafter].mean or 0.0
        return forwards * cost.predict(rows, rows) if forwards > 0 and rows > 0 else 0.0

    def observe_verify(self, rows: int, n_tokens: int, seconds: float, plain: bool = False) -> None:
        """A verification forward over `n_tokens` positions in `rows` rows took `seconds`; `plain`: a plain step's
        (nothing drafted, at one position a row or widened), which `plain_width` compares by the width it ran at."""
        self.target.observe(n_tokens, rows, seconds)
        if plain:
            self.plain_forwards.setdefault((rows, n_tokens), StepWork()).add(seconds)

    def observe_prefill(self, rows: int, positions: int, seconds: float) -> None:
        """A prefill forward over `rows` rows, `positions` in all with their padding, took `seconds`: learned only
        as a new knot of the target's (`ForwardCost.learns`), the cost of long forwards the grid cannot say and
        prefill groups are priced by (`prefill.py`). Nearer the grid it would move what the steps taught: a
        prefill has no context. Not told on the static layout, whose prefill runs eagerly and steps compiled."""
        if self.target.learns(positions):
            self.target.observe(positions, rows, seconds, shared=False)

    def observe_draft(self, drafter: int, forwards: int, rows: int, seconds: float) -> None:
        """A drafter's call: `forwards` forwards over `rows` rows (0 forwards: it did not draft)."""
        cost = self.drafters[drafter]
        if cost is None:
            self.calls[drafter].add(seconds)
        elif forwards > 0 and rows > 0:  # a call's own work and its first forward's catch-up inside: its knot alone
            cost.observe(rows, rows, seconds / forwards, shared=False)

    def observe_catch_up(self, drafter: int, positions: int, seconds: float) -> None:
        """A model drafter's catch-up: one forward over `positions` positions (a padded cache's rows at the
        longest lag), with what the drafter does around it (a translating drafter's tokenizers). The grid
        measures forwards of at most a few dozen positions; this is how a drafter's long catch-ups are learned
        (a 0.5B drafter's 70-token catch-up, priced from a grid flat to 8 tokens at 0.18 s, ran 0.71 s: AMD EPYC,
        bf16)."""
        cost = self.drafters[drafter]
        if cost is not None and positions > 1:
            cost.observe(positions, 1, seconds, shared=False)

    # -- what it means -------------------------------------------------------------------------------
    def best_rate(self, drafter: int, acceptance: float, target: ForwardCost | None = None) -> tuple[float, int]:
        """(tokens per second, k) of the best draft length at batch 1 for a constant per-token acceptance."""
        return _best_rate(acceptance, self._step_seconds(drafter, target or self.target))

    def _step_seconds(self, drafter: int, target: ForwardCost) -> list[float]:
        """[max_k] seconds of a batch-1 step drafting k = 1, 2, ... tokens with `drafter` and verifying them."""
        return [target.verify(k + 1) + self.draft_seconds_for_rows(drafter, k, 1) for k in range(1, self.max_k + 1)]

    def break_even(self, drafter: int, target: ForwardCost | None = None) -> tuple[float, int] | None:
        """(a, k): the lowest per-token acceptance (to 0.01) at which drafting with `drafter` beats a
        plain step at batch 1, and the k that does it; None if not even a = 0.99 does. Every k's expected
        tokens grow with a, so the best rate does: a bisection over the grid (a scan priced 99 x max_k steps,
        7.6 ms a judgement under the profiler, a GPU step and more)."""
        target = target or self.target
        plain, seconds = 1.0 / target.predict(1), self._step_seconds(drafter, target)
        grid = [x / 100 for x in range(1, 100)]
        first = bisect.bisect_left(grid, True, key=lambda a: _best_rate(a, seconds)[0] > plain)
        return (grid[first], _best_rate(grid[first], seconds)[1]) if first < len(grid) else None

    def pays(self, drafter: int) -> bool:
        """Whether `drafter` can pay on this machine in practice (break-even acceptance <= CANNOT_PAY)."""
        even = self.break_even(drafter)
        return even is not None and even[0] <= CANNOT_PAY

    def outlook(self) -> str:
        """One line: speculate or plain, and why, from the measured costs."""
        t = self.target
        costs = (
            f"target {t.predict(1) * 1e3:.0f} ms / {t.predict(8) * 1e3:.0f} ms for 1 / 8 tokens ({t.flatness(8):.1f}x)"
        )
        paying = [
            f"{n} above acceptance {e[0]:.2f} (k = {e[1]})"
            for d, n in enumerate(self.names)
            if (e := self.break_even(d)) is not None and e[0] <= CANNOT_PAY
        ]
        if paying:
            return f"speculate: {costs}; pays with " + ", ".join(paying)
        plain = f"plain: speculation cannot pay here in {self.dtype or 'this dtype'} ({costs})"
        better = [
            dt
            for dt, cost in self.other_dtypes.items()
            if any(
                (e := self.break_even(d, cost)) is not None and e[0] <= CANNOT_PAY for d in range(len(self.drafters))
            )
        ]
        return plain + (f"; it would in {', '.join(better)} (measured here)" if better else "")

    def __str__(self) -> str:
        t = self.target
        lines = [f"cost profile ({self.source}; {self.machine}, {self.dtype})"]
        lines.append("| model | " + " | ".join(f"N={n}" for n in t.knots) + " | per row | t(8)/t(1) | online |")
        lines.append("|---|" + "---|" * (len(t.knots) + 3))
        for name, cost in [("target", t)] + list(zip(self.names, self.drafters)):
            if cost is None:
                mean = self.calls[self.names.index(name)].mean
                lines.append(
                    f"| {name} | model-free: "
                    f"{'%.2f ms a call' % (mean * 1e3) if mean is not None else 'not measured yet'} |"
                )
                continue
            cells = [f"{cost.predict(n) * 1e3:.1f} ms" for n in t.knots]
            lines.append(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {cost.per_row * 1e3:.2f} ms | {cost.flatness(8):.2f} | {cost.observations} |"
            )
        if self.host:
            host = [
                f"{kind} {1 << b}+ rows {work.seconds * 1e3:.2f} ms" for (b, kind), work in sorted(self.host.items())
            ]
            lines.append("engine's own work a step (host_seconds): " + ", ".join(host))
        lines.append(self.outlook())
        return "\n".join(lines)

    __repr__ = __str__


def _best_rate(acceptance: float, seconds: list[float]) -> tuple[float, int]:
    """(tokens per second, k) of the best draft length for a per-token acceptance, a step drafting k tokens
    taking seconds[k - 1]."""
    return max((geometric_tokens(acceptance, k) / s, k) for k, s in enumerate(seconds, start=1))
