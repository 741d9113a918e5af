"""The serving benchmark: modes side by side at several client concurrencies,
through a real gRPC server on loopback, batched and one request at a time.

One model load serves every row: the two servers (batching off, i.e.
batching.max_rows 1, and batching on) are GenerationServers over
LocalBackends sharing the loaded pair. Every row of one concurrency sends the
same prompts with the same settings, so rows compare like for like; the
baseline of each concurrency is the one-at-a-time server in the config's mode.

With a Cluster (the bench's --cluster), rows marked "cluster" go to a server
over it instead: AR batched on the target's core and SSD with the draft on a
core of its own, at the cluster's (planned) speculation defaults. In-process
rows may name their torch thread count ("t=2": the equal-hardware row).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

from tqdm import tqdm

from ssd.tools.bench.load import LoadResult, run_load
from ssd.config import Config
from ssd.factory import LoadedPair

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One row: a mode (with its K) on a server that batches or not."""

    mode: str
    k: int | None = None  # None: the server's (speculation.k_policy by batch size, else k)
    batched: bool = True
    adaptive: bool = False  # K from the server's speculation.k_policy (the request names none)
    cluster: bool = False  # through the distributed runtime (one core per role)
    threads: int | None = None  # in-process rows: the server's torch threads (None: torch's default)

    @property
    def label(self) -> str:
        if self.adaptive:
            return f"{self.mode} adaptive"
        k = f" K={self.k}" if self.k is not None and self.mode != "ar" else ""
        where = " cluster" if self.cluster else (f" t={self.threads}" if self.threads else "")
        return f"{self.mode}{k} {'batched' if self.batched else 'one-at-a-time'}{where}"

    @property
    def server(self) -> tuple[bool, bool, int | None]:
        """Which server runs this row: rows with the same one share it."""
        return self.cluster, self.batched, None if self.cluster else self.threads

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"mode": self.mode}
        if self.k is not None and self.mode != "ar":
            fields["k"] = self.k
        return fields


@dataclass
class ServingPlan:
    variants: list[Variant]
    concurrencies: list[int]
    prompts: list[str]
    requests_per_client: int = 2
    max_new_tokens: int = 64
    temperature: float = 0.0
    progress: bool = True


def run_serving_bench(pair: LoadedPair | None, config: Config, plan: ServingPlan, cluster=None) -> list[LoadResult]:
    """Every variant at every concurrency, grouped by concurrency, then variant.

    Every server (one per batching, thread count and cluster) is up the whole
    time and the rows of one concurrency run back to back, so a machine that
    drifts over minutes (a shared host does) moves the rows that are compared
    together. `cluster`: the ssd.cluster.runtime.Cluster the "cluster" rows use."""
    results = []
    rows = max(plan.concurrencies)
    with ExitStack() as stack, tqdm(total=len(plan.variants) * len(plan.concurrencies), desc="serving bench",
                                    disable=not plan.progress) as bar:
        servers = {key: stack.enter_context(BenchServer(pair, config, key, rows, cluster))
                   for key in dict.fromkeys(v.server for v in plan.variants)}
        for concurrency in plan.concurrencies:
            for variant in plan.variants:
                results.append(_run(servers[variant.server], variant, concurrency, plan))
                log.info("%s", results[-1].row())
                bar.update()
    return results


def _run(address: str, variant: Variant, concurrency: int, plan: ServingPlan) -> LoadResult:
    """The clients run in a process of their own, as real clients would: in the
    server's process their threads would contend with it for the GIL."""
    fields = variant.fields() | {"max_new_tokens": plan.max_new_tokens, "temperature": plan.temperature,
                                 "ignore_eos": True}
    with multiprocessing.get_context("spawn").Pool(1) as clients:
        clients.apply(run_load, (address, variant.label, 1, plan.prompts[:1], 1, fields | {"max_new_tokens": 4}))
        return clients.apply(run_load, (address, variant.label, concurrency, plan.prompts,
                                        plan.requests_per_client, fields))


class BenchServer:
    """A GenerationServer on a free loopback port, over the shared pair or the cluster; `key`
    is a Variant's server (on the cluster, batched, torch threads)."""

    def __init__(self, pair: LoadedPair | None, config: Config, key: tuple[bool, bool, int | None] = (False, True, None),
                 rows: int = 1, cluster=None) -> None:
        on_cluster, batched, threads = key
        if on_cluster and cluster is None:
            raise ValueError("cluster rows need a Cluster")
        batching = dataclasses.replace(config.batching, max_rows=rows if batched else 1)
        runtime = dataclasses.replace(config.runtime, threads=threads or config.runtime.threads)
        self.config = dataclasses.replace(config, batching=batching, runtime=runtime)
        self.pair, self.rows, self.cluster = pair, rows, cluster if on_cluster else None

    def __enter__(self) -> str:
        from ssd.serve.backend import LocalBackend
        from ssd.serve.cluster_backend import ClusterBackend
        from ssd.serve.options import ServeOptions
        from ssd.serve.server import GenerationServer

        options = ServeOptions(port=0, max_queue=max(64, 4 * self.rows))
        if self.cluster is not None:
            backend = lambda: ClusterBackend(self.cluster)  # noqa: E731
        else:
            backend = lambda: LocalBackend(self.config, pair=self.pair)  # noqa: E731
        self.server = GenerationServer(options, backend)
        self.server.start()
        if not self.server.wait_ready(600):
            raise RuntimeError(f"the bench server did not start: {self.server.load_error}")
        return f"127.0.0.1:{self.server.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace_s=1.0)


def format_serving_table(results: Sequence[LoadResult], baseline: str) -> str:
    """A markdown table per concurrency; "x base" is throughput over the `baseline` row's."""
    lines = ["| clients | mode | tok/s | x base | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {r.concurrency: r.throughput for r in results if r.label == baseline}
    for r in results:
        row = r.row()
        ratio = r.throughput / base[r.concurrency] if base.get(r.concurrency) else float("nan")
        lines.append(
            f"| {r.concurrency} | {r.label} | {r.throughput:.1f} | {ratio:.2f} | {row['ttft_p50_s']:.3f} | "
            f"{row['ttft_p99_s']:.3f} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | {row['errors']} |"
        )
    return "\n".join(lines)
