"""What prompt lookup buys the target alone on this host: AR against AR whose rounds verify
what the text so far predicts (speculation.prompt_lookup), one request at a time, interleaved.

    python launch/bench_lookup.py --prompt-file PROMPTS.yaml                   # llama.cpp, 2 threads
    python launch/bench_lookup.py --prompt-file PROMPTS.yaml --backend torch --out docs/results/lookup_torch

Decode tok/s (after the first token) per prompt, the lookups' accepted share, and whether
greedy tokens agree.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.config import load_config  # noqa: E402
from ssd.tools.bench.lookup import bench_lookup, format_table  # noqa: E402
from ssd.tools.bench.report import command_line, print_and_save  # noqa: E402
from ssd.tools.prompts import load_prompt_set  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    parser.add_argument("--backend", choices=["auto", "llamacpp", "torch"], default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-file", type=Path, default=ROOT / "configs" / "prompts" / "code.yaml")
    parser.add_argument("--prompts", type=int, help="the first N prompts of the file")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--lookup-tokens", type=int, default=8,
                        help="speculation.prompt_lookup.max_tokens (the longest lookup a round verifies)")
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    overrides = {"target": {"backend": args.backend}, "runtime": {"threads": args.threads},
                 "speculation": {"prompt_lookup": {"max_tokens": args.lookup_tokens}}}
    config = load_config(args.config, overrides)
    prompts = load_prompt_set(args.prompt_file, args.prompts)
    result = bench_lookup(config, prompts, args.max_new_tokens, args.rounds, args.temperature)
    command = command_line("launch/bench_lookup.py", argv)
    print_and_save(command, format_table(result), result, args.out)


if __name__ == "__main__":
    main()
