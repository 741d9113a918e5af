"""A chat's turns on the real target with and without the prefix cache, beside plain llama.cpp
with and without its server's prompt cache; one request at a time, interleaved.

    python launch/bench_chat.py                                # llama.cpp backend, 2 threads
    python launch/bench_chat.py --out docs/results/prefix_cache   # --chunks 512 128: other chunk sizes
    python launch/bench_chat.py --chats 2 --turns 3 --out docs/results/prefix_cache_two_chats

Time to first token per turn, each turn's prompt and the tokens the cache served, and
whether our engines' greedy replies agree.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.config import load_config  # noqa: E402
from ssd.tools.bench.chat_turns import TURNS, bench_chat, format_table  # noqa: E402
from ssd.tools.bench.report import print_and_save  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    parser.add_argument("--backend", choices=["auto", "llamacpp", "torch"], default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+",
                        help="batching.prefill_chunk of the engines with the prefix cache (default: the config's)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--turns", type=int, help="the first N turns of the chat (default: all six)")
    parser.add_argument("--chats", type=int, default=1,
                        help="chats under one system message, taking each turn in turn (users of one server)")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave plain llama.cpp out")
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config, {"target": {"backend": args.backend}, "runtime": {"threads": args.threads}})
    turns = TURNS[: args.turns] if args.turns else TURNS
    result = bench_chat(config, args.chunks or [config.batching.prefill_chunk], args.max_new_tokens, turns, llamacpp=not args.no_llamacpp, chats=args.chats)
    command = " ".join(["python launch/bench_chat.py", *(sys.argv[1:] if argv is None else argv)])
    print_and_save(command, format_table(result), result, args.out)


if __name__ == "__main__":
    main()
