"""The driver's view of a cluster: start Ray, place the actors, link them,
serve requests, heal the draft link, restart a lost target, shut everything
down.

Faults: the speculator restarts under Ray (max_restarts=-1) and the watcher
re-links it in the background while requests run degraded. A target rank
that dies takes the service down: health listeners hear NOT_SERVING, the
watcher starts every rank again, re-links the draft and reports SERVING.
Requests run on one path, a batch on target rank 0 (ssd.cluster.batch, also
for a tensor-parallel target): a row that had streamed
nothing yet waits and runs again from its prompt; one that had streamed
tokens fails with GeneratorUnavailable (the client retries), since a re-run
need not reproduce a sampled prefix. A forward that fails on a
tensor-parallel rank (ssd.models.tp.TPForwardError) breaks the group the
same way, with the other ranks stuck in a collective: the watcher finds it
(a follower's call returned, or rank 0 says so), restarts every rank, and
the request fails at once with that error (it is not run again: the same
prompt would likely fail the same way).

Placement: one Ray placement group bundle per target rank and one for the
speculator, packed on one node. On CPU each bundle is a core the actor pins
itself to; on GPU each bundle is {GPU: share, CPU: 1} (an actor that names
resources also takes one CPU) and each actor sees exactly the GPU the user
named (CUDA_VISIBLE_DEVICES, set by us, not by Ray). Colocated roles share
one GPU with fractional bundles. `cluster.compute_device: cpu` keeps the
placement but computes on the CPU (orchestration tests without GPUs).
`cluster.draft_node` takes the speculator out of the group onto a named node
(Ray's node affinity); the link then meets at the target node's address.
Several clusters behind one endpoint: ssd.cluster.replicas.

Its parts, one module each: placing.py (nodes, environments, Ray, load
timeouts), actors.py (the placement group and the actors), link.py (the draft
link and its healing), planning.py (SSD's start-up plan), healing.py (the
watcher, a lost target's restart, health).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, Callable

import ray

from ssd.cluster.actors import Actors
from ssd.cluster.batch import RemoteBatchEngine
from ssd.cluster.devices import Placement
from ssd.cluster.healing import Healing, HealthListener
from ssd.cluster.link import DraftLink
from ssd.cluster.placing import (
    compute_device,
    prefetch_models,
    refuse_unsplittable,
    refuse_unworkable,
    resolve_node,
    start_ray,
)
from ssd.cluster.planning import StartupPlan
from ssd.cluster.standby import Standby, refuse_standby
from ssd.config import Config
from ssd.engine.request import GenerationRequest, GenerationResult

__all__ = ["Cluster"]

log = logging.getLogger(__name__)


class Cluster(Actors, DraftLink, StartupPlan, Healing, Standby):
    """One target (its TP ranks) and its speculator, and what keeps them serving.

    `node`: the Ray node (hex ID) to pack the group on where it has room (the
    replicas spread over nodes this way); `name` tells replicas apart in logs;
    `place(node)`: the group's devices on the node Ray packed it on (replicas
    sharing a node get disjoint ones), else `placement` as given.
    """

    def __init__(
        self, config: Config, placement: Placement, address: str | None = None, node: str | None = None,
        name: str = "cluster", place: Callable[[str], Placement] | None = None,
    ) -> None:
        refuse_unworkable(config, placement)
        refuse_standby(config, placement)
        self.config = config
        self.placement = placement
        self.name = name
        self.device = compute_device(config, placement)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            start_ray(address)
        self._stopping = threading.Event()  # set: shut down; also ends a start-up that waits for room
        self._prefixes = (f"ssd-link-{os.getpid()}-{n}" for n in itertools.count())
        # The speculator on a node of its own (outside the group): the link then runs between hosts.
        wanted = config.cluster.draft_node if placement.draft else None
        self.draft_node = resolve_node(wanted) if wanted else None
        self._start_timeouts = prefetch_models(config, bool(placement.draft), self.device)
        refuse_unsplittable(config, placement, self.device)
        self._place, self._placed_on = place, None
        self._standby, self._standby_lock = None, threading.Lock()  # cluster.warm_standby's target
        self._standby_loading: threading.Thread | None = None
        self._pg = self._reserve(node)
        self._start_actors()
        self.actor_niceness = self._check_priority()
        self._serving = None
        self._draft_pid: int | None = None  # the speculator process last asked to link
        self._linked_pid: int | None = None  # ... and the one the target holds a link to
        self._watching = threading.Event()  # set: the watcher should look now
        self._up = threading.Event()  # clear while the target is lost and restarting
        self._why_down: str | None = None
        self._tp_failure: tuple[int, str] | None = None  # (target_restarts when found, why)
        self._listeners: list[HealthListener] = []
        self._listeners_lock = threading.Lock()
        self.target_restarts = 0
        self.link_address: tuple[str, int] | None = None  # where the draft last met the target
        self.plan = None  # SSD's start-up plan (ssd.saguaro.plan.Plan), when one ran
        self.link_round_trip_s: float | None = None  # the link's, measured at each (re)link
        if self.draft is not None:
            probes = self._probe()  # before the link: the draft actor then runs its serve loop
            self.link()
            if probes is not None:
                self._plan(*probes)
        self._start_standby()
        self._up.set()
        self._watcher = threading.Thread(target=self._watch, name="ssd-cluster-watcher", daemon=True)
        self._watcher.start()

    # --------------------------------------------------------------- requests

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return ray.get(self.targets[0].encode.remote(text, chat))

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request as a batch of one on target rank 0 (the one request path,
        ssd.cluster.batch: its faults, streaming and cancellation). For a caller
        without a serving worker; not alongside one over the same cluster."""
        mode = request.settings(self.config.speculation).mode
        if mode == "ssd" and self.draft is None:
            raise ValueError("mode ssd needs a draft device")
        with self.batch_engine(mode) as engine:
            return engine.generate(request)

    def describe(self) -> dict[str, Any]:
        return ray.get(self.targets[0].describe.remote())

    def batch_engine(self, mode: str) -> RemoteBatchEngine:
        """A continuous batch of `mode` on target rank 0 (the serving worker drives it)."""
        cluster = self.config.cluster
        return RemoteBatchEngine(self, mode, call_s=cluster.step_call_s, deadline_s=cluster.step_deadline_s)

    # --------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the watcher, the speculator and the followers, free the actors and Ray."""
        self._stopping.set()
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=60)
        self._stop_standby()
        self._stop_actors()
        if self._started_ray:
            ray.shutdown()

    def close(self) -> None:
        """The Generator interface's name for shutdown."""
        self.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
