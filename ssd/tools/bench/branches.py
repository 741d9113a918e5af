"""Benchmark branch decoding on the real draft: tree mask vs batched KV cache.

For each B, times `start` (first token of every branch) and one `step` with a
200-token sequence cache (context + K drafted tokens), against a plain
1-token forward on the same cache. One thread, as the draft role runs.

    python launch/bench_branches.py                      # int8 and bf16 drafts
    python launch/bench_branches.py --variants int8 --branches 8 16 --repeats 5

Other engineers benchmark on this 2-core machine too: by default the script
waits until no other process keeps a core busy, and says if it gave up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ssd.config import ModelConfig
from ssd.hardware import sync
from ssd.models import load_model
from ssd.models.kv import KVSequence
from ssd.saguaro.branches import BRANCH_DECODERS, BranchDecoder, TreeBranchDecoder
from ssd.tools.bench.quiet import CpuWatch, wait_for_quiet

logger = logging.getLogger("bench_branches")

DRAFT = "qwen2.5-coder-0.5b-instruct"
VARIANTS = {
    "int8": ModelConfig(name=DRAFT, dtype="fp32", quantization="int8"),
    "bf16": ModelConfig(name=DRAFT, dtype="bf16"),
    "fp32": ModelConfig(name=DRAFT, dtype="fp32"),
}
GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"  # read by transformers at every sdpa call
# "tree+gqa": the tree decoder with transformers' sdpa told to pass
# enable_gqa=True; by default it repeats the kv heads whenever a mask is given.
IMPLS = {**BRANCH_DECODERS, "tree+gqa": TreeBranchDecoder}


# --- measurements ----------------------------------------------------------


def glued_sequence(model: torch.nn.Module, length: int, vocab: int, seed: int) -> KVSequence:
    """A sequence cache of `length` random tokens (context plus drafted tokens)."""
    rng = random.Random(seed)
    kv = KVSequence(model)
    kv.forward([rng.randrange(vocab) for _ in range(length)], last_only=True)
    return kv


def time_plain_forward(kv: KVSequence) -> float:
    """Seconds of one 1-token forward on the cache (rolled back after)."""
    t0 = time.perf_counter()
    sync(kv.forward([1], last_only=True))
    elapsed = time.perf_counter() - t0
    kv.rollback(kv.length - 1)
    return elapsed


def branch_layout(kv: KVSequence, n: int, k: int, seed: int) -> tuple[list[int], list[int]]:
    """n branches spread over accepted lengths 0..k, most at small k, as fan-out makes them."""
    rng = random.Random(seed)
    context = kv.length - k
    prefix = [context + min(i % (k + 1), i % 3) for i in range(n)]
    return prefix, [rng.randrange(1000, 20000) for _ in range(n)]


def time_round(decoder: BranchDecoder, kv: KVSequence, prefix: list[int], firsts: list[int], steps: int) -> tuple[float, list[float]]:
    """(start seconds, [step seconds]) for one round of branch decoding."""
    t0 = time.perf_counter()
    sync(decoder.start(kv, prefix, firsts))
    start = time.perf_counter() - t0
    step_times = []
    for i in range(steps):
        tokens = [(f + 7 * (i + 1)) % 30000 for f in firsts]
        t0 = time.perf_counter()
        sync(decoder.step(tokens))
        step_times.append(time.perf_counter() - t0)
    decoder.finish()
    return start, step_times


def time_impl(decoder: BranchDecoder, gqa: bool, kv: KVSequence, prefix: list[int], firsts: list[int],
              steps: int) -> tuple[float, list[float]]:
    """time_round with transformers' sdpa told (or not) to pass enable_gqa=True."""
    os.environ[GQA_ENV] = "1" if gqa else "0"
    try:
        return time_round(decoder, kv, prefix, firsts, steps)
    finally:
        os.environ.pop(GQA_ENV, None)


def bench_branches(kv: KVSequence, n: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Times per implementation (and the plain forward) for B = n.

    Round-robin over the implementations, one round each per repeat (order
    rotated), so that load from other processes hits all of them alike.
    """
    prefix, firsts = branch_layout(kv, n, args.k, args.seed + n)
    decoders = {kind: IMPLS[kind]() for kind in args.impls}
    for kind, decoder in decoders.items():  # warm-up at this shape
        time_impl(decoder, kind.endswith("+gqa"), kv, prefix, firsts, 1)
    times = {kind: {"start": [], "step": []} for kind in decoders}
    times["plain"] = {"step": []}
    kinds = list(decoders)
    for r in range(args.repeats):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            start, steps = time_impl(decoders[kind], kind.endswith("+gqa"), kv, prefix, firsts, args.k)
            times[kind]["start"].append(start)
            times[kind]["step"].extend(steps)
        times["plain"]["step"].extend(time_plain_forward(kv) for _ in range(args.k))
    assert kv.cache.get_seq_length() == kv.length == args.context
    return times


def bench_variant(name: str, args: argparse.Namespace, watch: CpuWatch) -> list[dict]:
    t0 = time.perf_counter()
    model = load_model(VARIANTS[name])
    logger.info("%s draft loaded in %.1f s", name, time.perf_counter() - t0)
    kv = glued_sequence(model, args.context, model.config.vocab_size, args.seed)
    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        time_plain_forward(kv)
    rows = []
    for n in tqdm(args.branches, desc=f"{name} draft", unit="B"):
        since = time.monotonic()
        times = bench_branches(kv, n, args)
        others = watch.load_since(since)
        plain = 1e3 * statistics.median(times.pop("plain")["step"])
        for kind, t in times.items():
            rows.append(
                {
                    "variant": name,
                    "impl": kind,
                    "branches": n,
                    "plain_ms": plain,
                    "start_ms": 1e3 * statistics.median(t["start"]),
                    "step_ms": 1e3 * statistics.median(t["step"]),
                    "step_min_ms": 1e3 * min(t["step"]),
                    "others_cores": others,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'draft':6} {'impl':8} {'B':>3} {'start ms':>9} {'step ms':>8} {'step / plain':>12} "
        f"{'ms/branch':>9} {'step min':>8} {'plain ms':>8} {'others':>6}"
    )
    for r in rows:
        print(
            f"{r['variant']:6} {r['impl']:8} {r['branches']:>3} {r['start_ms']:>9.1f} {r['step_ms']:>8.1f} "
            f"{r['step_ms'] / r['plain_ms']:>12.2f} {r['step_ms'] / r['branches']:>9.2f} "
            f"{r['step_min_ms']:>8.1f} {r['plain_ms']:>8.1f} {r['others_cores']:>6.2f}"
        )
    for variant in dict.fromkeys(r["variant"] for r in rows):
        plain = statistics.median(r["plain_ms"] for r in rows if r["variant"] == variant)
        print(f"{variant}: plain 1-token forward {plain:.1f} ms (median over the B rows)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["int8", "bf16"], choices=sorted(VARIANTS))
    parser.add_argument("--impls", nargs="+", default=["tree", "batched"], choices=sorted(IMPLS))
    parser.add_argument("--branches", nargs="+", type=int, default=[4, 8, 16, 24])
    parser.add_argument("--context", type=int, default=200, help="cached tokens: context plus K drafted")
    parser.add_argument("-k", type=int, default=4, help="drafted tokens (steps timed per round)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per configuration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=900, help="seconds to wait for a quiet machine")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    rows, quiet = [], True
    for name in args.variants:
        quiet &= wait_for_quiet(args.max_wait)
        watch = CpuWatch()
        rows.extend(bench_variant(name, args, watch))
        watch.stop()
    print_table(rows)
    print("others: mean cores other processes kept busy while a row was measured (2-core machine)")
    if not quiet or any(r["others_cores"] > 0.3 for r in rows):
        print("WARNING: other processes were using the CPU; some timings are inflated")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))

