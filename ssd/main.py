"""The `ssd` console command: one entry point over the user commands and the main tools,
as vLLM has `vllm serve` and `vllm run-batch`.

    ssd serve --config configs/tiny.yaml --http-port 8000   # gRPC + the OpenAI API, in process
    ssd cluster --cpu "def add(a, b):"                      # SSD through the Ray cluster
    ssd generate --mode ssd --budget 8                      # one generation in one process
    ssd serve --help                                        # each command's own flags

Each command runs the same `main(argv)` as its launch script (`ssd serve` is
`python launch/serve.py`), with the same flags; the other tools keep a launch
script only (launch/*.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Sequence

from ssd import __version__

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    module: str  # holds build_parser() and main(argv); imported only when run: `ssd --help` loads no torch
    script: str  # the launch script that runs the same main, under launch/
    summary: str


COMMANDS: dict[str, Command] = {
    "serve": Command("ssd.app.serve", "serve.py", "serve the pair over gRPC (+ the OpenAI API with --http-port)"),
    "cluster": Command("ssd.app.launcher", "cluster.py",
                       "the distributed runtime (Ray actors, the draft link, gRPC): serve, or one prompt"),
    "generate": Command("ssd.app.generate", "generate.py", "one generation in one process"),
    "client": Command("ssd.app.client", "client.py", "a gRPC client: generate, abort, --info, --stats"),
    "run-batch": Command("ssd.app.run_batch", "run_batch.py", "OpenAI batch lines through the pair, no server"),
    "bench": Command("ssd.tools.bench.cli", "bench.py", "AR, SD, SSD and HF assisted side by side; --concurrency: serving"),
    "ablate": Command("ssd.tools.ablation.cli", "ablate.py", "SSD ablations from recorded traces (record, sweep, plan...)"),
}


def build_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {c.summary} (launch/{c.script})" for name, c in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="ssd", usage="ssd [-h] [--version] COMMAND [ARGS...]", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"commands:\n{listing}\n\n`ssd COMMAND --help` shows a command's flags.")
    parser.add_argument("--version", action="version", version=f"ssd {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ssd COMMAND ARGS...`; the exit status is the command's (0 where it returns none)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:  # --help, --version, no or an unknown command: argparse answers
        parser = build_parser()
        parser.parse_args(argv)
        parser.error("the command comes first: ssd COMMAND [ARGS...]")  # e.g. `ssd -- serve`
    return run(argv[0], argv[1:])


def run(name: str, args: list[str]) -> int:
    command = COMMANDS[name]
    module = importlib.import_module(command.module)
    # The commands' parsers take their usage line's name from sys.argv[0], and some
    # benchmarks record the command line they ran: both should say `ssd NAME ...`.
    saved, sys.argv = sys.argv, [f"ssd {name}", *args]
    try:
        log.debug("ssd %s: %s.main(%s)", name, command.module, args)
        result = module.main(args)
    finally:
        sys.argv = saved
    # Launch scripts exit with main's int and with 0 where main returns something else
    # (bench returns its results): the same here.
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
