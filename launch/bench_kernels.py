"""What extra rows cost on this CPU: ssd's GGUF kernels against llama.cpp on the same GGUF file.

    python launch/bench_kernels.py                                  # the real pair, 1 and 2 threads
    python launch/bench_kernels.py --models qwen2.5-coder-1.5b-instruct --threads 2 --out docs/results/kernels

Forwards of 1, 2, 4, 8 and 16 tokens after a 256-token prefix, the two backends
interleaved, median ms and steps (x one token); and whether each backend's rows are
bit-identical alone and together (ssd.tools.bench.kernels). Run it on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.kernels import measure, table  # noqa: E402

PAIR = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=PAIR)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefix", type=int, default=256, help="tokens in the KV cache before each forward")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.txt")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = measure(args.models, args.threads, args.prefix, args.repeats)
    text = table(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".txt").write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
