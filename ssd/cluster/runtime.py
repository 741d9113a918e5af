"""The driver's view of a cluster: start Ray, place the actors, link them,
serve requests, heal the draft link, shut everything down.

Placement: one Ray placement group bundle per target rank and one for the
speculator, packed on one node. On CPU each bundle is a core the actor pins
itself to; on GPU each bundle is {GPU: share, CPU: 1} (an actor that names
resources also takes one CPU) and each actor sees exactly the GPU the user
named (CUDA_VISIBLE_DEVICES, set by us, not by Ray). Colocated roles share
one GPU with fractional bundles. `cluster.compute_device: cpu` keeps the
placement but computes on the CPU (orchestration tests without GPUs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ssd.cluster.devices import Placement
from ssd.cluster.workers import DraftWorker, TargetWorker, free_port
from ssd.config import Config, ConfigError
from ssd.engine.request import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

# The speculator holds the torch.distributed link in a blocking call, so it
# needs a second thread for ping/ready calls.
RemoteDraft = ray.remote(max_restarts=-1, max_concurrency=2)(DraftWorker)
RemoteTarget = ray.remote(max_restarts=0, max_concurrency=4)(TargetWorker)
WATCH_INTERVAL_S = 2.0  # how often the watcher checks the draft between requests


def compute_device(config: Config, placement: Placement) -> str:
    """Where the actors compute: as placed, unless the config keeps them on the CPU."""
    return "cuda" if placement.kind == "cuda" and config.cluster.compute_device != "cpu" else "cpu"


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


class Cluster:
    def __init__(self, config: Config, placement: Placement, address: str | None = None) -> None:
        refuse_unworkable(config, placement)
        self.config = config
        self.placement = placement
        self.device = compute_device(config, placement)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        self._prefixes = (f"ssd-link-{os.getpid()}-{n}" for n in itertools.count())
        self._pg = self._reserve()
        self.targets = self._start_targets()
        self.draft = self._start_draft() if placement.draft else None
        self._serving = None
        self._draft_pid: int | None = None
        self._watching = threading.Event()  # set: the watcher should look now
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        if self.draft is not None:
            self.link()
            self._watcher = threading.Thread(target=self._watch_draft, name="ssd-draft-watcher", daemon=True)
            self._watcher.start()

    # ----------------------------------------------------------------- start-up

    def _devices(self) -> list[int]:
        """The device of each bundle: target ranks first, then the draft."""
        return list(self.placement.target + self.placement.draft)

    def _bundle(self, device: int) -> dict[str, float]:
        if self.placement.kind == "cuda":
            return {"GPU": self.placement.gpu_share(device), "CPU": 1}
        return {"CPU": 1}

    def _reserve(self):
        pg = placement_group([self._bundle(d) for d in self._devices()], strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not reserve {[self._bundle(d) for d in self._devices()]} on one node "
                f"within 60 s; its resources: {ray.available_resources()}"
            ) from None
        return pg

    def _options(self, bundle: int, device: int) -> dict[str, Any]:
        resources = self._bundle(device)
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle),
            "num_cpus": resources["CPU"],
        }
        if self.placement.kind == "cuda":
            options["num_gpus"] = resources["GPU"]
            # The GPU the user named, not the one Ray would pick for the bundle.
            options["runtime_env"] = {"env_vars": {
                "CUDA_VISIBLE_DEVICES": str(device), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
            }}
        return options

    def _cores(self, device: int) -> list[int] | None:
        return [device] if self.placement.kind == "cpu" else None

    def _start_targets(self) -> list:
        config = dataclasses.asdict(self.config)
        world, tp_port = self.placement.tp_size, free_port()
        targets = [
            RemoteTarget.options(**self._options(rank, device)).remote(
                config, rank, world, self._cores(device), tp_port, self.device
            )
            for rank, device in enumerate(self.placement.target)
        ]
        ray.get([t.ready.remote() for t in targets])  # loading is collective under TP
        self._followers = [t.run_follower.remote() for t in targets[1:]]
        return targets

    def _start_draft(self):
        device = self.placement.draft[0]
        bundle = len(self.placement.target)
        draft = RemoteDraft.options(**self._options(bundle, device)).remote(
            dataclasses.asdict(self.config), self._cores(device), self.device
        )
        ray.get(draft.ready.remote())
        return draft

    # ------------------------------------------------------------------ the link

    def link(self) -> None:
        """(Re)connect target rank 0 and the speculator over a fresh two-rank group.

        The target adopts the new link before its next round, also in the
        middle of a request."""
        timeout = self.config.cluster.draft_timeout_s
        self._draft_pid = ray.get(self.draft.ready.remote(), timeout=60)
        port = ray.get(self.targets[0].free_port.remote())
        prefix = next(self._prefixes)
        self._serving = self.draft.serve.remote(port, prefix, timeout)
        ray.get(self.targets[0].connect_draft.remote(port, prefix, timeout))
        log.info("draft linked (%s)", prefix)

    @property
    def draft_pid(self) -> int | None:
        """The speculator process the target was last linked to."""
        return self._draft_pid

    def linked(self) -> bool:
        """The target holds a link to the speculator process that is running now."""
        try:
            pid = ray.get(self.draft.ready.remote(), timeout=10)
            return pid == self._draft_pid and ray.get(self.targets[0].link_up.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def wait_linked(self, timeout: float) -> bool:
        """Wait for the watcher to (re)link the draft; True once linked."""
        deadline = time.monotonic() + timeout
        while not self.linked():
            if time.monotonic() > deadline:
                return False
            self._watching.set()
            time.sleep(0.2)
        return True

    def _watch_draft(self) -> None:
        """Heal the draft off the request path: requests run degraded meanwhile
        and pick the new link up at their next round."""
        while not self._stopping.is_set():
            self._watching.wait(WATCH_INTERVAL_S)
            self._watching.clear()
            if self._stopping.is_set():
                return
            try:
                if not self.linked():
                    self.heal()
            except Exception:  # noqa: BLE001 - the watcher must outlive a failed attempt; it retries
                log.exception("healing the draft failed; retrying")

    def heal(self) -> None:
        """After the target lost its draft: restart the speculator (unless Ray
        already did) and link it again."""
        try:
            # The same process, alive but unlinked: its state is not to be trusted.
            stale = ray.get(self.draft.ready.remote(), timeout=10) == self._draft_pid
        except ray.exceptions.GetTimeoutError:  # hung as a whole
            stale = True
        except ray.exceptions.RayActorError:  # dead or restarting: Ray brings it back (max_restarts=-1)
            stale = False
        if stale:
            log.warning("restarting the speculator")
            ray.kill(self.draft, no_restart=False)
        deadline = time.monotonic() + 300
        while True:
            try:
                ray.get(self.draft.ready.remote(), timeout=30)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.link()

    # --------------------------------------------------------------- requests

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return ray.get(self.targets[0].encode.remote(text, chat))

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request on target rank 0; each round's tokens stream back as they land.

        `request.cancelled` is polled as each round arrives; True stops the
        request before its next round (finish reason "aborted").
        """
        mode = (request.speculation or self.config.speculation).mode
        if mode == "ssd" and self.draft is None:
            raise ValueError("mode ssd needs a draft device")
        stream = self.targets[0].generate_stream.options(num_returns="streaming").remote(request.portable())
        result, aborting = None, False
        for ref in stream:
            item = ray.get(ref)
            if isinstance(item, GenerationResult):
                result = item
            else:
                request.emit(item)
            if not aborting and request.is_cancelled():
                aborting = True
                self.targets[0].abort.remote()
        if mode == "ssd":
            self._watching.set()  # the watcher checks the link now, not on the request's path
        return result

    def describe(self) -> dict[str, Any]:
        return ray.get(self.targets[0].describe.remote())

    # --------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the speculator and the followers, free the actors and Ray."""
        self._stopping.set()
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=60)
        try:
            ray.get(self.targets[0].shutdown.remote(), timeout=30)
            ray.get(self._followers, timeout=30)
        except Exception:  # noqa: BLE001 - tearing down; whatever is left is killed below
            log.warning("clean shutdown failed; killing the actors", exc_info=True)
        for actor in [*self.targets, self.draft]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()

    def close(self) -> None:
        """The Generator interface's name for shutdown."""
        self.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
