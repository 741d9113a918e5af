"""What fusing the int8 q/k/v and gate/up projections saves, per forward, on this host.

    python launch/bench_fusion.py                         # the configured draft and target, one thread
    python launch/bench_fusion.py --roles draft --repeats 50 --json fusion.json

Each model is loaded once in fp32, quantized to int8 (separate projections)
and copied with them fused; the two variants run interleaved on the lean
forward: a 1-token step and a (K+1)-token verification after 200 cached
tokens (ssd.tools.bench.fusion).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402

from ssd import hardware  # noqa: E402
from ssd.tools.bench.fusion import compare, format_rows, unfused_and_fused  # noqa: E402
from ssd.app.cli import add_config_args, config_from_args  # noqa: E402
from ssd.models import load_model  # noqa: E402
from ssd.models.invariant import use_row_attention  # noqa: E402
from ssd.models.quant import quantize_int8  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roles", nargs="+", default=["draft", "target"], choices=["draft", "target"])
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per variant and length")
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    torch.set_num_threads(config.runtime.threads or 1)
    out = {"machine": hardware.describe(), "threads": torch.get_num_threads(), "k": config.speculation.k}
    print(f"machine: {hardware.summary()}; {torch.get_num_threads()} thread(s)")
    for role in args.roles:
        model_config = dataclasses.replace(getattr(config, role), dtype="fp32", quantization=None)
        unfused, fused = unfused_and_fused(use_row_attention(quantize_int8(load_model(model_config))))
        rows = compare(unfused, fused, k=config.speculation.k, repeats=args.repeats)
        print(format_rows(f"{role} {model_config.name}", rows))
        out[role] = {"model": model_config.name, "rows": [dataclasses.asdict(r) for r in rows]}
        del unfused, fused
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
