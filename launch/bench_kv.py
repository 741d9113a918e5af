"""The KV cache's type on llama.cpp's kernels at long contexts, on the real target: which caches
keep batched and speculative rows bit-exact, a decode step's cost, the logits' error against a
precise cache, and decoding through our AR engine against plain llama.cpp.

    python launch/bench_kv.py                                  # steps after 300, 1200 and 2400 positions
    python launch/bench_kv.py --out docs/results/kv_cache
"""

from __future__ import annotations

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.tools.bench.kv_cache import bench_kv, format_table  # noqa: E402
from ssd.tools.bench.report import command_line, print_and_save, small_bench_config, small_bench_parser  # noqa: E402


def build_parser():
    parser = small_bench_parser(__doc__, ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    parser.add_argument("--positions", type=int, nargs="+", default=[300, 1200, 2400])
    parser.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds per position")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the decode rows' prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = small_bench_config(args)
    result = bench_kv(config, args.positions, args.repeats, args.prompt_tokens, args.max_new_tokens,
                      llamacpp=not args.no_llamacpp)
    command = command_line("launch/bench_kv.py", argv)
    print_and_save(command, format_table(result), result, args.out)


if __name__ == "__main__":
    main()
