"""The HTTP front end's latency on a kept-alive connection: our listening socket (Nagle off)
against socket.create_server's (Nagle on, as before), side by side; tiny pair by default.

    python launch/bench_http.py
    python launch/bench_http.py --out docs/results/http_latency
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.config import load_config  # noqa: E402
from ssd.tools.bench.http_latency import bench_http, format_table  # noqa: E402
from ssd.tools.bench.report import command_line, print_and_save  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="abcab")
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    result = bench_http(load_config(args.config), args.repeats, args.stream_tokens, args.prompt)
    print_and_save(command_line("launch/bench_http.py", argv), format_table(result), result, args.out)


if __name__ == "__main__":
    main()
