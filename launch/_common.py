"""Argument handling shared by the launch scripts."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from ssd.config import MODES, Config, ConfigError, load_config  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "qwen2.5-coder-cpu.yaml"
# --target-precision / --draft-precision: one name for a (dtype, quantization) pair.
PRECISIONS = {
    "auto": ("auto", "auto"), "int8": ("fp32", "int8"),
    "bf16": ("bf16", None), "fp32": ("fp32", None), "fp64": ("fp64", None),
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML config file")
    parser.add_argument("--mode", choices=MODES, help="override speculation.mode")
    parser.add_argument("-k", type=int, help="override speculation.k (drafted tokens per round)")
    parser.add_argument("--fanout", choices=["uniform", "geometric"], help="override speculation.fanout.kind")
    parser.add_argument("--budget", type=int, help="override speculation.fanout.budget (branches per round)")
    parser.add_argument("--saguaro-c", type=float, help="override speculation.saguaro_c")
    parser.add_argument("--backup", choices=["neural", "ngram", "random"], help="override speculation.backup")
    parser.add_argument("--max-new-tokens", type=int, help="override generation.max_new_tokens")
    parser.add_argument("--temperature", type=float, help="override sampling.temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, help="override sampling.top_k")
    parser.add_argument("--top-p", type=float, help="override sampling.top_p")
    parser.add_argument("--seed", type=int, help="override sampling.seed")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--threads", type=int, help="override runtime.threads")
    for role in ("target", "draft"):
        parser.add_argument(f"--{role}-precision", choices=sorted(PRECISIONS),
                            help=f"override {role}.dtype and {role}.quantization (auto: fastest on this host)")
    parser.add_argument("--log-level", default="INFO", help="logging level")


def config_from_args(args: argparse.Namespace) -> Config:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {}
    fanout = {k: v for k, v in (("kind", args.fanout), ("budget", args.budget)) if v is not None}
    if fanout:
        overrides["speculation"] = {"fanout": fanout}
    for section, key, value in [
        ("speculation", "saguaro_c", args.saguaro_c),
        ("speculation", "backup", args.backup),
        ("speculation", "mode", args.mode),
        ("speculation", "k", args.k),
        ("generation", "max_new_tokens", args.max_new_tokens),
        ("generation", "stop", args.stop),
        ("sampling", "temperature", args.temperature),
        ("sampling", "top_k", args.top_k),
        ("sampling", "top_p", args.top_p),
        ("sampling", "seed", args.seed),
        ("runtime", "threads", args.threads),
    ]:
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    for role in ("target", "draft"):
        precision = getattr(args, f"{role}_precision")
        if precision:
            dtype, quantization = PRECISIONS[precision]
            overrides[role] = {"dtype": dtype, "quantization": quantization}
    try:
        return load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
