"""Device lists for the launcher: parse, validate, place; the slots of one node's replicas. Pure; no Ray, no torch.

GPU mode: ids are CUDA device ordinals. CPU mode: ids are cores, and each
role is pinned to its own (so "separate devices" holds on a laptop).
"""

from __future__ import annotations

from dataclasses import dataclass

from ssd.config import ConfigError


class DeviceError(ValueError):
    """A device list is malformed, overlaps another, or names devices that do not exist."""


def parse_devices(text: str, what: str) -> list[int]:
    """'0-3' -> [0, 1, 2, 3]; '0,2,5' -> [0, 2, 5]; '1' -> [1]. Order kept, no repeats."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise DeviceError(f"{what}: range {part!r} runs backwards")
                ids += range(lo, hi + 1)
            else:
                ids.append(int(part))
        except ValueError as exc:
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(f"{what}: {text!r} is not a device list like '0-3' or '0,2,5'") from None
    if any(i < 0 for i in ids):
        raise DeviceError(f"{what}: device ids must be >= 0, got {text!r}")
    if len(set(ids)) != len(ids):
        raise DeviceError(f"{what}: {text!r} names a device twice")
    return ids


@dataclass(frozen=True)
class Placement:
    kind: str  # "cuda" | "cpu"
    target: tuple[int, ...]  # one device (GPU) or core (CPU) per target rank
    draft: tuple[int, ...]  # the draft's device(s); empty when no draft runs
    # The draft shares a target GPU (one-GPU machines). Not the paper's
    # setting: the two roles contend for one device.
    colocate: bool = False

    @property
    def tp_size(self) -> int:
        return len(self.target)

    def gpu_share(self, device: int) -> float:
        """The fraction of GPU `device` each actor placed on it reserves."""
        return 1.0 / (self.target + self.draft).count(device)


def plan_placement(
    target: str, draft: str | None, available: int, kind: str, colocate: bool = False
) -> Placement:
    """Validate the two device lists against each other and the machine."""
    noun = "GPU" if kind == "cuda" else "CPU core"
    target_ids = parse_devices(target, "target devices")
    draft_ids = parse_devices(draft, "draft device") if draft else []
    overlap = sorted(set(target_ids) & set(draft_ids))
    if colocate and kind != "cuda":
        raise DeviceError("--colocate shares a GPU between target and draft; on CPU each role gets its own core")
    if colocate and not overlap:
        raise DeviceError("--colocate puts the draft on one of the target's GPUs; the device lists do not overlap")
    if overlap and not colocate:
        raise DeviceError(
            f"target and draft devices overlap on {noun} {overlap}: each role needs its own"
            + (" (or pass --colocate to share one GPU, which is not the paper's setting)" if kind == "cuda" else "")
        )
    missing = [i for i in target_ids + draft_ids if i >= available]
    if missing:
        raise DeviceError(f"{noun} {missing} requested but this machine has {available} ({noun} 0-{available - 1})")
    return Placement(kind, tuple(target_ids), tuple(draft_ids), colocate)


def default_cpu_placement(cores: int, with_draft: bool) -> Placement:
    """CPU defaults: the target on core 0, the draft on core 1."""
    if with_draft and cores < 2:
        raise DeviceError("SSD on CPU needs at least 2 cores: one for the target, one for the draft")
    return plan_placement("0", "1" if with_draft else None, cores, "cpu")


def span(placement: Placement) -> int:
    """How many devices of its node one group's placement takes, counted from 0 (cores 0-1: 2)."""
    return max(placement.target + placement.draft) + 1


def shifted(placement: Placement, slot: int) -> Placement:
    """The placement of the `slot`-th group on one node: each device moved `slot` spans up
    (cores 0, 1 -> 2, 3 for slot 1), so the groups on a node never share a device."""
    step = slot * span(placement)
    return Placement(placement.kind, tuple(d + step for d in placement.target),
                     tuple(d + step for d in placement.draft), placement.colocate)


def groups_per_node(placement: Placement, cpus: float, gpus: float) -> int:
    """How many groups placed so fit on a node with `cpus` and `gpus` (Ray's count of them):
    whole spans of its cores (CPU mode) or GPUs, and a CPU per role (each actor holds one)."""
    roles = len(placement.target) + len(placement.draft)
    by_cpu = int(cpus) // (span(placement) if placement.kind == "cpu" else roles)
    return by_cpu if placement.kind == "cpu" else min(by_cpu, int(gpus) // span(placement))


class NodeSlots:
    """Which slot of its node each replica holds, so that replicas on one node get disjoint
    devices (ssd.cluster.replicas): slot k runs on `shifted(placement, k)`. Not thread-safe:
    the caller serializes."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.held: dict[int, tuple[str, int]] = {}  # replica -> (node, slot)

    def take(self, replica: int, node: str, cpus: float, gpus: float) -> Placement:
        """Replica `replica`'s devices on `node` (its lowest free slot), leaving the slot it held."""
        self.held.pop(replica, None)
        room = groups_per_node(self.placement, cpus, gpus)
        used = {slot for where, slot in self.held.values() if where == node}
        free = [slot for slot in range(room) if slot not in used]
        if not free:
            noun = "GPUs" if self.placement.kind == "cuda" else "cores"
            raise ConfigError(
                f"cluster.replicas (--replicas): node {node} ({cpus:g} CPUs, {gpus:g} GPUs) holds {room} "
                f"replica(s) of {span(self.placement)} {noun} each, all taken; replica {replica} has no devices there"
            )
        self.held[replica] = (node, free[0])
        return shifted(self.placement, free[0])
