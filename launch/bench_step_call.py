"""Decode rate through the cluster by cluster.step_call_s (steps per Ray call), tiny pair by default.

    python launch/bench_step_call.py                           # 0 vs 0.025 s, AR and SSD, 5 rounds
    python launch/bench_step_call.py --seconds 0 0.01 0.025 0.1 --out docs/results/step_call

One request at a time; the settings are interleaved in each round.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.config import load_config  # noqa: E402
from ssd.tools.bench.step_call import bench_step_call, format_table  # noqa: E402
from ssd.tools.bench.report import command_line, print_and_save  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cluster.yaml")
    parser.add_argument("--seconds", nargs="+", type=float, default=[0.0, 0.025], help="cluster.step_call_s values")
    parser.add_argument("--modes", nargs="+", choices=["ar", "ssd"], default=["ar", "ssd"])
    parser.add_argument("--prompt", default="abcab")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    result = bench_step_call(load_config(args.config), args.seconds, args.modes, args.prompt,
                             args.max_new_tokens, args.rounds)
    command = command_line("launch/bench_step_call.py", argv)
    print_and_save(command, format_table(result), result, args.out)


if __name__ == "__main__":
    main()
