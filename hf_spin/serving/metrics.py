"""Prometheus metrics of one server (`GET /metrics`, text format), in a registry of its own.

Requests and tokens are counted as they happen; per-drafter counts are read from the engine's
statistics at scrape time (a custom collector), so there is one source of truth for them:

    hf_spin_requests_total{route, status}            status: ok, cancelled, error, rejected, invalid
    hf_spin_prompt_tokens_total, hf_spin_generated_tokens_total
    hf_spin_queue_depth, hf_spin_batch_size          requests waiting / rows decoding (gauges)
    hf_spin_step_batch_size                          rows per engine step (histogram)
    hf_spin_step_seconds                             engine step latency (histogram)
    hf_spin_request_seconds, hf_spin_time_to_first_token_seconds   per request (histograms)
    hf_spin_drafter_{drafted,accepted}_tokens_total{drafter}, hf_spin_drafter_steps_total{drafter},
    hf_spin_drafter_failures_total{drafter}
    hf_spin_drafter_acceptance_rate{drafter}         accepted / drafted since start
    hf_spin_drafter_mean_accepted_length{drafter}    tokens per target forward on the rows it served
    hf_spin_micro_batches                            micro-batches of the pipeline (1 without it)
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..stats import DrafterStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (seconds) from a tiny model's milliseconds to a 1.5B model's CPU steps.
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _DrafterCollector:
    """Per-drafter counts: those of engines already replaced plus the live engine's, read at scrape time."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        totals = self.metrics.drafter_totals()
        families = {
            "drafted": CounterMetricFamily(
                "hf_spin_drafter_drafted_tokens", "draft tokens verified", labels=["drafter"]
            ),
            "accepted": CounterMetricFamily(
                "hf_spin_drafter_accepted_tokens", "draft tokens accepted by the target", labels=["drafter"]
            ),
            "steps": CounterMetricFamily(
                "hf_spin_drafter_steps", "row-steps the drafter served (target forwards)", labels=["drafter"]
            ),
            "failures": CounterMetricFamily(
                "hf_spin_drafter_failures", "drafter calls that raised", labels=["drafter"]
            ),
            "rate": GaugeMetricFamily(
                "hf_spin_drafter_acceptance_rate", "accepted / drafted since start", labels=["drafter"]
            ),
            "length": GaugeMetricFamily(
                "hf_spin_drafter_mean_accepted_length",
                "tokens per target forward on the rows it served",
                labels=["drafter"],
            ),
        }
        for name, d in totals.items():
            families["drafted"].add_metric([name], d.drafted)
            families["accepted"].add_metric([name], d.accepted)
            families["steps"].add_metric([name], d.target_forwards)
            families["failures"].add_metric([name], d.failures)
            families["rate"].add_metric([name], d.acceptance_rate)
            families["length"].add_metric([name], d.mean_accepted_length)
        yield from families.values()


class Metrics:
    def __init__(self, engine_stats=None):
        """engine_stats: () -> {drafter name: DrafterStats} of the live engine."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hf_spin_requests", "requests by route and outcome", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("hf_spin_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("hf_spin_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("hf_spin_queue_depth", "requests waiting for a row", registry=r)
        self.batch_size = Gauge("hf_spin_batch_size", "rows decoding", registry=r)
        self.step_batch = Histogram(
            "hf_spin_step_batch_size", "rows per engine step", buckets=BATCH_BUCKETS, registry=r
        )
        self.step_seconds = Histogram("hf_spin_step_seconds", "engine step latency", buckets=STEP_BUCKETS, registry=r)
        self.request_seconds = Histogram(
            "hf_spin_request_seconds", "request latency, queue included", buckets=REQUEST_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "hf_spin_time_to_first_token_seconds",
            "time to first token, queue included",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.micro_batches = Gauge(
            "hf_spin_micro_batches", "micro-batches of the pipeline (1 without pipelining)", registry=r
        )
        self.micro_batches.set(1)
        self.engine_stats = engine_stats or (lambda: {})
        self._retired: dict[str, DrafterStats] = {}
        self._lock = threading.Lock()
        r.register(_DrafterCollector(self))

    def observe_step(self, seconds: float, rows: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_batch.observe(rows)

    def set_load(self, queued: int, running: int) -> None:
        self.queue_depth.set(queued)
        self.batch_size.set(running)

    def retire_engine(self, engine) -> None:
        """Keep the counts of an engine being replaced."""
        with self._lock:
            _add(self._retired, getattr(engine, "drafter_stats", {}))

    def drafter_totals(self) -> dict[str, DrafterStats]:
        with self._lock:
            totals: dict[str, DrafterStats] = {}
            _add(totals, self._retired)
            _add(totals, self.engine_stats())
            return totals

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _add(into: dict[str, DrafterStats], stats: dict[str, DrafterStats]) -> None:
    for name, d in stats.items():
        into.setdefault(name, DrafterStats()).merge(d)
