"""Server-wide counters and their Prometheus text exposition.

Names follow vLLM's habit (`ssd:` for request-level metrics, where vLLM has
`vllm:`) and the design's `ssd_spec_` prefix for speculation metrics. Written
by hand: a few counters and histograms do not justify a dependency.
"""

from __future__ import annotations

import bisect
import copy
import threading
import time
from dataclasses import dataclass, field

from ssd.engine.metrics import GenerationStats, add_into
from ssd.serve.protos import enum_names

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


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

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {_num(self.total)}", f"{name}_count {self.n}"]


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


class ServerMetrics:
    """Thread-safe: handler threads count admissions, the worker counts results."""

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

    def finished(self, reason: str, stats: GenerationStats | None, ttft_s: float | None,
                 e2e_s: float, queue_s: float) -> None:
        with self._lock:
            c = self._c
            c.finished[reason] = c.finished.get(reason, 0) + 1
            c.e2e.observe(e2e_s)
            c.queue.observe(queue_s)
            if ttft_s is not None:
                c.ttft.observe(ttft_s)
            if stats is not None:
                add_into(c.generation, stats)

    def snapshot(self) -> Counters:
        """A consistent copy to read without the lock."""
        with self._lock:
            return copy.deepcopy(self._c)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started


def prometheus_text(c: Counters, running: int, waiting: int) -> str:
    """The text exposition format (version 0.0.4)."""
    lines: list[str] = []
    _metric(lines, "ssd:num_requests_running", "gauge", "Requests generating now.", [("", running)])
    _metric(lines, "ssd:num_requests_waiting", "gauge", "Requests queued for the engine.", [("", waiting)])
    _metric(lines, "ssd:request_admitted_total", "counter", "Requests admitted.", [("", c.requests_total)])
    _metric(lines, "ssd:request_rejected_total", "counter", "Requests refused: queue full.",
            [("", c.requests_rejected)])
    _metric(lines, "ssd:request_success_total", "counter", "Finished requests by reason.",
            [(_labels(finished_reason=r), n) for r, n in sorted(c.finished.items())])
    _metric(lines, "ssd:prompt_tokens_total", "counter", "Prompt tokens processed.", [("", c.generation.prompt_tokens)])
    _metric(lines, "ssd:generation_tokens_total", "counter", "Tokens generated.", [("", c.generation.new_tokens)])
    _metric(lines, "ssd:num_rounds_total", "counter", "Engine rounds (verifications).", [("", c.generation.rounds)])
    _histogram(lines, "ssd:time_to_first_token_seconds", "Arrival to first token.", c.ttft)
    _histogram(lines, "ssd:e2e_request_latency_seconds", "Arrival to last token.", c.e2e)
    _histogram(lines, "ssd:request_queue_time_seconds", "Time waiting for the engine.", c.queue)
    _spec_decode(lines, c)
    _spec_cache(lines, c)
    return "\n".join(lines) + "\n"


def _spec_decode(lines: list[str], c: Counters) -> None:
    g = c.generation
    _metric(lines, "ssd:spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified.",
            [("", g.drafted)])
    _metric(lines, "ssd:spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.",
            [("", g.accepted)])
    _metric(lines, "ssd:spec_decode_num_accepted_tokens_per_pos", "counter",
            "Drafted tokens accepted at each position.",
            [(_labels(position=i), n) for i, n in enumerate(g.accepted_at)])


def _spec_cache(lines: list[str], c: Counters) -> None:
    s = c.generation.spec
    _metric(lines, "ssd_spec_cache_lookups_total", "counter", "SSD cache lookups.", [("", s.lookups)])
    _metric(lines, "ssd_spec_cache_hits_total", "counter", "SSD cache hits.", [("", s.hits)])
    _metric(lines, "ssd_spec_cache_hit_rate", "gauge", "SSD cache hits / lookups since start.",
            [("", s.hit_rate)])
    _metric(lines, "ssd_spec_cache_lookups_by_k", "counter", "SSD cache lookups by accepted length k.",
            [(_labels(k=k), n) for k, n in sorted(s.lookups_by_k.items())])
    _metric(lines, "ssd_spec_cache_hits_by_k", "counter", "SSD cache hits by accepted length k.",
            [(_labels(k=k), n) for k, n in sorted(s.hits_by_k.items())])
    _metric(lines, "ssd_spec_backups_total", "counter", "Speculations made by a backup (misses), by kind.",
            [(_labels(kind=k), n) for k, n in sorted(s.backups.items())])
    _metric(lines, "ssd_spec_target_wait_seconds_total", "counter", "Target time blocked on the draft.",
            [("", s.wait_s)])
    _metric(lines, "ssd_spec_verify_seconds_total", "counter", "Target verification time.", [("", s.verify_s)])
    _metric(lines, "ssd_spec_build_seconds_total", "counter", "Draft cache construction time.",
            [("", s.build_s)])
    _metric(lines, "ssd_spec_backup_seconds_total", "counter", "Draft backup speculation time.",
            [("", s.backup_s)])
    _metric(lines, "ssd_spec_degraded_rounds_total", "counter", "Rounds the target ran alone (draft lost).",
            [("", s.degraded_rounds)])


def _metric(lines: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_num(value)}" for labels, value in samples]


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *hist.lines(name)]


def _labels(**labels: object) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
