"""Draft recovery times through the cluster (tiny pair, CPU cores as devices).

Kills the speculator while idle and mid-request, and prints how long until
the target is linked again (full-speed SSD) and how soon the interrupted
request returned.

    python launch/recovery.py --trials 3
"""

from __future__ import annotations

import argparse
import time

from _common import ROOT

import ray

from ssd import hardware
from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig, SamplingConfig, load_config
from ssd.engine.request import GenerationRequest


def relinked_after(cluster: Cluster, before: int | None, started: float) -> float:
    while cluster.draft_pid == before or not cluster.linked():
        time.sleep(0.1)
    return time.monotonic() - started


def trial(cluster: Cluster) -> str:
    assert cluster.wait_linked(120)
    before, killed = cluster.draft_pid, time.monotonic()
    ray.kill(cluster.draft, no_restart=False)
    idle = relinked_after(cluster, before, killed)
    marks: dict[str, float] = {}
    rounds: list[list[int]] = []

    def kill_after_three_rounds(tokens: list[int]) -> None:
        rounds.append(tokens)
        if len(rounds) == 3:
            marks["kill"] = time.monotonic()
            ray.kill(cluster.draft, no_restart=False)

    before = cluster.draft_pid
    request = GenerationRequest([1, 2, 3], SamplingConfig(), GenerationConfig(max_new_tokens=400),
                                on_tokens=kill_after_three_rounds)
    cluster.generate(request)
    returned = time.monotonic() - marks["kill"]
    linked = relinked_after(cluster, before, marks["kill"])
    return (f"killed idle -> linked {idle:.1f} s; killed mid-request -> result {returned:.2f} s, "
            f"-> linked (full-speed SSD) {linked:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    print(hardware.summary())
    config = load_config(ROOT / "configs" / "tiny-cluster.yaml")
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as cluster:
        for n in range(args.trials):
            print(f"trial {n}: {trial(cluster)}", flush=True)


if __name__ == "__main__":
    main()
