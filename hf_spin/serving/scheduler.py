"""The scheduler: one thread that owns the engine, admits queued requests between steps and hands each
request's tokens to the coroutine waiting for them.

    HTTP handlers (event loop)            scheduler thread
    submit(job) ──▶ queue (bounded) ──▶   engine.add ─ step ─ step ─ ...
    job.events() ◀── Tokens / Finished ◀── after every step: new tokens of every row, rows that ended

At most `max_batch_size` rows decode together, and the requests joining in one step pad to at most
`max_batch_prefill_tokens` prompt tokens (rows x longest prompt; TGI's option of that name), so a
burst of long prompts joins over several steps instead of stalling every running row behind one
huge prefill; up to `max_queue` more requests wait; beyond that
`submit` raises `Overloaded` (the server answers 503 with Retry-After). A job cancelled by its client
(a disconnect) leaves the batch at the next step. A fault the engine cannot pin on a row fails the rows
running then, and the scheduler goes on with a fresh engine. `drain` refuses new work and lets running
and queued requests finish for a grace period, then cancels what is left; `stop` also ends the thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from time import perf_counter, time

import torch

from ..step.rows import CANCELLED, Request, Row

logger = logging.getLogger(__name__)

# How long the thread sleeps when idle before looking at its queue again (it is also woken at once).
IDLE_WAIT_SECONDS = 0.5
SHUTDOWN_MESSAGE = "the server is shutting down; this request was cancelled"


class Overloaded(RuntimeError):
    """The queue is full (or the server is shutting down): try again later."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Tokens:
    """New tokens of a job since the last event."""

    ids: list[int]
    logprobs: list[float]


@dataclass
class Finished:
    """The job is over: its last tokens, and why it ended (`rows.LENGTH`, `STOPPED`, `CANCELLED`, `ERROR`)."""

    row: Row | None  # None: it never ran (cancelled in the queue, or the server stopped)
    reason: str
    error: str | None = None
    ids: list[int] = field(default_factory=list)  # tokens not sent in an earlier Tokens event
    logprobs: list[float] = field(default_factory=list)


class Job:
    """One request on its way through the scheduler; its events are read on the event loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.row: Row | None = None
        self.cancelled = False
        self.cancel_reason: str | None = None
        self.submitted_at = perf_counter()
        self.created = int(time())
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.emitted = 0  # tokens already sent as events

    def cancel(self, reason: str | None = None) -> None:
        """The client went away (or the server is stopping): the row leaves at the next step (or never joins)."""
        self.cancel_reason = self.cancel_reason or reason
        self.cancelled = True

    def _send(self, event) -> None:  # scheduler thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    async def events(self):
        """Tokens events, then one Finished."""
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, Finished):
                return


class Scheduler:
    """Runs an engine (`SpinEngine` or `Pipeline`) on its own thread for many concurrent requests.

    make_engine: () -> a fresh engine (called at start and after a fault that poisoned the engine).
    max_batch_size: rows decoding together.
    max_batch_prefill_tokens: prompt tokens (rows joining in one step x the longest of their prompts) one
        step may prefill; a longer prompt still joins, alone.
    max_queue: requests waiting for a row beyond those; more are refused with `Overloaded`.
    metrics: a `Metrics` or None.
    threads: torch intra-op threads for the scheduler thread (None: leave torch's setting).
    """

    def __init__(
        self,
        make_engine,
        max_batch_size: int = 16,
        max_queue: int = 64,
        metrics=None,
        threads: int | None = None,
        retry_after: int = 1,
        max_batch_prefill_tokens: int = 4096,
    ):
        if max_batch_size < 1 or max_queue < 0 or max_batch_prefill_tokens < 1:
            raise ValueError(
                f"need max_batch_size >= 1, max_queue >= 0 and max_batch_prefill_tokens >= 1, got {max_batch_size}, "
                f"{max_queue} and {max_batch_prefill_tokens}"
            )
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.make_engine = make_engine
        self.engine = make_engine()
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics
        self.threads = threads
        self.retry_after = retry_after
        self._queue: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._wake = threading.Condition()
        self._accepting = True
        self._drain_at: float | None = None  # draining: perf_counter deadline after which every job is cancelled
        self._exit = False  # stop(): end the thread once nothing runs
        self._thread: threading.Thread | None = None
        self.engines_replaced = 0  # engines dropped after a fault

    # -- event-loop side --------------------------------------------------------------------------
    def submit(self, request: Request) -> Job:
        """Queue a request; raises `Overloaded` when the queue is full or the server is stopping."""
        job = Job(request, asyncio.get_running_loop())
        with self._wake:
            if not self._accepting:
                raise Overloaded("the server is shutting down", self.retry_after)
            if len(self._queue) + len(self._running) >= self.max_batch_size + self.max_queue:
                raise Overloaded(
                    f"the queue is full ({self.max_batch_size} requests decoding, {len(self._queue)} waiting, "
                    f"limit {self.max_queue} waiting; --max-queue)",
                    self.retry_after,
                )
            self._queue.append(job)
            self._wake.notify()
        return job

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hf_spin-scheduler", daemon=True)
            self._thread.start()

    def drain(self, grace_seconds: float) -> None:
        """Begin shutting down: refuse new requests; running and queued ones may finish for
        `grace_seconds`, then each is cancelled (its client gets a last event saying so). Returns at once."""
        with self._wake:
            self._accepting = False
            deadline = perf_counter() + grace_seconds
            self._drain_at = deadline if self._drain_at is None else min(self._drain_at, deadline)
            self._wake.notify()

    def stop(self, grace_seconds: float = 0.0) -> None:
        """`drain`, wait until nothing runs, and end the thread."""
        self.drain(grace_seconds)
        with self._wake:
            self._exit = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- scheduler thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        with torch.no_grad():
            while self._loop_once():
                pass
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001
            logger.exception("closing the engine at shutdown raised")

    def _loop_once(self) -> bool:
        with self._wake:
            while not self._queue and not self._running and not self._exit:
                self._wake.wait(IDLE_WAIT_SECONDS)
            if self._exit and not self._queue and not self._running:
                return False
            if self._drain_at is not None and perf_counter() >= self._drain_at:
                for job in self._queue:
                    job.cancel(SHUTDOWN_MESSAGE)
                for job in self._running:
                    job.cancel(SHUTDOWN_MESSAGE)
            admitted = self._admit()
        for job in admitted:
            if job.cancelled:
                self._finish(job, None, CANCELLED, job.cancel_reason)
                continue
            job.row = self.engine.add(job.request)
            job.admitted_at = perf_counter()
            self._running.append(job)
        for job in self._running:
            if job.cancelled:
                self.engine.cancel(job.row)
        if self._running:
            self._step()
        if self.metrics is not None:
            self.metrics.set_load(len(self._queue), len(self._running))
        return True

    def _admit(self) -> list[Job]:
        """Queued jobs that join at the next step: within max_batch_size rows and the prefill budget
        (joining rows x their longest prompt); cancelled jobs leave the queue at once. Holds the lock."""
        admitted: list[Job] = []
        joining, widest = 0, 0
        while self._queue:
            job = self._queue[0]
            if not job.cancelled:
                width = max(widest, len(job.request.prompt))
                if len(self._running) + joining >= self.max_batch_size:
                    break
                if joining and (joining + 1) * width > self.max_batch_prefill_tokens:
                    break
                joining, widest = joining + 1, width
            admitted.append(self._queue.popleft())
        return admitted

    def _step(self) -> None:
        start = perf_counter()
        try:
            self.engine.step()
        except Exception as err:  # noqa: BLE001 - a fault no row could be blamed for: fail those running, go on
            logger.exception(
                "engine step failed; failing the %d running requests and starting a fresh engine", len(self._running)
            )
            message = f"{type(err).__name__}: {err}"
            for job in self._running:
                if not job.row.done:
                    job.row.fail(message)
            self._publish()
            self._replace_engine()
            return
        if self.metrics is not None:
            self.metrics.observe_step(perf_counter() - start, len(self._running))
            self.metrics.micro_batches.set(getattr(self.engine, "micro_batches", 1) or 1)
        self._publish()

    def _publish(self) -> None:
        """Send each running job its new tokens; finish jobs whose row is done."""
        still = []
        now = perf_counter()
        for job in self._running:
            row = job.row
            ids, logprobs = row.generated[job.emitted :], row.logprobs[job.emitted :]
            job.emitted = len(row.generated)
            if ids and job.first_token_at is None:
                job.first_token_at = now
            if row.done:  # the last tokens travel with the end, so a stream knows which token is last
                self._finish(job, row, row.finish_reason, row.error or job.cancel_reason, ids, logprobs)
            else:
                if ids:
                    job._send(Tokens(ids, logprobs))
                still.append(job)
        self._running = still
        if self.metrics is not None:
            self.metrics.set_load(len(self._queue), len(self._running))

    def _finish(self, job: Job, row: Row | None, reason: str, error: str | None = None, ids=(), logprobs=()) -> None:
        job.finished_at = perf_counter()
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(row.generated) if row is not None else 0)
        job._send(Finished(row, reason, error, list(ids), list(logprobs)))

    def _replace_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001
            logger.exception("closing the faulty engine raised")
        if self.metrics is not None:
            self.metrics.retire_engine(self.engine)
        self.engine = self.make_engine()
        self.engines_replaced += 1
        self._running = []
