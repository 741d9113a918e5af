"""A seeded SSD request sent again and again to one server: coupled (the default for a seeded
request) against standard sampling, interleaved; the study is ssd/tools/bench/seeded.py.

    python launch/bench_seeded.py --no-plan --prompts 4 --repeats 3 --max-new-tokens 48 \
        --temperature 0.7 --out docs/results/seeded
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from _bootstrap import ROOT  # noqa: F401 - first: the repository root on sys.path

import yaml  # noqa: E402

from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args  # noqa: E402
from ssd.factory import load_pair  # noqa: E402
from ssd.models.backend import precision_of  # noqa: E402
from ssd.tools.bench.report import command_line, machine_info, print_and_save  # noqa: E402
from ssd.tools.bench.seeded import format_seeded_table, run_seeded_bench  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-file", type=Path, default=PROMPT_DIR / "code.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    config = config_from_args(args)
    temperature = 0.7 if args.temperature is None else args.temperature
    prompts = yaml.safe_load(args.prompt_file.read_text())[: args.prompts]
    pair = load_pair(config)
    result = run_seeded_bench(pair, config, prompts, temperature, args.repeats,
                              config.generation.max_new_tokens)
    machine = machine_info()
    result["machine"] = machine
    s = config.speculation
    header = (f"{machine['cpu_model']}; torch CPU capability {machine['torch_cpu_capability']}; {machine['cores']} cores; "
              f"{config.target.name} / {config.draft.name} ({precision_of(pair.target)} / {precision_of(pair.draft)}); SSD in the server's process, "
              f"K={s.k}, budget {s.fanout.budget} {s.fanout.kind}, anytime builds {s.fanout.anytime}")
    print_and_save(command_line("launch/bench_seeded.py", argv), header + "\n" + format_seeded_table(result),
                   result, args.out)


if __name__ == "__main__":
    main()
