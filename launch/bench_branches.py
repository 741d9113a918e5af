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
import subprocess
import threading
import time
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ssd.config import ModelConfig  # noqa: E402
from ssd.hardware import sync  # noqa: E402
from ssd.models import load_model  # noqa: E402
from ssd.models.kv import KVSequence  # noqa: E402
from ssd.saguaro.branches import BRANCH_DECODERS, TreeBranchDecoder  # noqa: E402

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


# --- a quiet machine -------------------------------------------------------


def _cpu_ticks() -> dict[int, tuple[int, str]]:
    """pid -> (user + system clock ticks, command line) for every readable process."""
    ticks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        ticks[int(entry.name)] = (int(fields[11]) + int(fields[12]), cmd.strip())
    return ticks


def busy_processes(interval: float = 2.0, threshold: float = 0.3) -> list[tuple[float, int, str]]:
    """Other processes using more than `threshold` of a core over `interval` seconds.

    Measured over an interval: ps's %CPU is a lifetime average and still shows
    a finished burst as busy.
    """
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks()
    time.sleep(interval)
    after = _cpu_ticks()
    busy = []
    for pid, (ticks, cmd) in after.items():
        if pid == os.getpid() or pid not in before:
            continue
        share = (ticks - before[pid][0]) / hz / interval
        if share > threshold:
            busy.append((share, pid, cmd[:120]))
    return sorted(busy, reverse=True)


def wait_for_quiet(max_wait: float) -> bool:
    """Wait (up to max_wait s) until no other process keeps a core busy; True if quiet."""
    top = subprocess.run(["ps", "aux", "--sort=-%cpu"], capture_output=True, text=True).stdout
    logger.info("ps aux --sort=-%%cpu | head:\n%s", "\n".join(line[:160] for line in top.splitlines()[:10]))
    deadline = time.monotonic() + max_wait
    while busy := busy_processes():
        if time.monotonic() > deadline:
            logger.warning("machine still busy after %.0f s: %s", max_wait, busy)
            return False
        logger.info("waiting for a quiet machine: %s", busy)
        time.sleep(10)
    return True


class CpuWatch:
    """Samples, in a background thread, how many cores other processes keep busy."""

    def __init__(self, interval: float = 1.0) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, cores used by others)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            busy = busy_processes(interval, threshold=0.05)
            self.samples.append((time.monotonic(), sum(share for share, _, _ in busy)))

    def load_since(self, since: float) -> float:
        """Mean cores used by others in the samples taken after `since` (waits for one)."""
        while not (loads := [load for t, load in self.samples if t >= since]):
            if not self._thread.is_alive():
                return float("nan")
            time.sleep(0.1)
        return statistics.mean(loads)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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


def time_round(decoder, kv: KVSequence, prefix: list[int], firsts: list[int], steps: int) -> tuple[float, list[float]]:
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


def time_impl(decoder, gqa: bool, kv: KVSequence, prefix: list[int], firsts: list[int], steps: int):
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


def main() -> None:
    args = build_parser().parse_args()
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


if __name__ == "__main__":
    main()
