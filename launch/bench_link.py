"""Round-trip latency of the draft link (gloo over loopback), both receive modes.

    python launch/bench_link.py --rounds 300
"""

from __future__ import annotations

import argparse
import logging

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402

from ssd.tools.bench.link import bench_link  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="round trips per message and receive mode")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    bench_link(args.rounds)


if __name__ == "__main__":
    main()
