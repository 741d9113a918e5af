"""Which OpenMP wait policy and thread count to run torch with, on this host, quiet and beside a busy process.

torch's CPU kernels run on GNU OpenMP (libgomp), whose worker threads spin
after each parallel region before they sleep (OMP_WAIT_POLICY, GOMP_SPINCOUNT).
On a quiet host the spin makes a second thread pay; on a host with one other
busy process, a spinning thread can hold a core the other process needs and
its partner waits. Both effects depend on the CPU and the kernel (a host in
this project saw a 30x collapse of two threads; another saw none), so this
measures rather than assumes: each policy runs in a fresh process (the
variables are read when OpenMP starts), timing a draft-sized workload of
small int8 matmuls, alternating quiet and with `busy_background`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from ssd.tools.bench.background import busy_background

# Environment of each policy; "default" leaves libgomp's own choice.
POLICIES: dict[str, dict[str, str]] = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 10k": {"GOMP_SPINCOUNT": "10000"},
}
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# One process's measurement: 28 rounds of the four matmuls of a 0.5B draft
# layer (hidden 896, MLP 4864) at one row, ~112 int8 calls, as in a decode step.
PROBE = """
import json, statistics, sys, time, torch
from torch import nn
from ssd.models.quant import Int8Linear
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
shapes = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]
layers = [Int8Linear(nn.Linear(i, o)) for i, o in shapes]
inputs = [torch.randn(1, i) for i, _ in shapes]
def step():
    for _ in range(28):
        for layer, x in zip(layers, inputs):
            layer(x)
for _ in range(3):
    step()
times = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    step()
    times.append(time.perf_counter() - started)
print(json.dumps(1e3 * statistics.median(times)))
"""


@dataclass
class PolicyRow:
    policy: str
    threads: int
    background: bool
    ms: float  # median of the repeats' medians: one decode-sized step


def probe(policy: str, threads: int, repeats: int) -> float:
    """Median ms of one step, in a fresh process under `policy`."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES} | POLICIES[policy]
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads), str(repeats)],
                         env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout))


def measure(
    thread_counts: list[int], policies: list[str], rounds: int = 2, repeats: int = 25, progress: bool = True,
) -> list[PolicyRow]:
    """Every (policy, threads), quiet and beside one busy process, `rounds` times interleaved."""
    cases = [(p, t) for t in thread_counts for p in policies if t > 1 or p == "default"]
    times: dict[tuple[str, int, bool], list[float]] = {}
    with tqdm(total=2 * rounds * len(cases), desc="OpenMP policies", disable=not progress) as bar:
        for _ in range(rounds):
            for background in (False, True):
                with busy_background(background):
                    time.sleep(0.2 if background else 0)  # let the busy loop take its core
                    for policy, threads in cases:
                        times.setdefault((policy, threads, background), []).append(probe(policy, threads, repeats))
                        bar.update()
    return [PolicyRow(p, t, b, statistics.median(ms)) for (p, t, b), ms in times.items()]


def format_rows(rows: list[PolicyRow]) -> str:
    """One line per (policy, threads): quiet ms, with a busy process ms, and the ratio."""
    by_key = {(r.policy, r.threads, r.background): r.ms for r in rows}
    lines = ["policy    | threads | quiet ms | busy-bg ms | bg/quiet"]
    for policy, threads in dict.fromkeys((r.policy, r.threads) for r in rows):
        quiet, loaded = by_key[policy, threads, False], by_key[policy, threads, True]
        lines.append(f"{policy:9} | {threads:7} | {quiet:8.1f} | {loaded:10.1f} | {loaded / quiet:8.2f}")
    return "\n".join(lines)
