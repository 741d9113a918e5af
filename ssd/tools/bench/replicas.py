"""Aggregate serving throughput of 1 and N replicas behind one gRPC endpoint, at a fixed
number of clients (tiny pair, CPU, by default).

    python launch/bench_replicas.py                                  # simulated 2-node Ray cluster, 8 clients
    python launch/bench_replicas.py --address auto --config configs/<pair>.yaml --replicas 1 2 4
    python launch/bench_replicas.py --mode ar --max-new-tokens 64 --out docs/results/replicas_ar   # .txt + .json

Without --address, a simulated multi-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a head without CPUs and one raylet per replica,
each with the CPUs of one target + draft group), so each replica has a node
of its own; the replicas' roles take this machine's cores in turn (replica 0
cores 0-1, replica 1 cores 2-3, ... round the cores), as each real node has
its own. Every run sends the same closed-loop load (ssd.tools.bench.load) to a
fresh server over a fresh set of replicas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

import ray

from ssd import hardware
from ssd.app.cli import ROOT, add_config_args, config_from_args
from ssd.tools.bench.load import LoadResult, format_load_table, run_load
from ssd.cluster.devices import Placement, default_cpu_placement
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


# --- launch/bench_replicas.py -------------------------------------------------------------

PROMPTS = ["abcab", "ponm", "aaaabbbb", "mnop", "cab", "bbbb", "onm", "abc"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], dest="replica_counts",
                        help="replica counts to compare")
    parser.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--address", help="a running Ray cluster (default: simulated nodes on this machine)")
    parser.add_argument("--out", type=Path, help="also write the table to OUT.txt and the rows to OUT.json, "
                                                 "with the host and its load")
    add_config_args(parser)
    parser.set_defaults(config=ROOT / "configs" / "tiny-cluster.yaml", mode="ssd")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if min(args.replica_counts) < 1:
        sys.exit(f"error: --replicas must be >= 1, got {args.replica_counts}")
    config = config_from_args(args)
    placement = default_cpu_placement(2, with_draft=config.speculation.mode == "ssd")
    fields = {"max_new_tokens": config.generation.max_new_tokens, "mode": config.speculation.mode}

    def run(address: str, cores: int | None = None) -> list[LoadResult]:
        return bench_replicas(config, placement, args.replica_counts, args.clients, PROMPTS, args.requests, fields,
                              address, cores)

    if args.address:
        results = run(args.address)
    else:  # the simulated nodes share this machine's cores: give each replica others, round the cores
        with simulated_nodes(max(args.replica_counts), cpus=len(placement.target) + len(placement.draft)) as address:
            results = run(address, os.cpu_count())
    table = format_load_table(results)
    print(table)
    if args.out:
        write_results(args, results, table)


def write_results(args: argparse.Namespace, results: list[LoadResult], table: str) -> None:
    """OUT.txt (the command, the host, its load, the table) and OUT.json (the same, the rows)."""
    command = "python launch/bench_replicas.py " + " ".join(sys.argv[1:])
    where = "simulated nodes on this machine" if not args.address else f"Ray cluster at {args.address}"
    head = [f"$ {command}", f"{hardware.summary()}; {where}", hardware.uptime(), "one run"]
    args.out.with_suffix(".txt").write_text("\n".join(head) + "\n\n" + table + "\n")
    record = {"command": command, "machine": hardware.summary(), "where": where, "uptime": head[2],
              "rows": [r.row() for r in results]}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
