"""A chat's turns on the real target with and without the prefix cache, beside plain llama.cpp
with and without its server's prompt cache; one request at a time, interleaved.

    python launch/bench_chat.py                                # llama.cpp backend, 2 threads
    python launch/bench_chat.py --out docs/results/prefix_cache   # --chunks 512 128: other chunk sizes
    python launch/bench_chat.py --chats 2 --turns 3 --out docs/results/prefix_cache_two_chats
    python launch/bench_chat.py --mode ssd --no-llamacpp --out docs/results/prefix_cache_ssd
    python launch/bench_chat.py --replot docs/results/prefix_cache.json   # its plot again, no run

Time to first token per turn, each turn's prompt and the tokens the cache served, and
whether our engines' greedy replies agree; with --out, OUT.png plots the turns.
"""

from __future__ import annotations

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from ssd.tools.bench.chat_turns import TURNS, bench_chat, format_table, plot_turns  # noqa: E402
from ssd.tools.bench.report import command_line, print_and_save, small_bench_config, small_bench_parser  # noqa: E402


def build_parser():
    parser = small_bench_parser(__doc__, ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    parser.add_argument("--chunks", type=int, nargs="+",
                        help="batching.prefill_chunk of the engines with the prefix cache (default: the config's)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--turns", type=int, help="the first N turns of the chat (default: all six)")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="plot an earlier run's OUT.json as OUT.png and exit (no run)")
    parser.add_argument("--mode", choices=("ar", "ssd"), default="ar",
                        help="our engines' mode; ssd also runs one whose draft prefills every prompt whole")
    parser.add_argument("--chats", type=int, default=1,
                        help="chats under one system message, taking each turn in turn (users of one server)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.replot:
        print(plot_turns(json.loads(args.replot.read_text()), args.replot.with_suffix(".png")))
        return
    config = small_bench_config(args)
    turns = TURNS[: args.turns] if args.turns else TURNS
    result = bench_chat(config, args.chunks or [config.batching.prefill_chunk], args.max_new_tokens, turns,
                        llamacpp=not args.no_llamacpp, chats=args.chats, mode=args.mode)
    command = command_line("launch/bench_chat.py", argv)
    print_and_save(command, format_table(result), result, args.out)
    if args.out:
        plot_turns(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
