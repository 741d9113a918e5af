"""Recovery times through the cluster (tiny pair, CPU cores as devices).

Draft: kills the speculator while idle and mid-request, and prints how long
until the target is linked again (full-speed SSD) and how soon the
interrupted request returned. Target: SIGKILLs target rank 0 while idle and
mid-request, and prints how long until the cluster noticed (NOT_SERVING),
until it serves again (every rank restarted, the draft re-linked: SERVING),
and how soon the interrupted request got its UNAVAILABLE.

    python launch/recovery.py --trials 3

With the real pair (int8 on x86), a target restart is mostly the model load;
the int8 cache (ssd.models.qcache) is what shortens it. Before and after:

    python launch/recovery.py --config configs/qwen2.5-coder-cpu.yaml --roles target --trials 2 --no-quant-cache
    python launch/recovery.py --config configs/qwen2.5-coder-cpu.yaml --roles target --trials 2

With a warm standby (cluster.warm_standby: a second target, loaded and idle,
takes over), each target trial first waits for the standby to be loaded:

    python launch/recovery.py --config configs/qwen2.5-coder-cpu.yaml --roles target --trials 2 --warm-standby
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import ray

from ssd import hardware
from ssd.app.cli import ROOT
from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import BACKENDS, GenerationConfig, SamplingConfig, load_config
from ssd.engine.request import GenerationRequest, GeneratorUnavailable
from ssd.models.loading import resolve_backend


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


def health_marks(cluster: Cluster) -> list[tuple[float, bool]]:
    marks: list[tuple[float, bool]] = []
    cluster.add_health_listener(lambda serving, why: marks.append((time.monotonic(), serving)))
    return marks


def standby_loaded(cluster: Cluster) -> None:
    """With cluster.warm_standby: wait until the standby is loaded (after a takeover it loads anew)."""
    while cluster.config.cluster.warm_standby and cluster._standby is None:
        time.sleep(0.2)


def target_trial(cluster: Cluster, marks: list[tuple[float, bool]]) -> dict[str, float]:
    assert cluster.wait_linked(120)
    standby_loaded(cluster)
    killed = time.monotonic()
    os.kill(ray.get(cluster.targets[0].ready.remote()), signal.SIGKILL)
    down, up = serving_again(cluster, marks, killed)
    standby_loaded(cluster)
    rounds: list[list[int]] = []
    kill: dict[str, float] = {}

    def kill_after_three_rounds(tokens: list[int]) -> None:
        rounds.append(tokens)
        if len(rounds) == 3:
            kill["at"] = time.monotonic()
            os.kill(ray.get(cluster.targets[0].ready.remote()), signal.SIGKILL)

    request = GenerationRequest([1, 2, 3], SamplingConfig(), GenerationConfig(max_new_tokens=400),
                                on_tokens=kill_after_three_rounds)
    try:
        cluster.generate(request)
        raise AssertionError("the request outlived its target")
    except GeneratorUnavailable:
        told = time.monotonic() - kill["at"]
    _, up_mid = serving_again(cluster, marks, kill["at"])
    return {"idle_not_serving_s": down, "idle_serving_s": up, "mid_unavailable_s": told, "mid_serving_s": up_mid}


def describe_target_trial(times: dict[str, float]) -> str:
    return (f"killed idle -> NOT_SERVING {times['idle_not_serving_s']:.2f} s, -> SERVING {times['idle_serving_s']:.1f} s; "
            f"killed mid-request -> UNAVAILABLE {times['mid_unavailable_s']:.2f} s, "
            f"-> SERVING {times['mid_serving_s']:.1f} s")


def serving_again(cluster: Cluster, marks: list[tuple[float, bool]], since: float) -> tuple[float, float]:
    """Seconds from `since` until the cluster reported itself down, and until back up."""
    while not any(at > since and serving for at, serving in marks) or not cluster.linked():
        time.sleep(0.05)
    down = next(at for at, serving in marks if at > since and not serving)
    up = next(at for at, serving in marks if at > down and serving)
    return down - since, up - since


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cluster.yaml")
    parser.add_argument("--roles", nargs="+", choices=["draft", "target"], default=["draft", "target"],
                        help="whose kills to time")
    parser.add_argument("--no-quant-cache", action="store_true",
                        help="int8 models quantize from the checkpoint at every (re)start")
    parser.add_argument("--json", type=Path, help="write the target trials' times here")
    parser.add_argument("--warm-standby", action="store_true",
                        help="cluster.warm_standby: a loaded idle target takes over a killed one")
    parser.add_argument("--backend", choices=list(BACKENDS),
                        help="override target.backend and draft.backend (torch: the int8 pair on x86)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = os.getloadavg()[0]
    print(f"{hardware.summary()}; load average {load_before:.2f}; {hardware.uptime()}", flush=True)
    cached = {"cache_quantized": not args.no_quant_cache} | ({"backend": args.backend} if args.backend else {})
    # SSD, as the cluster serves it; no start-up plan: it times the host (minutes with the
    # real pair) and does not change what is measured.
    config = load_config(args.config, {"target": cached, "draft": cached, "runtime": {"plan": False},
                                       "speculation": {"mode": "ssd"},
                                       "cluster": {"warm_standby": args.warm_standby}})
    started = time.monotonic()
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as cluster:
        print(f"started in {time.monotonic() - started:.1f} s", flush=True)
        marks = health_marks(cluster)
        for n in range(args.trials if "draft" in args.roles else 0):
            print(f"draft trial {n}: {trial(cluster)}", flush=True)
        rows = []
        for n in range(args.trials if "target" in args.roles else 0):
            times = target_trial(cluster, marks)
            load = os.getloadavg()[0]
            rows.append(times | {"trial": n, "load_average": load})
            print(f"target trial {n}: {describe_target_trial(times)}; load average {load:.2f}", flush=True)
    if args.json:
        backends = {role: resolve_backend(model) for role, model in (("target", config.target), ("draft", config.draft))}
        summary = {"machine": hardware.summary(), "config": str(args.config), "backends": backends,
                   "warm_standby": args.warm_standby,
                   "quant_cache": not args.no_quant_cache, "load_average_before": load_before,
                   "uptime": hardware.uptime(), "target_trials": rows}
        args.json.write_text(json.dumps(summary, indent=2) + "\n")

