"""The paper's regime on the lent GPU: AR / SD / SSD at a 32B target's shapes in one prepared run.

    python launch/gpu_bench.py --out docs/results/gpu/bench            # CUDA: Qwen2.5-32B shapes, bf16
    python launch/gpu_bench.py --device cpu --shapes tiny --out /tmp/b # CPU: tiny shapes, seconds

What it runs and writes: ssd/tools/bench/regime.py (bench.json, table.txt)
and OUT/log.txt (this run's log). Exit status 1 when an exactness check
failed or a phase raised; rows the deadline left no room for are listed as
cut, never guessed.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
import time
from pathlib import Path

import torch

from ssd.tools.bench.regime import BenchSettings, run_bench, table

# Per --shapes: what fits the deadline there (a 32B step is ~20 ms on an H100; tiny ones run on a shared CPU).
DEFAULTS = {
    "real": {"max_new_tokens": 48, "prompt_len": 32, "repeats": 3, "prefix": 128, "sampling_samples": 800},
    "tiny": {"max_new_tokens": 12, "prompt_len": 8, "repeats": 3, "prefix": 16, "sampling_samples": 200},
}
# The real pair's law (the shipped CPU pair, recorded on the CPU; docs/gpus.md says how).
RANK_LAW = Path(__file__).resolve().parents[3] / "configs" / "bench" / "rank_law_qwen2.5-coder.json"
# Seconds past --deadline-s after which a wedged run dumps every thread's traceback and exits.
HANG_GRACE_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cuda:N or cpu")
    p.add_argument("--shapes", choices=["real", "tiny"], help="default: real on a GPU, tiny on a CPU")
    p.add_argument("--out", type=Path, help="folder for bench.json, table.txt and log.txt")
    p.add_argument("--target", default="qwen2.5-32b", help="configs/models/<name>.yaml: the target's shapes")
    p.add_argument("--draft", default="qwen2.5-0.5b", help="the separate draft's shapes (forced acceptance)")
    p.add_argument("--view-layers", type=int, default=4, help="the view draft: the target's first L layers")
    p.add_argument("--acceptances", type=float, nargs="+", default=[0.8, 0.6, 0.9], help="levels, most wanted first")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8], help="K values timed and planned")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16], help="SSD branch budgets timed and planned")
    for name in ("max-new-tokens", "prompt-len", "repeats", "prefix", "sampling-samples"):
        p.add_argument(f"--{name}", type=int, help="default: per --shapes")
    p.add_argument("--rank-law", type=Path, default=RANK_LAW,
                   help="ranks of t* among the draft's (an Agreement JSON, made by python -m "
                   "ssd.tools.bench.rank_law): the forced draft's modelled SSD hit rate (default: %(default)s)")
    p.add_argument("--deadline-s", type=float, default=170.0, help="from the process's start; later rows are cut")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: 1 on a CPU, torch's on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    shapes = args.shapes or ("real" if args.device.startswith("cuda") else "tiny")
    sized = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS[shapes].items()}
    return BenchSettings(
        device=args.device, shapes=shapes, target=args.target, draft=args.draft, view_layers=args.view_layers,
        acceptances=tuple(args.acceptances), batches=tuple(args.batches), temperatures=tuple(args.temperatures),
        ks=tuple(args.ks), budgets=tuple(args.budgets), rank_law=args.rank_law, deadline_s=args.deadline_s,
        out=args.out, threads=args.threads, seed=args.seed, **sized)


def setup_logging(level: str, out: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(out / "log.txt", mode="w"))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s: %(message)s", handlers=handlers, force=True)


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """`started`: time.monotonic() at the process's start (the launch script's), so the deadline covers imports."""
    started = time.monotonic() if started is None else started
    args = build_parser().parse_args(argv)
    if args.rank_law is not None and not args.rank_law.is_file():
        sys.exit(f"error: --rank-law: file not found: {args.rank_law}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device: CUDA is not available here; use --device cpu")
    try:
        settings = settings_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    setup_logging(args.log_level, args.out)
    logging.getLogger(__name__).info("started %.1f s ago (imports); deadline %.0f s", time.monotonic() - started,
                                     args.deadline_s)
    # To the process's own stderr: a captured one (pytest's) has no file descriptor for the dump.
    faulthandler.dump_traceback_later(max(args.deadline_s - (time.monotonic() - started), 1.0) + HANG_GRACE_S,
                                      exit=True, file=sys.__stderr__)
    report = run_bench(settings, started)
    faulthandler.cancel_dump_traceback_later()
    print(table(report))
    return 0 if report.passed else 1
