"""How much the two SSD roles slow each other when they share a machine.

    python launch/contention.py                       # default pair, target core 0, draft core 1
    python launch/contention.py --config configs/tiny.yaml --repeats 3

Times the target's verification forward (K + 1 tokens after a 200-token
prefix, one thread, pinned to --target-core) alone, then while the draft
decodes --branches tokens per forward in a loop on --draft-core, then alone
again. On CPUs both roles stream weights from the same memory, so SSD's
verification is slower than the same forward measured alone (the cost model
in ssd.tools.ablation uses the alone figure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ssd.tools.ablation.neighbour import arbitrary_ids, busy_neighbour, pin, prefilled
from ssd.app.cli import add_config_args, config_from_args
from ssd.hardware import sync
from ssd.models.kv import KVSequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--draft-core", type=int, default=1)
    parser.add_argument("--branches", type=int, default=8, help="tokens per draft forward (a branch step)")
    parser.add_argument("--repeats", type=int, default=8, help="timed verifications per phase (median)")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    cores = os.sched_getaffinity(0)
    for name in ("target_core", "draft_core"):
        if getattr(args, name) not in cores:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not one of this process's cores {sorted(cores)}")
    if args.target_core == args.draft_core:
        parser.error("--target-core and --draft-core must differ")
    pin(args.target_core)
    target = prefilled(config.target)
    verify_ids = arbitrary_ids(target, 1 + config.speculation.k, offset=7)
    _median_ms(target, verify_ids, 2)  # warm-up
    alone = _median_ms(target, verify_ids, args.repeats)
    with busy_neighbour(config.draft, args.draft_core, args.branches):
        busy = _median_ms(target, verify_ids, args.repeats)
    again = _median_ms(target, verify_ids, args.repeats)
    print(
        f"target verification ({len(verify_ids)} tokens, 1 thread): alone {alone:.0f} ms, "
        f"draft busy on core {args.draft_core} {busy:.0f} ms, alone again {again:.0f} ms "
        f"-> x{busy / ((alone + again) / 2):.2f}"
    )


def _median_ms(kv: KVSequence, ids: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        length = kv.length
        started = time.perf_counter()
        sync(kv.forward(ids))
        times.append(time.perf_counter() - started)
        kv.rollback(length)
    return 1000 * statistics.median(times)

