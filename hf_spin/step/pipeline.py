"""Pipelined speculation (Spin, Minions): the running batch is split into micro-batches ("lanes") so
that drafting one overlaps verifying another.

    drafting thread:   draft A | draft B | draft A | draft B | ...
    result pool:            [A]       [B]       [A]                (holds at most one drafted micro-batch)
    target thread:               verify A | verify B | verify A | ...

Each lane is a whole `SpinEngine` with its own target cache and its own copies of the drafters (they
share the models), so every lane is lossless on its own and no cache is touched by two threads: a lane
is either with the drafting thread (plan, idle-drafter catch-up, drafts) or with the target thread
(prefill of joining rows, verification, commit, retirement). The result pool between them is a queue
of one: the drafting thread pauses (back-pressure) while it already holds a drafted micro-batch the
target has not taken. The shared policy is called under a lock.

`step()` (on the caller's thread, the target thread) verifies one micro-batch. New rows join the
least-loaded of the first m lanes, m chosen by `MicroBatchCount` (Spin's heuristic: split further
while throughput does not drop) or fixed; rows never move between lanes, so a new m takes effect as
rows come and go. On CPU the two threads share the cores the models' own matmuls already use, so the
overlap gains little; the mechanism is there for drafters and target on different devices (CUDA
streams: a drafter on a GPU drafts on a stream of its own, ordered against the target's by `_Streams`).
"""

from __future__ import annotations

import copy
import queue
import threading
from contextlib import nullcontext
from time import perf_counter

import torch

from ..policies.micro_batches import MicroBatchCount
from ..pool import AssistantPool
from ..stats import DrafterStats, GenerationStats
from .engine import Proposal, SpinEngine
from .faults import Faults
from .rows import Request, Row

# Most micro-batches the heuristic may try.
MAX_MICRO_BATCHES = 8


class _LockedPolicy:
    """The pool's policy, shared by every lane, one call at a time."""

    def __init__(self, policy):
        self.policy = policy
        self.lock = threading.Lock()

    def plan(self, view):
        with self.lock:
            return self.policy.plan(view)

    def update(self, feedback):
        with self.lock:
            return self.policy.update(feedback)

    def start_rows(self, view, rows):
        with self.lock:
            return self.policy.start_rows(view, rows)

    def end_rows(self, row_ids):
        with self.lock:
            return self.policy.end_rows(row_ids)


class _Streams:
    """CUDA stream ordering between the target thread and the drafting thread, which drafts on a side
    stream of the drafters' GPU (`stream`; None without one: then every method is a no-op and the CPU
    runs the same code).

    A lane changes hands through the queues; the work it enqueued on its GPU streams goes with it as
    events (`mark` on the giving thread, `wait` on the taking thread's current streams):
      target -> drafting  after prefill, verification and commit: the drafting stream waits before it
                          drafts (a drafter sharing the target's model copies the target's fresh KV);
      drafting -> target  after the drafts: the target's streams wait before verifying, and each q
                          (made on the drafting stream, read on the target's) is recorded on the
                          target's stream, so the allocator does not give its memory back to the
                          drafting stream while verification may still read it.
    Drafter calls the target thread makes itself (rows retired or admitted) run on the drafting stream
    too (`run`), fenced both ways, so that drafter state is only ever allocated on that stream.
    """

    def __init__(self, stream=None, devices=(), cuda=torch.cuda):
        self.stream = stream  # the drafting stream, or None
        self.devices = list(devices)  # every CUDA device the target and the drafters use
        self.cuda = cuda

    @classmethod
    def for_models(cls, model, drafters) -> "_Streams":
        models = [model] + [d.model for d in drafters if getattr(d, "model", None) is not None]
        devices = list(dict.fromkeys(m.device for m in models if m.device.type == "cuda"))
        draft_device = next(
            (
                d.model.device
                for d in drafters
                if getattr(d, "model", None) is not None and d.model.device.type == "cuda"
            ),
            None,
        )
        if draft_device is None:  # no drafter on a GPU: both threads share the default streams
            return cls()
        return cls(torch.cuda.Stream(device=draft_device), devices)

    def drafting(self):
        """The drafting thread's context: its work goes to the drafting stream."""
        return self.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def mark(self) -> list | None:
        """Events after everything this thread enqueued so far on its current stream of each device."""
        if self.stream is None:
            return None
        events = []
        for device in self.devices:
            event = self.cuda.Event()
            event.record(self.cuda.current_stream(device))
            events.append(event)
        return events

    def wait(self, events: list | None, proposal: Proposal | None = None) -> None:
        """This thread's current streams wait for `events`; the proposal's q tensors are recorded on them."""
        if self.stream is None or events is None:
            return
        for device in self.devices:
            stream = self.cuda.current_stream(device)
            for event in events:
                stream.wait_event(event)
        for q in proposal.qs if proposal is not None else ():
            if q is not None and q.device.type == "cuda":
                q.record_stream(self.cuda.current_stream(q.device))

    def run(self, fn):
        """fn() on the drafting stream, from any thread: the drafting stream first waits for the calling
        thread's work (the KV a drafter may copy), and the caller's stream then waits for fn's (so memory
        the caller frees next is not reused under fn's kernels)."""
        if self.stream is None:
            return fn()
        current = self.cuda.current_stream(self.stream.device)
        if current == self.stream:  # the drafting thread, already there
            return fn()
        self.stream.wait_stream(current)
        try:
            with self.cuda.stream(self.stream):
                return fn()
        finally:
            current.wait_stream(self.stream)


class _LaneFaults(Faults):
    """A lane's fault policy with every drafter call on the drafting stream (`_Streams.run`)."""

    def __init__(self, isolate: bool, streams: _Streams):
        super().__init__(isolate)
        self.streams = streams

    def drafter(self, scope, d_idx, fn, *args, **kwargs):
        return super().drafter(scope, d_idx, lambda: self.streams.run(fn), *args, **kwargs)

    def rebuild(self, scope, d_idx: int) -> bool:
        return self.streams.run(lambda: super(_LaneFaults, self).rebuild(scope, d_idx))


class Pipeline:
    """An engine (same interface as `SpinEngine`: add, cancel, step, has_work, close) whose micro-batches
    draft on one thread while the caller's thread verifies.

    micro_batches: a fixed number of micro-batches, or None for Spin's heuristic (`MicroBatchCount`).
    draft_threads: torch threads of the drafting thread (None: the caller's count). On a CPU the two
        threads share the cores: give each a share (OpenMP threads that outnumber cores spin and collapse).
    """

    def __init__(
        self,
        model,
        pool: AssistantPool,
        tokenizer=None,
        *,
        micro_batches: int | None = None,
        isolate_faults: bool = False,
        draft_threads: int | None = None,
    ):
        if pool is None:
            raise ValueError(
                "a Pipeline overlaps drafting with verification; it needs an AssistantPool "
                "(for plain decoding use SpinEngine(model, None))"
            )
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.bound = pool.bind(model, tokenizer)
        self.policy = _LockedPolicy(pool.policy)
        self.isolate_faults = isolate_faults
        self.count = MicroBatchCount(fixed=micro_batches, maximum=MAX_MICRO_BATCHES)
        self.lanes: list[SpinEngine] = []
        self._to_draft: queue.Queue = queue.Queue()  # lanes handed to the drafting thread (None: stop)
        self._results: queue.Queue = queue.Queue(maxsize=1)  # the result pool: (lane, proposal, error)
        self._in_flight: set[int] = set()  # ids of lanes with the drafting thread or in the result pool
        self._thread: threading.Thread | None = None
        self._threads = draft_threads or torch.get_num_threads()  # torch threads of the drafting thread
        self.streams = _Streams.for_models(model, self.bound)
        self.pool_wait_seconds = 0.0  # drafting thread time spent blocked on a full result pool (back-pressure)
        self.target_wait_seconds = 0.0  # target thread time spent waiting for a drafted micro-batch
        self.steps = 0
        self._retired_stats: dict[str, DrafterStats] = {}

    # -- the engine interface ------------------------------------------------------------------------
    def add(self, request: Request) -> Row:
        m = self.count.current
        while len(self.lanes) < m:
            self.lanes.append(self._new_lane())
        lane = min(self.lanes[:m], key=lambda e: len(e.rows) + len(e.pending))
        return lane.add(request)

    def cancel(self, row: Row) -> None:
        row.cancel_requested = True

    @property
    def has_work(self) -> bool:
        return any(lane.has_work for lane in self.lanes)

    @property
    def rows(self) -> list[Row]:
        return [r for lane in self.lanes for r in lane.rows]

    @property
    def micro_batches(self) -> int:
        """Lanes holding rows now."""
        return sum(1 for lane in self.lanes if lane.rows or lane.pending)

    @property
    def drafter_stats(self) -> dict[str, DrafterStats]:
        total: dict[str, DrafterStats] = {name: DrafterStats() for name in self.pool.names}
        for stats in [self._retired_stats] + [lane.drafter_stats for lane in self.lanes]:
            for name, d in stats.items():
                total[name].merge(d)
        return total

    @property
    def stats(self) -> GenerationStats:
        out = GenerationStats(rows=[], drafters=self.drafter_stats)
        for lane in self.lanes:
            out.verify_seconds += lane.stats.verify_seconds
            out.prefill_seconds += lane.stats.prefill_seconds
            out.steps += lane.stats.steps
        return out

    def step(self) -> None:
        """Hand lanes that can draft to the drafting thread, then verify one drafted micro-batch."""
        self._start_thread()
        # 1. Lanes with the target thread: rows leave, new rows join (prefill), then they draft.
        for lane in self.lanes:
            if id(lane) not in self._in_flight:
                self._between_steps(lane)
        self._drop_empty_lanes()
        if not self._in_flight:
            return
        # 2. Verify the micro-batch the drafting thread delivered (waiting for it if need be).
        start = perf_counter()
        lane, proposal, error, drafted = self._results.get()
        self.target_wait_seconds += perf_counter() - start
        self._in_flight.discard(id(lane))
        if error is not None:
            raise error
        self.streams.wait(drafted, proposal)  # the drafting stream's work on this lane comes first
        before = sum(len(r.generated) for r in lane.rows)
        lane.verify(proposal)
        committed = sum(len(r.generated) for r in lane.rows) - before
        self.steps += 1
        self.count.observe(committed, sum(len(x.rows) for x in self.lanes))
        # 3. Its finished rows leave and waiting rows join before it drafts again.
        self._between_steps(lane)

    def close(self) -> None:
        """Stop the drafting thread and retire every row."""
        if self._thread is not None:
            self._to_draft.put(None)
            while self._thread.is_alive():
                try:  # a drafting thread blocked on a full result pool needs room to finish
                    self._results.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None
        self._in_flight.clear()
        for lane in self.lanes:
            lane.close()

    # -- lanes -------------------------------------------------------------------------------------------
    def _new_lane(self) -> SpinEngine:
        drafters = [copy.copy(d) for d in self.bound]  # own per-row state, shared models
        lane = SpinEngine(
            self.model,
            self.pool,
            self.tokenizer,
            isolate_faults=self.isolate_faults,
            drafters=drafters,
            policy=self.policy,
            defer_idle_catch_up=True,
            run_ahead=False,
            faults=_LaneFaults(self.isolate_faults, self.streams),
        )
        return lane

    def _between_steps(self, lane: SpinEngine) -> None:
        lane.retire()
        if lane.pending:
            lane.admit()
            lane.retire()  # rows that stopped at their first token
        if lane.rows:
            self._in_flight.add(id(lane))
            self._to_draft.put((lane, self.streams.mark()))  # the target stream's work on it goes along

    def _drop_empty_lanes(self) -> None:
        """Lanes beyond the current count that emptied go away (their drafter counts are kept)."""
        keep = []
        for i, lane in enumerate(self.lanes):
            if i >= self.count.current and not lane.has_work and id(lane) not in self._in_flight:
                lane.close()
                for name, d in lane.drafter_stats.items():
                    self._retired_stats.setdefault(name, DrafterStats()).merge(d)
            else:
                keep.append(lane)
        self.lanes = keep

    # -- the drafting thread ---------------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._draft_loop, name="hf_spin-drafting", daemon=True)
            self._thread.start()

    def _draft_loop(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            handed = self._to_draft.get()
            if handed is None:
                return
            lane, verified = handed
            try:
                with self.streams.drafting():
                    self.streams.wait(verified)  # the target's work on this lane comes first
                    proposal: Proposal | None = lane.propose()
                    item = (lane, proposal, None, self.streams.mark())
            except BaseException as err:  # noqa: BLE001 - handed to the target thread, which raises it
                item = (lane, None, err, None)
            start = perf_counter()
            self._results.put(item)  # back-pressure: blocks while the pool holds a micro-batch
            self.pool_wait_seconds += perf_counter() - start
