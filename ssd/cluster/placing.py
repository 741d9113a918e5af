"""Where a cluster's actors go and how they start: the Ray nodes, the devices'
environments, the configurations refused up front, Ray itself, and how long
a model may take to load (see ssd.cluster.runtime)."""

from __future__ import annotations

import logging
import os

import ray

from ssd.cluster.devices import Placement
from ssd.config import Config, ConfigError, ModelConfig

log = logging.getLogger(__name__)

# Loading a target rank or the draft: this much, plus the weights' bytes at
# LOAD_BYTES_PER_S (a slow network disk; a 70B model in bf16: ~25 more minutes),
# unless cluster.start_timeout_s says otherwise.
START_TIMEOUT_S = 300.0
LOAD_BYTES_PER_S = 100e6


def resolve_node(name: str) -> str:
    """The ID (hex) of the alive Ray node `name` names, by its node ID or its IP address."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    for node in alive:
        if name in (node["NodeID"], node["NodeManagerAddress"]):
            return node["NodeID"]
    known = ", ".join(f"{n['NodeID']} ({n['NodeManagerAddress']})" for n in alive)
    raise ConfigError(f"cluster.draft_node (--draft-node) {name!r} names no alive Ray node; the nodes: {known}")


def node_resources(node: str) -> dict[str, float]:
    """What Ray node `node` (hex ID) has in all: {"CPU": 4.0, "GPU": 2.0, ...} (empty once it left)."""
    return next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node and n["Alive"]), {})


def group_node(pg) -> str:
    """The node a placement group packed on one node (STRICT_PACK) is on now."""
    return ray.util.placement_group_table(pg)["bundles_to_node_id"][0]


def compute_device(config: Config, placement: Placement) -> str:
    """Where the actors compute: as placed, unless the config keeps them on the CPU."""
    return "cuda" if placement.kind == "cuda" and config.cluster.compute_device != "cpu" else "cpu"


def actor_env(kind: str, group: tuple[int, ...], index: int, compute: str) -> dict[str, str]:
    """The environment of the actor at `index` of `group` (the devices its role holds: the
    target's GPUs for every target rank, its own for the draft) that computes on `compute`.

    On GPUs, every rank of a group sees the group's GPUs, the ones the user named (not the
    ones Ray would pick for the bundles), and LOCAL_RANK picks its own, as vLLM and Ray
    Train do: a process that saw only its own GPU would block CUDA IPC between the ranks'
    GPUs for NCCL (NVIDIA/nccl#129). Computing on the CPU, no GPU at all: transformers
    places a model (and a tensor-parallel shard) from the accelerator it finds and
    LOCAL_RANK, not from the device we pass. SSD_PLACED_GPU keeps the placement on record.
    """
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, group)) if compute == "cuda" else ""}
    if compute == "cuda":
        env["LOCAL_RANK"] = str(index)
    if kind == "cuda":
        env |= {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "SSD_PLACED_GPU": str(group[index])}
    return env


def refuse_unworkable(config: Config, placement: Placement) -> None:
    """Configurations that cannot run as placed, refused before any actor starts."""
    if compute_device(config, placement) != "cuda":
        return
    roles = [("target", config.target)] + ([("draft", config.draft)] if placement.draft else [])
    for role, model in roles:
        if model.quantization == "int8":
            raise ConfigError(
                f"{role}.quantization int8 runs on CPU only (fbgemm kernels) but the {role} is placed on a GPU; "
                f"set {role}.quantization to null or auto (auto picks none on GPUs)"
            )


def refuse_unsplittable(config: Config, placement: Placement, device: str) -> None:
    """A target its tensor-parallel size cannot split, refused naming --target-gpus (or
    --target-cores) before any actor starts: the ranks would load and then fail inside
    attention at the first forward. Reads the checkpoint's config (prefetched)."""
    world = placement.tp_size
    if world == 1:
        return
    flag = "--target-gpus" if placement.kind == "cuda" else "--target-cores"
    from ssd.models.loading import LLAMACPP, resolve_backend

    if resolve_backend(config.target, device) == LLAMACPP:
        raise ConfigError(f"{flag}: {world} target ranks need a torch target; target.backend llamacpp "
                          "(a GGUF model) runs on one device")
    from ssd.models.tp import undivided

    if wrong := undivided(target_shape(config.target), world):
        raise ConfigError(
            f"{flag}: {world} target ranks cannot split target {config.target.name} ({', '.join(wrong)} "
            f"not divisible by {world}); name a number of target devices that divides them, or another target"
        )


def target_shape(model: ModelConfig) -> dict[str, int]:
    """The dimensions a tensor-parallel split divides, from the model's config (no weights)."""
    from ssd.models.loading import TINY, resolve_source
    from ssd.models.tp import TP_DIVIDED

    if model.name == TINY:
        return {name: getattr(model.tiny, name) for name in TP_DIVIDED}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(resolve_source(model.name))
    hf = getattr(hf, "text_config", hf)  # a multimodal config's language model
    shape = {name: getattr(hf, name, None) for name in TP_DIVIDED}
    if shape["num_key_value_heads"] is None:  # older configs: as many KV heads as query heads
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    return shape


def start_ray(address: str | None) -> None:
    """ray.init, with our actors at the driver's CPU priority.

    Ray's raylet starts worker processes at nice 15 (its `worker_niceness`),
    so on a busy host any other process takes the CPU from the target and
    the draft first, while AR and SD in one process run at the driver's
    priority. The raylet reads RAY_worker_niceness from its environment when
    it starts: this holds for a Ray we start here. Joining a running cluster
    (`address`) keeps that cluster's setting; `Cluster` logs the actors'
    niceness when it differs from the driver's. A RAY_worker_niceness the
    user set is kept.
    """
    os.environ.setdefault("RAY_worker_niceness", str(os.nice(0)))
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)


def start_timeout_s(config: Config, weight_bytes: int) -> float:
    """How long an actor may take to load a model whose weights take `weight_bytes`."""
    if config.cluster.start_timeout_s is not None:
        return config.cluster.start_timeout_s
    return START_TIMEOUT_S + weight_bytes / LOAD_BYTES_PER_S


def prefetch_models(config: Config, with_draft: bool, device: str = "cpu") -> dict[str, float]:
    """Download, convert or join the models once, here in the driver; each role's start-up timeout.

    The actors of one placement group run on one node: a driver on that
    node fills the cache they read (another node's driver still downloads,
    and the actors then fetch for themselves, under the same timeouts).
    """
    from ssd.models.loading import prefetch_model

    roles = [("target", config.target)] + ([("draft", config.draft)] if with_draft else [])
    timeouts = {}
    for role, model in roles:
        size = prefetch_model(model, device)
        timeouts[role] = start_timeout_s(config, size)
        log.info("%s %s: %.1f GB of weights, start-up timeout %.0f s", role, model.name, size / 1e9, timeouts[role])
    return timeouts
