"""Aggregate throughput of 1 vs N replicas at a fixed number of clients (tiny pair, CPU, by default).

    python launch/bench_replicas.py                                  # simulated 2-node Ray cluster, 8 clients
    python launch/bench_replicas.py --address auto --config configs/<pair>.yaml --replicas 1 2 4
    python launch/bench_replicas.py --mode ar --max-new-tokens 64 --out docs/results/replicas_ar   # .txt + .json

Without --address, each replica gets a simulated node of its own on this
machine (ray.cluster_utils.Cluster), with the CPUs of one target + draft group;
the replicas' roles take this machine's cores in turn (replica 0 cores 0-1,
replica 1 cores 2-3, ... round the cores), as each real node has its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd import hardware  # noqa: E402
from ssd.tools.bench.load import format_load_table  # noqa: E402
from ssd.tools.bench.replicas import bench_replicas, simulated_nodes  # noqa: E402
from ssd.app.cli import add_config_args, config_from_args  # noqa: E402
from ssd.cluster.devices import default_cpu_placement  # noqa: E402

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
    run = lambda address, cores=None: bench_replicas(  # noqa: E731
        config, placement, args.replica_counts, args.clients, PROMPTS, args.requests, fields, address, cores)
    if args.address:
        results = run(args.address)
    else:  # the simulated nodes share this machine's cores: give each replica others, round the cores

        with simulated_nodes(max(args.replica_counts), cpus=len(placement.target) + len(placement.draft)) as address:
            results = run(address, os.cpu_count())
    table = format_load_table(results)
    print(table)
    if args.out:
        write_results(args, results, table)


def write_results(args: argparse.Namespace, results: list, table: str) -> None:
    """OUT.txt (the command, the host, its load, the table) and OUT.json (the same, the rows)."""
    command = "python launch/bench_replicas.py " + " ".join(sys.argv[1:])
    where = "simulated nodes on this machine" if not args.address else f"Ray cluster at {args.address}"
    head = [f"$ {command}", f"{hardware.summary()}; {where}", hardware.uptime(), "one run"]
    args.out.with_suffix(".txt").write_text("\n".join(head) + "\n\n" + table + "\n")
    record = {"command": command, "machine": hardware.summary(), "where": where, "uptime": head[2],
              "rows": [r.row() for r in results]}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
