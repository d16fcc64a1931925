"""How many micro-batches a pipeline splits the running batch into: Spin's heuristic (the decision; the
mechanism is pipeline.py).

Split further while measured throughput does not drop: start at one micro-batch, measure tokens per
second over a window, try one more, keep it if throughput held (within `tolerance`), and stop at the
last count that did not lose; probe again (from one) when the batch size has halved or doubled since
the count was settled.

Example: measured 20.0 tok/s at m = 1, 23.5 at m = 2, 22.1 at m = 3 (a 6% drop > 5% tolerance) ->
settles at m = 2.
"""

from __future__ import annotations

from time import perf_counter

# Throughput may dip this much at the next count and still count as "did not drop" (measurement noise).
DEFAULT_TOLERANCE = 0.05
# A window closes after at least this many verification steps and this many seconds.
WINDOW_STEPS = 8
WINDOW_SECONDS = 1.0
# Re-probe when the active rows changed by this factor either way since settling.
REPROBE_FACTOR = 2.0


class MicroBatchCount:
    """current: the count to use now. observe(tokens, rows) after every verification step.

    fixed: always this count (no probing); None: Spin's heuristic between 1 and `maximum`.
    """

    def __init__(
        self, fixed: int | None = None, maximum: int = 8, tolerance: float = DEFAULT_TOLERANCE, clock=perf_counter
    ):
        if fixed is not None and fixed < 1:
            raise ValueError(f"micro_batches must be >= 1, got {fixed}")
        if maximum < 1 or not 0 <= tolerance < 1:
            raise ValueError(f"need maximum >= 1 and 0 <= tolerance < 1, got {maximum} and {tolerance}")
        self.fixed = fixed
        self.clock = clock  # seconds; injectable for tests
        self.maximum = maximum
        self.tolerance = tolerance
        self.current = fixed or 1
        self.settled = fixed is not None
        self.throughput: dict[int, float] = {}  # count -> tokens/s measured while probing
        self.history: list[tuple[int, float]] = []  # every closed window: (count, tokens/s)
        self._settled_rows = 0
        self._window_start: float | None = None
        self._window_tokens = 0
        self._window_steps = 0

    def observe(self, tokens: int, rows: int) -> None:
        """A verification step committed `tokens` tokens; `rows` rows are active."""
        if self.fixed is not None:
            return
        now = self.clock()
        if self._window_start is None:
            self._window_start = now
            return
        self._window_tokens += tokens
        self._window_steps += 1
        elapsed = now - self._window_start
        if self._window_steps < WINDOW_STEPS * self.current or elapsed < WINDOW_SECONDS:
            return
        measured = self._window_tokens / elapsed
        self.history.append((self.current, measured))
        self._window_start, self._window_tokens, self._window_steps = now, 0, 0
        if self.settled:
            if rows >= self._settled_rows * REPROBE_FACTOR or rows * REPROBE_FACTOR <= self._settled_rows:
                self.settled, self.throughput, self.current = False, {}, 1  # probe again from one
            return
        self.throughput[self.current] = measured
        previous = self.throughput.get(self.current - 1)
        if previous is not None and measured < previous * (1 - self.tolerance):
            self._settle(self.current - 1, rows)  # the split cost throughput: one fewer
        elif self.current + 1 <= min(self.maximum, max(rows, 1)):
            self.current += 1  # held (or first measurement): try one more
        else:
            self._settle(self.current, rows)

    def _settle(self, count: int, rows: int) -> None:
        self.current, self.settled, self._settled_rows = count, True, rows
