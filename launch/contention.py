"""How much the two SSD roles slow each other when they share a machine.

    python launch/contention.py                       # default pair, target core 0, draft core 1
    python launch/contention.py --config configs/tiny.yaml --repeats 3

Times the target's verification forward (K + 1 tokens after a 200-token
prefix, one thread, pinned to --target-core) alone, then while the draft
decodes --branches tokens per forward in a loop on --draft-core, then alone
again. On CPUs both roles stream weights from the same memory, so SSD's
verification is slower than the same forward measured alone (the cost model
in ssd.ablation uses the alone figure).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import time

import torch

from _common import add_config_args, config_from_args

from ssd.config import ModelConfig
from ssd.models.kv import KVSequence
from ssd.models.loading import load_model

log = logging.getLogger("contention")
PREFIX_TOKENS = 200
READY, STOP = 2, 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-core", type=int, default=0)
    parser.add_argument("--draft-core", type=int, default=1)
    parser.add_argument("--branches", type=int, default=8, help="tokens per draft forward (a branch step)")
    parser.add_argument("--repeats", type=int, default=8, help="timed verifications per phase (median)")
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    cores = os.sched_getaffinity(0)
    for name in ("target_core", "draft_core"):
        if getattr(args, name) not in cores:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not one of this process's cores {sorted(cores)}")
    if args.target_core == args.draft_core:
        parser.error("--target-core and --draft-core must differ")
    _pin(args.target_core)
    target = _prefilled(config.target)
    verify_ids = _ids(target, 1 + config.speculation.k, offset=7)
    _median_ms(target, verify_ids, 2)  # warm-up
    alone = _median_ms(target, verify_ids, args.repeats)
    busy = _with_draft_running(config.draft, args, lambda: _median_ms(target, verify_ids, args.repeats))
    again = _median_ms(target, verify_ids, args.repeats)
    print(
        f"target verification ({len(verify_ids)} tokens, 1 thread): alone {alone:.0f} ms, "
        f"draft busy on core {args.draft_core} {busy:.0f} ms, alone again {again:.0f} ms "
        f"-> x{busy / ((alone + again) / 2):.2f}"
    )


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def _ids(kv: KVSequence, n: int, offset: int = 0) -> list[int]:
    """n arbitrary in-vocabulary ids (the content does not change the cost)."""
    vocab = kv.model.config.vocab_size
    return [(1000 + offset + i) % vocab for i in range(n)]


def _prefilled(cfg: ModelConfig) -> KVSequence:
    kv = KVSequence(load_model(cfg))
    kv.forward(_ids(kv, PREFIX_TOKENS), last_only=True)
    return kv


def _median_ms(kv: KVSequence, ids: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        length = kv.length
        started = time.perf_counter()
        kv.forward(ids)
        times.append(time.perf_counter() - started)
        kv.rollback(length)
    return 1000 * statistics.median(times)


def _with_draft_running(cfg: ModelConfig, args: argparse.Namespace, measure) -> float:
    state = mp.Value("i", 1)
    worker = mp.Process(target=_draft_loop, args=(cfg, args.draft_core, args.branches, state), daemon=True)
    worker.start()
    try:
        while state.value != READY:
            if not worker.is_alive():
                raise RuntimeError("the draft process died while loading; see its log")
            time.sleep(0.2)
        return measure()
    finally:
        state.value = STOP
        worker.join(timeout=30)


def _draft_loop(cfg: ModelConfig, core: int, branches: int, state) -> None:
    _pin(core)
    kv = _prefilled(cfg)
    state.value = READY
    while state.value != STOP:
        length = kv.length
        kv.forward(_ids(kv, branches, offset=3))
        kv.rollback(length)


if __name__ == "__main__":
    main()
