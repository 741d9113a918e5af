"""Start the distributed runtime: target ranks and the speculator as Ray actors
on separate devices, linked by torch.distributed, behind the gRPC frontend.

    python launch/cluster.py --target-gpus 0-3 --draft-gpu 4 --config configs/<pair>.yaml
    python launch/cluster.py --target-gpus 0 --draft-gpu 0 --colocate    # one GPU, both roles on it
    python launch/cluster.py --cpu                          # serve on 127.0.0.1:50051 (gloo, cores as devices)
    python launch/cluster.py --cpu "def add(a, b):"         # one generation, then exit
    python launch/cluster.py --cpu --interactive            # one prompt per line on stdin
    python launch/cluster.py --cpu --http-port 8000         # + the OpenAI-compatible API at :8000/v1
    python launch/cluster.py --address auto --replicas 2 --target-gpus 0 --draft-gpu 1   # two nodes, one endpoint
    python launch/cluster.py --address auto --target-gpus 0 --draft-node 10.0.0.7        # the draft on another host
    python launch/cluster.py --cpu --warm-standby                                        # a lost target back in seconds

With no GPU, CPU mode is automatic: the target on core 0, the draft on core 1
(override with --target-cores / --draft-core). With no prompt it serves
ssd.v1.GenerationService (see launch/client.py) until Ctrl-C or SIGTERM, which
turn health NOT_SERVING, let running requests finish, and shut the actors,
the link and Ray down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ssd.app.cli import DEFAULT_CONFIG, add_config_args, add_serve_args, config_from_args, serve_options_from_args
from ssd.cluster.devices import (
    DeviceError,
    Placement,
    default_cpu_placement,
    plan_placement,
)
from ssd.config import ConfigError
from ssd.engine.request import GenerationRequest

log = logging.getLogger("cluster")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="prompt text (default: the config's prompt)")
    parser.add_argument("--target-gpus", help="GPUs for the target ranks, e.g. 0-3 (tensor parallel)")
    parser.add_argument("--draft-gpu", help="GPU for the draft, e.g. 4")
    parser.add_argument("--colocate", action="store_true",
                        help="let the draft share a target GPU (one-GPU machines; not the paper's setting)")
    parser.add_argument("--cpu", action="store_true", help="CPU mode: cores play the devices (automatic without a GPU)")
    parser.add_argument("--target-cores", help="CPU mode: cores for the target ranks, one rank per core")
    parser.add_argument("--draft-core", help="CPU mode: the draft's core")
    parser.add_argument("--address", help="join an existing Ray cluster (default: start one locally)")
    parser.add_argument("--replicas", type=int,
                        help="independent target + draft groups behind one endpoint, spread over the Ray "
                             "cluster's nodes (override cluster.replicas; default 1)")
    parser.add_argument("--warm-standby", action="store_true", default=None,
                        help="keep a second target loaded and idle that takes over a lost one in seconds "
                             "(the target's memory twice; override cluster.warm_standby)")
    parser.add_argument("--draft-node",
                        help="run the draft on this Ray node (node ID or IP address), apart from the target; "
                             "the link runs over TCP between the hosts (override cluster.draft_node)")
    parser.add_argument("--interactive", action="store_true", help="read prompts from stdin, one per line")
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    add_serve_args(parser)
    add_config_args(parser)
    parser.set_defaults(mode="ssd")
    return parser


def placement_from_args(args: argparse.Namespace, with_draft: bool, gpus: int | None = None) -> Placement:
    """GPU mode when GPUs are named (or visible), else CPU mode; `gpus` defaults to torch's count."""
    if gpus is None:
        gpus = available_gpus()
    if args.cpu or (gpus == 0 and not (args.target_gpus or args.draft_gpu)):
        if args.target_gpus or args.draft_gpu:
            raise DeviceError("--target-gpus/--draft-gpu need GPUs; in CPU mode use --target-cores/--draft-core")
        cores = os.cpu_count() or 1
        if args.target_cores is None and args.draft_core is None:
            return default_cpu_placement(cores, with_draft)
        return plan_placement(args.target_cores or "0", args.draft_core if with_draft else None, cores, "cpu")
    if args.target_cores or args.draft_core:
        raise DeviceError("--target-cores/--draft-core are for CPU mode; with GPUs use --target-gpus/--draft-gpu")
    if gpus == 0:
        raise DeviceError("--target-gpus/--draft-gpu need GPUs and this machine has none; use --cpu (cores as devices)")
    draft = args.draft_gpu if with_draft else None
    return plan_placement(args.target_gpus or "0", draft, gpus, "cuda", colocate=args.colocate)


def refuse_cpu_pair_on_gpus(args: argparse.Namespace, placement: Placement) -> None:
    """GPUs with no --config: the default is the CPU pair (a GGUF for llama.cpp, a 2-KV-head
    target no tensor-parallel split of 4 takes), which no GPU layout is meant for; refused
    before Ray starts, naming the GPU pairs."""
    if placement.kind != "cuda" or args.config != DEFAULT_CONFIG:
        return
    pairs = ", ".join(f"configs/{p.name}" for p in sorted(DEFAULT_CONFIG.parent.glob("*-gpu.yaml")))
    raise DeviceError(
        f"--config: GPUs need a GPU pair ({pairs}); the default, configs/{DEFAULT_CONFIG.name}, is the "
        f"CPU pair. E.g. --target-gpus 0-3 --draft-gpu 4 --config configs/qwen3-32b-gpu.yaml"
    )


def ray_address(args: argparse.Namespace) -> str:
    """--address, else $RAY_ADDRESS, else "local": a Ray of this run's own. Left to ray.init, no
    address may join a Ray that another run left on this host, whose actors run that run's code."""
    return args.address or os.environ.get("RAY_ADDRESS") or "local"


def available_gpus() -> int:
    """GPUs torch sees here, or those a running Ray instance declares (logical GPUs in tests)."""
    import ray
    import torch

    gpus = torch.cuda.device_count()
    if ray.is_initialized():
        gpus = max(gpus, int(ray.cluster_resources().get("GPU", 0)))
    return gpus
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    options = serve_options_from_args(args)  # a bad flag stops here, before the cluster starts
    try:
        placement = placement_from_args(args, with_draft=config.speculation.mode == "ssd")
        refuse_cpu_pair_on_gpus(args, placement)
    except DeviceError as exc:
        sys.exit(f"error: {exc}")
    _take_signals()  # SIGTERM takes the same clean path as Ctrl-C

    from ssd.cluster.replicas import start_cluster

    log.info("placement: %s (x%d replicas)", placement, config.cluster.replicas)
    try:
        cluster = start_cluster(config, placement, ray_address(args))
    except ConfigError as exc:  # e.g. more replicas than the Ray cluster holds, a --draft-node that is not there
        sys.exit(f"error: {exc}")
    with cluster:
        # ray.init installs a SIGTERM handler of its own (it exits the driver
        # at once, aborting it mid-shutdown): take the signals back.
        _take_signals()
        try:
            if args.prompt or args.interactive:
                prompts = sys.stdin if args.interactive else [args.prompt]
                for prompt in prompts:
                    if prompt.strip():
                        run_one(cluster, config, prompt.rstrip("\n"), args.chat)
            else:
                serve(cluster, options)
        except KeyboardInterrupt:
            log.info("interrupted; shutting down")
    return 0


def serve(cluster, options) -> None:
    """The gRPC frontend over the cluster, until interrupted."""
    from ssd.serve.cluster_backend import ClusterBackend
    from ssd.openai.server import OpenAIServer

    server = OpenAIServer(options, lambda: ClusterBackend(cluster))
    server.start()
    log.info("serving ssd.v1.GenerationService on %s:%d", options.host, server.port)
    if server.http_port is not None:
        log.info("serving the OpenAI-compatible API on %s:%d/v1", options.host, server.http_port)
    try:
        while not server.wait_for_termination(timeout=1.0):
            pass
    finally:
        server.stop()


def _take_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    """The first SIGINT or SIGTERM: drain and shut down. Later ones are only logged: a second
    exception raised into the drain (or into a wait, where it breaks the lock Python's
    Event.wait holds) would cut it short and leave a traceback."""
    for later in (signal.SIGINT, signal.SIGTERM):
        signal.signal(later, _already_stopping)
    log.info("%s: draining (running requests get the grace period), then shutting down",
             signal.Signals(signum).name)
    raise KeyboardInterrupt


def _already_stopping(signum: int, frame: object) -> None:
    log.warning("%s: already shutting down (running requests finish within the grace period; "
                "SIGKILL ends it now)", signal.Signals(signum).name)


def run_one(cluster, config, prompt: str, chat: bool) -> None:
    ids = cluster.encode(prompt, chat)
    # The cluster's speculation defaults: the start-up plan's, where one ran.
    result = cluster.generate(GenerationRequest(ids, config.sampling, config.generation, cluster.config.speculation))
    print(result.text, flush=True)
    line = result_line(result.stats, getattr(cluster, "plan", None), getattr(cluster, "placement", None))
    print(f"--- finish: {result.finish_reason}; {line}", file=sys.stderr, flush=True)


def result_line(stats, plan, placement: Placement | None) -> str:
    """The stats line (ssd.engine.metrics.GenerationStats), led by what ran and why where the
    start-up plan turned speculation off: the mode asked for is then not the one that ran."""
    reason = plan.off_reason() if plan is not None else None
    if reason is None or stats.ran == stats.mode:
        return stats.summary()
    cores = len(placement.target) + len(placement.draft) if placement is not None else 0
    where = {0: "the target's cores and the draft's", 2: "both cores"}.get(cores, f"{cores} cores")
    return (f"AR on {where}: the start-up plan turned speculation off because {reason} "
            f"(--always-speculate keeps {stats.mode.upper()} on); {stats.summary()}")

