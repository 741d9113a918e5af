"""`n` samples of one long prompt on the real target: rows admitted together prefill it once
and copy it, against every row prefilling it, beside plain llama.cpp answering the n requests
in turn with its server's prompt cache.

    python launch/bench_samples.py                                  # n = 4, a ~700-token prompt
    python launch/bench_samples.py --out docs/results/shared_prefill

Time until every sample has its first token, until all are done, the prompt tokens fed, and
whether our two engines' samples agree.
"""

from __future__ import annotations

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from ssd.tools.bench.report import command_line, print_and_save, small_bench_config, small_bench_parser  # noqa: E402
from ssd.tools.bench.samples import bench_samples, format_table  # noqa: E402


def build_parser():
    parser = small_bench_parser(__doc__, ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    parser.add_argument("-n", type=int, default=4, help="samples of the prompt (OpenAI's n)")
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = small_bench_config(args)
    result = bench_samples(config, args.n, args.prompt_tokens, args.max_new_tokens, args.repeats,
                           llamacpp=not args.no_llamacpp)
    command = command_line("launch/bench_samples.py", argv)
    print_and_save(command, format_table(result), result, args.out)


if __name__ == "__main__":
    main()
