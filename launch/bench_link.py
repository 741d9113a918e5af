"""The draft link: round-trip latency (gloo over loopback, both receive modes), or with
--bytes the q bytes an SSD round sends, before (float32, every drafted row) and now.

    python launch/bench_link.py --rounds 300
    python launch/bench_link.py --bytes
"""

from __future__ import annotations

import argparse
import logging

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402

from ssd.tools.bench.link import bench_link, bench_q_bytes  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="round trips per message and receive mode")
    parser.add_argument("--bytes", action="store_true",
                        help="count the q bytes a round sends (tiny models with the real vocabulary), no timing")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    bench_q_bytes() if args.bytes else bench_link(args.rounds)


if __name__ == "__main__":
    main()
