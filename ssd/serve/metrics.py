"""Server-wide counters, exposed through one prometheus_client registry.

Names follow vLLM's habit (`ssd:` for request-level metrics, where vLLM has
`vllm:`) and the design's `ssd_spec_` prefix for speculation metrics.
ServerMetrics keeps the plain numbers (the Stats RPC reads them too);
`ServerCollector` turns a snapshot into metric families at scrape time, so
the HTTP /metrics endpoint and the Stats RPC's Prometheus text are one
source of truth. Each server has its own CollectorRegistry: two servers in
one process never share (or clash over) a metric.
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ssd.engine.metrics import GenerationStats, add_into
from ssd.serve.protos import enum_names

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows per engine step


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs as Prometheus wants them: cumulative, ending at +Inf."""
        out, running = [], 0
        for bound, count in zip([*map(floatToGoString, self.buckets), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass
class Counters:
    """Everything summed over finished requests (guarded by ServerMetrics' lock)."""

    requests_total: int = 0
    requests_rejected: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(enum_names("FinishReason").values(), 0))
    generation: GenerationStats = field(default_factory=lambda: GenerationStats(mode="", requests=0))
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    batch: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))


class ServerMetrics:
    """Thread-safe: handler threads count admissions, the worker counts steps and results."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = Counters()
        self.started = time.monotonic()

    def admitted(self) -> None:
        with self._lock:
            self._c.requests_total += 1

    def rejected(self) -> None:
        with self._lock:
            self._c.requests_rejected += 1

    def stepped(self, rows: int) -> None:
        """One batched engine step over `rows` requests."""
        with self._lock:
            self._c.batch.observe(rows)

    def finished(self, reason: str, stats: GenerationStats | None, ttft_s: float | None,
                 e2e_s: float, queue_s: float) -> None:
        with self._lock:
            c = self._c
            c.finished[reason] = c.finished.get(reason, 0) + 1
            c.e2e.observe(e2e_s)
            c.queue.observe(queue_s)
            if ttft_s is not None:
                c.ttft.observe(ttft_s)
                if stats is not None and stats.new_tokens > 1:  # vLLM's TPOT: the tokens after the first
                    c.tpot.observe((e2e_s - ttft_s) / (stats.new_tokens - 1))
            if stats is not None:
                add_into(c.generation, stats)

    def snapshot(self) -> Counters:
        """A consistent copy to read without the lock."""
        with self._lock:
            return copy.deepcopy(self._c)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started


Counts = Callable[[], tuple[int, int]]  # (running, waiting), read at scrape time


class ServerCollector(Collector):
    """The server's metric families, built from one snapshot per scrape."""

    def __init__(self, metrics: ServerMetrics, counts: Counts) -> None:
        self.metrics = metrics
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        running, waiting = self.counts()
        c = self.metrics.snapshot()
        yield _gauge("ssd:num_requests_running", "Requests generating now (rows in a batch, or the one alone).",
                     running)
        yield _gauge("ssd:num_requests_waiting", "Requests queued for the engine.", waiting)
        yield from _requests(c)
        yield _histogram("ssd:batch_size", "Rows per batched engine step.", c.batch)
        yield _histogram("ssd:time_to_first_token_seconds", "Arrival to first token.", c.ttft)
        yield _histogram("ssd:e2e_request_latency_seconds", "Arrival to last token.", c.e2e)
        yield _histogram("ssd:time_per_output_token_seconds",
                         "First to last token over the tokens after the first (requests of 2+ tokens).", c.tpot)
        yield _histogram("ssd:request_queue_time_seconds", "Arrival to admission into the engine.", c.queue)
        yield from _spec_decode(c)
        yield from _spec_cache(c)


class GaugesCollector(Collector):
    """Gauges read at scrape time: `gauges` names each (name, help), `values` reads them all
    at once (ssd.openai's stored responses, conversations, batches and files register them)."""

    def __init__(self, gauges: tuple[tuple[str, str], ...], values: Callable[[], tuple[int, ...]]) -> None:
        self.gauges, self.values = gauges, values

    def collect(self) -> Iterator[Metric]:
        for (name, help_text), value in zip(self.gauges, self.values(), strict=True):
            yield GaugeMetricFamily(name, help_text, value=value)


def server_registry(metrics: ServerMetrics, counts: Counts) -> CollectorRegistry:
    """A registry of this server's own (no process-global state)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(metrics, counts))
    return registry


def prometheus_text(registry: CollectorRegistry) -> str:
    """The text exposition format (version 0.0.4), as /metrics serves it."""
    return generate_latest(registry).decode()


def _requests(c: Counters) -> Iterator[Metric]:
    g = c.generation
    yield _counter("ssd:request_admitted", "Requests admitted.", c.requests_total)
    yield _counter("ssd:request_rejected", "Requests refused: queue full.", c.requests_rejected)
    yield _counter("ssd:request_success", "Finished requests by reason.",
                   {(r,): n for r, n in sorted(c.finished.items())}, ["finished_reason"])
    yield _counter("ssd:prompt_tokens", "Prompt tokens processed.", g.prompt_tokens)
    yield _counter("ssd:prefix_cache_hits", "Prompt tokens an earlier request's cache served.",
                   g.cached_prompt_tokens)
    yield _counter("ssd:generation_tokens", "Tokens generated.", g.new_tokens)
    yield _counter("ssd:num_rounds", "Engine rounds (verifications).", g.rounds)


def _spec_decode(c: Counters) -> Iterator[Metric]:
    g = c.generation
    yield _counter("ssd:spec_decode_num_draft_tokens", "Drafted tokens verified.", g.drafted)
    yield _counter("ssd:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", g.accepted)
    yield _counter("ssd:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted at each position.",
                   {(str(i),): n for i, n in enumerate(g.accepted_at)}, ["position"])
    yield _counter("ssd:prompt_lookup_num_rounds", "Rounds that verified a prompt lookup (drafting nothing).",
                   g.lookup_rounds)
    yield _counter("ssd:prompt_lookup_num_tokens", "Prompt-lookup tokens verified.", g.looked_up)
    yield _counter("ssd:prompt_lookup_num_accepted_tokens", "Prompt-lookup tokens accepted.", g.lookup_accepted)


def _spec_cache(c: Counters) -> Iterator[Metric]:
    s = c.generation.spec
    yield _counter("ssd_spec_cache_lookups", "SSD cache lookups.", s.lookups)
    yield _counter("ssd_spec_cache_hits", "SSD cache hits.", s.hits)
    yield _gauge("ssd_spec_cache_hit_rate", "SSD cache hits / lookups since start.", s.hit_rate)
    yield _counter("ssd_spec_cache_lookups_by_k", "SSD cache lookups by accepted length k.",
                   {(str(k),): n for k, n in sorted(s.lookups_by_k.items())}, ["k"])
    yield _counter("ssd_spec_cache_hits_by_k", "SSD cache hits by accepted length k.",
                   {(str(k),): n for k, n in sorted(s.hits_by_k.items())}, ["k"])
    yield _counter("ssd_spec_backups", "Speculations made by a backup (misses), by kind.",
                   {(k,): n for k, n in sorted(s.backups.items())}, ["kind"])
    yield _counter("ssd_spec_target_wait_seconds", "Target time blocked on the draft.", s.wait_s)
    yield _counter("ssd_spec_verify_seconds", "Target verification time.", s.verify_s)
    yield _counter("ssd_spec_build_seconds", "Draft cache construction time.", s.build_s)
    yield _counter("ssd_spec_backup_seconds", "Draft backup speculation time.", s.backup_s)
    yield _counter("ssd_spec_degraded_rounds", "Rounds the target ran alone (draft lost).", s.degraded_rounds)


def _gauge(name: str, help_text: str, value: float) -> Metric:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float | dict[tuple[str, ...], float],
             labels: list[str] | None = None) -> Metric:
    """A counter; its samples are exposed as `name_total` (prometheus_client adds the suffix)."""
    if labels is None:
        return CounterMetricFamily(name, help_text, value=value)
    family = CounterMetricFamily(name, help_text, labels=labels)
    for label_values, n in value.items():
        family.add_metric(list(label_values), n)
    return family


def _histogram(name: str, help_text: str, hist: Histogram) -> Metric:
    return HistogramMetricFamily(name, help_text, buckets=hist.cumulative(), sum_value=hist.total)
