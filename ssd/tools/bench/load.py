"""Serving load: N streaming clients at once against a gRPC endpoint.

Each client sends its requests back to back (closed loop, as vLLM's and
SGLang's serving benchmarks do at a fixed concurrency). Per request it records
when the request was sent, when each token message arrived and how many tokens
it carried; from those come total throughput (every generated token over the
wall time of the run), time to first token and inter-token latency.

Inter-token latency counts tokens, not messages: a speculative round that
lands 4 tokens after 100 ms gives 4 gaps of 25 ms, so modes that stream in
rounds and modes that stream token by token compare fairly.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ssd.serve.client import GenerationClient


@dataclass
class Timeline:
    """One request as its client saw it."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the message)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive tokens after the first, a message's gap shared by its tokens."""
        gaps: list[float] = []
        for (before, _), (at, n) in zip(self.arrivals, self.arrivals[1:]):
            gaps += [(at - before) / n] * n
        return gaps


@dataclass
class LoadResult:
    label: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    ttft: list[float]
    gaps: list[float]
    errors: list[str]

    @property
    def throughput(self) -> float:
        """Generated tokens per second, all clients together."""
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def percentile(self, values: Sequence[float], q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")

    def row(self) -> dict[str, Any]:
        return {
            "label": self.label, "concurrency": self.concurrency, "requests": self.requests,
            "tokens": self.tokens, "wall_s": round(self.wall_s, 3), "tok_s": round(self.throughput, 2),
            "ttft_p50_s": round(self.percentile(self.ttft, 50), 4),
            "ttft_p99_s": round(self.percentile(self.ttft, 99), 4),
            "itl_p50_ms": round(1000 * self.percentile(self.gaps, 50), 2),
            "itl_p99_ms": round(1000 * self.percentile(self.gaps, 99), 2),
            "errors": len(self.errors),
        }


def run_load(
    address: str, label: str, concurrency: int, prompts: Sequence[str], requests_per_client: int,
    request_fields: dict[str, Any], timeout_s: float = 3600.0,
) -> LoadResult:
    """`concurrency` clients, each sending `requests_per_client` requests (prompts in turn)."""
    timelines: list[list[Timeline]] = [[] for _ in range(concurrency)]
    start = threading.Barrier(concurrency + 1)

    def client(index: int) -> None:
        with GenerationClient(address) as grpc_client:
            start.wait()
            for n in range(requests_per_client):
                prompt = prompts[(index * requests_per_client + n) % len(prompts)]
                timelines[index].append(_one(grpc_client, prompt, request_fields, timeout_s))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    done = [t for per_client in timelines for t in per_client]
    return LoadResult(
        label=label, concurrency=concurrency, requests=len(done), tokens=sum(t.tokens for t in done),
        wall_s=wall, ttft=[t.ttft for t in done if t.ttft is not None],
        gaps=[g for t in done for g in t.token_gaps()], errors=[t.error for t in done if t.error],
    )


def _one(client: GenerationClient, prompt: str, fields: dict[str, Any], timeout_s: float) -> Timeline:
    import grpc

    timeline = Timeline(sent=time.perf_counter())
    try:
        for message in client.stream(timeout=timeout_s, text=prompt, **fields):
            if message.token_ids:
                timeline.arrivals.append((time.perf_counter(), len(message.token_ids)))
    except grpc.RpcError as exc:
        timeline.error = f"{exc.code().name}: {exc.details()}"
    return timeline


def format_load_table(results: Sequence[LoadResult]) -> str:
    """One markdown table, a row per (label, concurrency), with throughput relative to the first row
    of the same concurrency."""
    header = "| mode | clients | requests | tokens | tok/s | x first | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | errors |"
    lines = [header, "|" + "---|" * 11]
    first: dict[int, float] = {}
    for result in results:
        row = result.row()
        base = first.setdefault(result.concurrency, result.throughput)
        ratio = result.throughput / base if base else float("nan")
        lines.append(
            f"| {row['label']} | {row['concurrency']} | {row['requests']} | {row['tokens']} | {row['tok_s']:.1f} | "
            f"{ratio:.2f} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f} | {row['itl_p50_ms']:.1f} | "
            f"{row['itl_p99_ms']:.1f} | {row['errors']} |"
        )
    return "\n".join(lines)
