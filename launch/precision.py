"""Speed and quality of each target precision on this host.

    python launch/precision.py                        # fp32, bf16, int8, torch.ao int8: speed and quality
    python launch/precision.py --precisions bf16 int8 --tokens 0     # speed only
    python launch/precision.py --precisions fp32 int8 --tokens 2048 --json precision.json

Speed: a 1-token step and a (K+1)-token verification after 200 cached tokens,
one thread unless --threads; "in steps" is their ratio (SD pays only when a
verification costs little more than a step). Quality: perplexity and greedy
(top-1) agreement on held-out code.

The text is CPython standard library source this Python ships (calendar.py,
difflib.py, queue.py by default; none of the prompt sets comes from them),
scored teacher-forced in chunks. "int8-tensor" is torch.ao's dynamic int8
with one activation scale per call, shown to compare with our per-row scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402

from ssd import hardware  # noqa: E402
from ssd.tools.bench.precision import HELD_OUT_FILES, compare, format_rows, held_out_text  # noqa: E402
from ssd.app.cli import add_config_args, config_from_args  # noqa: E402
from ssd.models import load_model, load_tokenizer  # noqa: E402

PRECISIONS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int8": ("fp32", "int8"), "int8-tensor": ("fp32", None)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                        help="target precisions to score; the first is the perplexity reference")
    parser.add_argument("--tokens", type=int, default=4096, help="positions to score (0: speed only)")
    parser.add_argument("--no-speed", action="store_true", help="quality only")
    parser.add_argument("--chunk", type=int, default=512, help="teacher-forced chunk length")
    parser.add_argument("--files", nargs="+", default=list(HELD_OUT_FILES), help="stdlib files to score")
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    torch.set_num_threads(config.runtime.threads or 1)
    ids = []
    if args.tokens:
        ids = load_tokenizer(config.target).encode(held_out_text(args.files), add_special_tokens=False)
        ids = ids[: args.tokens + 1]
    loaders = {name: _loader(config.target, name) for name in args.precisions}
    rows = compare(loaders, ids, args.chunk, k=None if args.no_speed else config.speculation.k)
    print(f"machine: {hardware.summary()}; {torch.get_num_threads()} thread(s)")
    print(f"target {config.target.name}" + (f", {len(ids) - 1} positions of {', '.join(args.files)}" if ids else ""))
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": hardware.describe(), "files": args.files, "rows": rows}, indent=2))
    return rows


def _loader(model_config, name: str):
    dtype, quantization = PRECISIONS[name]
    cfg = dataclasses.replace(model_config, dtype=dtype, quantization=quantization)

    def load() -> torch.nn.Module:
        model = load_model(cfg)
        if name == "int8-tensor":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        return model

    return load


if __name__ == "__main__":
    main()
