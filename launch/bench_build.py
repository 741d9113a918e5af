"""SSD's cache build against the verification it hides behind, on this host.

    python launch/bench_build.py                              # the configured pair, --json docs/results/build.json
    python launch/bench_build.py --repeats 9 --json build.json

Prints build/verify per glue (full: before the draft reused its own work;
reuse; fold), b rows built at once against one, and a tree step over B
branches against a chain step and the weights-read floor (ssd.tools.bench.build).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from tqdm import tqdm  # noqa: E402

from ssd.tools.bench.build import format_bench, measure  # noqa: E402
from ssd.app.cli import add_config_args, config_from_args  # noqa: E402
from ssd.factory import load_pair  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over every probe")
    parser.add_argument("--json", type=Path, help="write the figures here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    pair = load_pair(config_from_args(args))
    with tqdm(desc="probes through their last pass", file=sys.stderr) as bar:
        bench = measure(pair.target, pair.draft, repeats=args.repeats, tick=bar.update)
    print(format_bench(bench))
    out = bench.to_json()
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
