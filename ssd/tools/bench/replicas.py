"""Aggregate serving throughput of 1 and N replicas behind one gRPC endpoint.

Without `address`, a simulated multi-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a head without CPUs and one raylet per replica,
each with the CPUs of one target + draft group), so each replica has a node
of its own. Every run sends the same closed-loop load (ssd.tools.bench.load) to a
fresh server over a fresh set of replicas.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterator, Sequence

import ray

from ssd.tools.bench.load import LoadResult, run_load
from ssd.cluster.devices import Placement
from ssd.cluster.replicas import start_cluster
from ssd.config import Config

log = logging.getLogger(__name__)


class simulated_nodes:
    """A Ray cluster of `nodes` worker nodes with `cpus` each, on this machine, for the with-block."""

    def __init__(self, nodes: int, cpus: int) -> None:
        self.nodes, self.cpus = nodes, cpus

    def __enter__(self) -> str:
        from ray.cluster_utils import Cluster as RayCluster

        os.environ.setdefault("RAY_worker_niceness", str(os.nice(0)))  # as ssd.cluster.runtime.start_ray does
        self.cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(self.nodes):
            self.cluster.add_node(num_cpus=self.cpus)
        self.cluster.wait_for_nodes()
        return self.cluster.address

    def __exit__(self, *exc: object) -> None:
        self.cluster.shutdown()


def spread_cores(placement: Placement, replicas: int, cores: int) -> list[Placement]:
    """CPU placements that give each replica other cores of this machine, round the cores
    (simulated nodes share the machine's cores; real nodes each have their own)."""
    roles = len(placement.target) + len(placement.draft)
    out = []
    for i in range(replicas):
        ids = [(i * roles + j) % cores for j in range(roles)]
        target, draft = ids[: len(placement.target)], ids[len(placement.target):]
        out.append(dataclasses.replace(placement, target=tuple(target), draft=tuple(draft)))
    return out


def bench_replicas(
    config: Config, placement: Placement, counts: Sequence[int], concurrency: int, prompts: Sequence[str],
    requests_per_client: int, fields: dict, address: str | None = None, cores: int | None = None,
) -> list[LoadResult]:
    """One load run per replica count in `counts`, each against its own server; `cores`
    (simulated nodes): spread the replicas' roles over this machine's cores."""
    return list(_runs(config, placement, counts, concurrency, prompts, requests_per_client, fields, address, cores))


def _runs(config, placement, counts, concurrency, prompts, requests_per_client, fields, address,
          cores) -> Iterator[LoadResult]:
    from ssd.serve.cluster_backend import ClusterBackend
    from ssd.serve.options import ServeOptions
    from ssd.serve.server import GenerationServer

    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        for n in counts:
            replicas = config if n == config.cluster.replicas else dataclasses.replace(
                config, cluster=dataclasses.replace(config.cluster, replicas=n))
            placed = spread_cores(placement, n, cores) if cores and n > 1 else placement
            with start_cluster(replicas, placed) as cluster:
                server = GenerationServer(ServeOptions(port=0, max_queue=4 * concurrency),
                                          lambda: ClusterBackend(cluster))
                server.start()
                try:
                    if not server.wait_ready(600):
                        raise RuntimeError(f"the server over {n} replica(s) did not start: {server.load_error}")
                    label = f"{n} replica{'s' if n > 1 else ''}"
                    run_load(f"127.0.0.1:{server.port}", "warm-up", min(concurrency, 2), prompts, 1, fields)
                    result = run_load(f"127.0.0.1:{server.port}", label, concurrency, prompts, requests_per_client,
                                      fields)
                    log.info("%s: %.1f tok/s", label, result.throughput)
                    yield result
                finally:
                    server.stop()
    finally:
        ray.shutdown()
