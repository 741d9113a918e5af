"""GPU smoke run: exactness and costs on one device, without Ray, a hub or a package registry.

    python launch/gpu_smoke.py --out results/smoke                 # CUDA if present, real shapes
    python launch/gpu_smoke.py --device cpu --shapes small --out /tmp/smoke   # CPU, seconds
    python launch/gpu_smoke.py --out $OUT --trace t0.safetensors   # also plan from a trace of the real pair

Random weights at the real pair's shapes (configs/models/), so nothing but
this repository has to reach the machine. Checks: fp32 greedy AR = SD = SSD
with SSD's draft side in a second process over the host link (gloo on
127.0.0.1), on the real pair and on a pair whose draft is a noisy copy of
its target; tree-masked branch decoding = sequential decoding under each
SDPA backend the device runs; CUDA graph replays = the lean forward, on the
device and on another index when the machine has several GPUs, and batched
rows' graph replays (2 and batching.max_rows sequences) = the lean packed forward; SD at T = 1
in batched rows samples the target's exact law (chi-square, 4-token vocabulary). Timings: target step, verify(K) for K + 1
tokens, backup, build, one draft tree step per budget, link round trips.

Writes OUT/costs.json ("ssd-ablation-costs/1": `launch/ablate.py plan
--trace T --costs OUT/costs.json` reads it), OUT/smoke.json (everything) and
OUT/summary.txt; prints the summary. Exit status 1 when a check failed.
Needs torch, transformers, msgpack, numpy, pyyaml, tqdm and safetensors
(msgpack is the one transformers does not bring: a copy of its package
directory on PYTHONPATH is enough).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from pathlib import Path

import torch

from ssd.saguaro.costs import DEFAULT_BUDGETS, DEFAULT_KS
from ssd.tools.bench.sampling_check import SAMPLES
from ssd.tools.bench.smoke import SmokeSettings, run_smoke, summary_text

# Per --shapes: enough tokens to cross many rounds, little enough to stay in minutes.
DEFAULTS = {
    "real": {"max_new_tokens": 64, "prompts": 3, "prompt_len": 32, "link_rounds": 200},
    "small": {"max_new_tokens": 32, "prompts": 2, "prompt_len": 16, "link_rounds": 50},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--shapes", choices=["real", "small"],
                        help="model shapes (default: real on a GPU, small on a CPU)")
    parser.add_argument("--out", type=Path, help="directory for costs.json, smoke.json and summary.txt")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per prompt in the generation checks")
    parser.add_argument("--prompts", type=int, help="random prompts per generation check")
    parser.add_argument("--prompt-len", type=int, help="tokens per random prompt")
    parser.add_argument("-k", type=int, default=4, help="drafted tokens per round in the SD and SSD checks")
    parser.add_argument("--budget", type=int, default=8, help="SSD branches per round in the checks")
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="K values to time")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS), help="budgets B to time")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per point (median)")
    parser.add_argument("--prefix", type=int, default=200, help="context tokens in the KV caches while timing")
    parser.add_argument("--timing-dtype", choices=["fp32", "bf16"], help="default: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--branch-dtypes", nargs="+", choices=["fp32", "bf16"],
                        help="dtypes of the branch check (default: fp32, plus bf16 on a GPU)")
    parser.add_argument("--link-rounds", type=int, help="round trips per message in the link timing")
    parser.add_argument("--sampling-samples", type=int, default=SAMPLES,
                        help="seeded SD requests in the T > 0 distribution check")
    parser.add_argument("--trace", type=Path, help="a recorded trace of the real pair: also plan from it")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: 1 on a CPU)")
    parser.add_argument("--noise", type=float, default=0.03, help="the noisy pair's relative weight noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=180.0, help="bound on every wait for the second process")
    parser.add_argument("--deadline-s", type=float, default=570.0,
                        help="dump every thread's traceback and exit after this long (a wedged run still says where)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def settings_from_args(args: argparse.Namespace) -> SmokeSettings:
    on_gpu = args.device.startswith("cuda")
    shapes = args.shapes or ("real" if on_gpu else "small")
    sized = {name: getattr(args, name) if getattr(args, name) is not None else value
             for name, value in DEFAULTS[shapes].items()}
    return SmokeSettings(
        device=args.device, shapes=shapes, out=args.out, k=args.k, budget=args.budget, ks=tuple(args.ks),
        budgets=tuple(args.budgets), repeats=args.repeats, prefix=args.prefix, timing_dtype=args.timing_dtype,
        branch_dtypes=tuple(args.branch_dtypes) if args.branch_dtypes else None, trace=args.trace,
        threads=args.threads, noise=args.noise, seed=args.seed, timeout_s=args.timeout_s,
        sampling_samples=args.sampling_samples, **sized,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device: CUDA is not available here; use --device cpu")
    if args.trace is not None and not args.trace.is_file():
        sys.exit(f"error: --trace: file not found: {args.trace}")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    faulthandler.dump_traceback_later(args.deadline_s, exit=True)
    report = run_smoke(settings)
    faulthandler.cancel_dump_traceback_later()
    print(summary_text(report))
    if args.out:
        print(f"wrote {args.out / 'costs.json'}, {args.out / 'smoke.json'}, {args.out / 'summary.txt'}")
    return 0 if report.passed else 1

