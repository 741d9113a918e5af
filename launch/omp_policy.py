"""Which OpenMP wait policy and torch thread count pay on this host, quiet and beside one busy process.

    python launch/omp_policy.py                          # 1 and 2 threads, default / passive / spin 10k
    python launch/omp_policy.py --threads 2 --rounds 4 --json omp.json

Each policy runs in a fresh process (ssd.tools.bench.omp_policy); rows are medians
over --rounds interleaved rounds. Record the machine line with the figures:
the answer differs from host to host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd import hardware  # noqa: E402
from ssd.tools.bench.omp_policy import POLICIES, format_rows, measure  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch thread counts")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (quiet, then busy)")
    parser.add_argument("--repeats", type=int, default=25, help="timed steps per process")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def main(argv: list[str] | None = None) -> list:
    args = build_parser().parse_args(argv)
    rows = measure(args.threads, args.policies, args.rounds, args.repeats)
    print(f"machine: {hardware.summary()}")
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": hardware.describe(),
                                         "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
    return rows


if __name__ == "__main__":
    main()
