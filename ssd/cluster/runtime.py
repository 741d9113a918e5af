"""The driver's view of a cluster: start Ray, place the actors, link them,
serve requests, heal the draft link, restart a lost target, shut everything
down.

Faults: the speculator restarts under Ray (max_restarts=-1) and the watcher
re-links it in the background while requests run degraded. A target rank
that dies takes the service down: health listeners hear NOT_SERVING, the
watcher starts every rank again, re-links the draft and reports SERVING.
Requests run on one path, a batch on target rank 0 (ssd.cluster.batch, also
for a tensor-parallel target, held at one row): a row that had streamed
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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ssd.cluster.devices import Placement
from ssd.cluster.batch import RemoteBatchEngine
from ssd.cluster.workers import DraftWorker, TargetWorker
from ssd.config import Config, ConfigError
from ssd.engine.request import GenerationRequest, GenerationResult, GeneratorUnavailable
from ssd.transport.distributed import free_port

log = logging.getLogger(__name__)

# The speculator holds the torch.distributed link in a blocking call, so it
# needs a second thread for ping/ready calls.
RemoteDraft = ray.remote(max_restarts=-1, max_concurrency=2)(DraftWorker)
RemoteTarget = ray.remote(max_restarts=0, max_concurrency=4)(TargetWorker)
WATCH_INTERVAL_S = 2.0  # how often the watcher checks the actors between requests
RECOVERY_WAIT_S = 600.0  # how long a queued request waits for a lost target to come back
# Loading a target rank or the draft: this much, plus the weights' bytes at
# LOAD_BYTES_PER_S (a slow network disk; a 70B model in bf16: ~25 more minutes),
# unless cluster.start_timeout_s says otherwise.
START_TIMEOUT_S = 300.0
LOAD_BYTES_PER_S = 100e6

# (serving, why not): called when the cluster goes down or comes back.
HealthListener = Callable[[bool, str | None], None]


def resolve_node(name: str) -> str:
    """The ID (hex) of the alive Ray node `name` names, by its node ID or its IP address."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    for node in alive:
        if name in (node["NodeID"], node["NodeManagerAddress"]):
            return node["NodeID"]
    known = ", ".join(f"{n['NodeID']} ({n['NodeManagerAddress']})" for n in alive)
    raise ConfigError(f"cluster.draft_node (--draft-node) {name!r} names no alive Ray node; the nodes: {known}")


def compute_device(config: Config, placement: Placement) -> str:
    """Where the actors compute: as placed, unless the config keeps them on the CPU."""
    return "cuda" if placement.kind == "cuda" and config.cluster.compute_device != "cpu" else "cpu"


def actor_env(kind: str, device: int, compute: str) -> dict[str, str]:
    """The environment of an actor placed on `device` of `kind` that computes on `compute`.

    On a GPU, the GPU the user named (not the one Ray would pick for the
    bundle). Computing on the CPU, no GPU at all: transformers places a
    model (and a tensor-parallel shard) from the accelerator it finds and
    LOCAL_RANK, not from the device we pass, so a visible GPU would take
    every rank's weights to cuda:0. SSD_PLACED_GPU keeps the placement on
    record (logs, tests).
    """
    env = {"CUDA_VISIBLE_DEVICES": str(device) if compute == "cuda" else ""}
    if kind == "cuda":
        env |= {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "SSD_PLACED_GPU": str(device)}
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


def prefetch_models(config: Config, with_draft: bool) -> dict[str, float]:
    """Download or convert the models once, here in the driver; each role's start-up timeout.

    The actors of one placement group run on one node: a driver on that
    node fills the cache they read (another node's driver still downloads,
    and the actors then fetch for themselves, under the same timeouts).
    """
    from ssd.models.loading import prefetch

    roles = [("target", config.target)] + ([("draft", config.draft)] if with_draft else [])
    timeouts = {}
    for role, model in roles:
        size = prefetch(model.name)
        timeouts[role] = start_timeout_s(config, size)
        log.info("%s %s: %.1f GB of weights, start-up timeout %.0f s", role, model.name, size / 1e9, timeouts[role])
    return timeouts


class Cluster:
    """One target (its TP ranks) and its speculator, and what keeps them serving.

    `node`: the Ray node (hex ID) to pack the group on where it has room (the
    replicas spread over nodes this way); `name` tells replicas apart in logs.
    """

    def __init__(
        self, config: Config, placement: Placement, address: str | None = None, node: str | None = None,
        name: str = "cluster",
    ) -> None:
        refuse_unworkable(config, placement)
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
        self._start_timeouts = prefetch_models(config, bool(placement.draft))
        self._pg = self._reserve(node)
        self.targets = self._start_targets()
        self.draft = self._start_draft() if placement.draft else None
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
        self._up.set()
        self._watcher = threading.Thread(target=self._watch, name="ssd-cluster-watcher", daemon=True)
        self._watcher.start()

    # ----------------------------------------------------------------- start-up

    def _probe(self) -> tuple[dict, dict, dict] | None:
        """SSD's start-up probes (ssd.saguaro.startup), each half timed on its own actor
        (or read from the cache), where a plan is wanted: (target part, draft part, meta)."""
        from ssd.saguaro import startup

        if not startup.wanted(self.config, world=len(self.targets)):
            return None

        def measure() -> tuple[dict, dict]:
            target_part = ray.get(self.targets[0].plan_probe.remote())
            starts = target_part.pop("starts")
            draft_part = ray.get(self.draft.plan_probe.remote(target_part["sequences"], starts))
            return target_part, draft_part

        device = "one cpu core each" if self.device == "cpu" else self.device  # each role's, for the cache key
        key, meta = startup.config_key(self.config, [device, "cluster"])
        return (*startup.cached_probes(key, measure, meta), meta)

    def _plan(self, target_part: dict, draft_part: dict, meta: dict) -> None:
        """The plan, with the link's round trip on every round; the speculation defaults of
        the driver and the target change (before the first request)."""
        from ssd.saguaro import startup

        self.plan = startup.plan_from_probes(target_part, draft_part, meta, link_s=self.link_round_trip_s or 0.0)
        self.config = startup.planned(self.config, self.plan)
        ray.get(self.targets[0].set_speculation.remote(dataclasses.asdict(self.config.speculation)))

    def _devices(self) -> list[int]:
        """The device of each bundle: target ranks first, then the draft (unless it has a node of its own)."""
        return list(self.placement.target + (self.placement.draft if self.draft_node is None else ()))

    def _bundle(self, device: int) -> dict[str, float]:
        if self.placement.kind == "cuda":
            return {"GPU": self.placement.gpu_share(device), "CPU": 1}
        return {"CPU": 1}

    def _reserve(self, node: str | None):
        """One bundle per device, all on one node: `node` if it has room (Ray's soft
        target, which needs STRICT_PACK), else any node that has."""
        bundles = [self._bundle(d) for d in self._devices()]
        pg = placement_group(bundles, strategy="STRICT_PACK", _soft_target_node_id=node)
        try:
            ray.get(pg.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not reserve {bundles} on one node within 60 s; its resources: {ray.available_resources()}"
            ) from None
        return pg

    def _options(self, bundle: int | None, device: int) -> dict[str, Any]:
        """An actor's placement: bundle `bundle` of the group, or (None) the draft's own node."""
        resources = self._bundle(device)
        if bundle is None:
            where = NodeAffinitySchedulingStrategy(self.draft_node, soft=False)
        else:
            where = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle)
        options: dict[str, Any] = {"scheduling_strategy": where, "num_cpus": resources["CPU"]}
        if self.placement.kind == "cuda":
            options["num_gpus"] = resources["GPU"]
        options["runtime_env"] = {"env_vars": actor_env(self.placement.kind, device, self.device)}
        return options

    def _check_priority(self) -> list[int]:
        """The actors' niceness (targets, then the draft); a warning when the
        host favours other processes over them (a joined cluster's raylet)."""
        actors = self.targets + ([self.draft] if self.draft is not None else [])
        niceness = [where["niceness"] for where in ray.get([a.whereabouts.remote() for a in actors], timeout=60)]
        driver = os.nice(0)
        if max(niceness) > driver:
            log.warning(
                "the actors run at nice %s, the driver at %d: any other busy process on the host takes the CPU "
                "from them first (start that cluster's Ray with RAY_worker_niceness=%d)", niceness, driver, driver,
            )
        return niceness

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
        try:
            # loading is collective under TP
            self._await([t.ready.remote() for t in targets], self._start_timeouts["target"])
        except Exception:
            for target in targets:  # none may linger holding a bundle
                ray.kill(target, no_restart=True)
            raise
        self._followers = [t.run_follower.remote() for t in targets[1:]]
        return targets

    def _start_draft(self):
        device = self.placement.draft[0]
        bundle = len(self.placement.target) if self.draft_node is None else None
        draft = RemoteDraft.options(**self._options(bundle, device)).remote(
            dataclasses.asdict(self.config), self._cores(device), self.device
        )
        ray.get(draft.ready.remote(), timeout=self._start_timeouts["draft"])
        return draft

    def _await(self, refs: list, timeout: float) -> list:
        """ray.get(refs) within `timeout`, given up at once on shutdown (an actor
        may wait long for room, e.g. after its node left the cluster)."""
        deadline = time.monotonic() + timeout
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(done) == len(refs):
                return ray.get(refs)
            if self._stopping.is_set():
                raise RuntimeError(f"{self.name}: shutting down while actors started")
            if time.monotonic() > deadline:
                raise ray.exceptions.GetTimeoutError(f"{self.name}: actors not ready within {timeout:.0f} s")

    # ------------------------------------------------------------------ the link

    def link(self) -> None:
        """(Re)connect target rank 0 and the speculator over a fresh two-rank group.

        The target adopts the new link before its next round, also in the
        middle of a request."""
        timeout = self.config.cluster.draft_timeout_s
        self._draft_pid = ray.get(self.draft.ready.remote(), timeout=60)  # heal: a failed link makes it stale
        # A speculator on a node of its own reaches the target at its node's address (TCP between hosts).
        host, port = ray.get(self.targets[0].link_address.remote(self.draft_node is not None))
        prefix = next(self._prefixes)
        self._serving = self.draft.serve.remote(port, prefix, timeout, host)
        self.link_round_trip_s = ray.get(self.targets[0].connect_draft.remote(port, prefix, timeout, host))
        # Only now: until the target holds the new link, `linked()` must not
        # take the old one (dead, but not yet found so by an idle engine) for it.
        self._linked_pid = self._draft_pid
        self.link_address = (host, port)
        log.info("%s: draft linked (%s at %s:%d, round trip %.2f ms)", self.name, prefix, host, port,
                 self.link_round_trip_s * 1e3)

    @property
    def draft_pid(self) -> int | None:
        """The speculator process the target was last linked to."""
        return self._linked_pid

    def linked(self) -> bool:
        """The target holds a link to the speculator process that is running now."""
        try:
            pid = ray.get(self.draft.ready.remote(), timeout=10)
            return pid == self._linked_pid and ray.get(self.targets[0].link_up.remote(), timeout=10)
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

    def _watch(self) -> None:
        """Heal off the request path: a lost target is restarted (the service is
        down meanwhile); a lost draft is re-linked while requests run degraded
        and pick the new link up at their next round."""
        while not self._stopping.is_set():
            self._watching.wait(WATCH_INTERVAL_S)
            self._watching.clear()
            if self._stopping.is_set():
                return
            try:
                if not self._up.is_set() or not self.targets_alive():
                    self.restart_targets()
                elif (why := self.tp_broken()) is not None:
                    self._tp_failed(why)
                    self.restart_targets()
                elif self.draft is not None and not self.linked():
                    self.heal()
            except Exception:  # noqa: BLE001 - the watcher must outlive a failed attempt; it retries
                log.exception("healing the cluster failed; retrying")

    # ------------------------------------------------------------- the target

    def add_health_listener(self, listener: HealthListener) -> None:
        """Call `listener(serving, why)` whenever the cluster goes down or comes back."""
        with self._listeners_lock:
            self._listeners.append(listener)

    @property
    def serving(self) -> bool:
        return self._up.is_set()

    def targets_alive(self) -> bool:
        """Every target rank answers (a dead rank raises at once; a hung one times out)."""
        try:
            ray.get([t.ready.remote() for t in self.targets], timeout=30)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def tp_broken(self) -> str | None:
        """Why the tensor-parallel group is broken (a forward failed on some rank), or None.

        A follower's run_follower call returns only when stopped, so one that
        has returned (with TPForwardError or any other end) means a broken group.
        """
        if len(self.targets) < 2:
            return None
        done, _ = ray.wait(self._followers, num_returns=len(self._followers), timeout=0)
        for ref in done:
            rank = self._followers.index(ref) + 1
            try:
                commands = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the follower's end, as text
                return (str(getattr(exc, "cause", None) or exc).strip().splitlines() or [f"target rank {rank} failed"])[0]
            return f"target rank {rank} stopped mirroring after {commands} commands"
        try:
            return ray.get(self.targets[0].tp_failed.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None  # a lost rank: targets_alive() handles it

    def look_now(self) -> None:
        """Have the watcher check the actors now rather than at its next interval."""
        self._watching.set()

    def _tp_failed(self, why: str) -> None:
        """Record a broken group (for the request that was running) and mark the service down."""
        self._tp_failure = (self.target_restarts, why)
        self._down(f"tensor-parallel forward failed ({why})")

    def forward_failure(self, restarts_before: int) -> str | None:
        """The TP forward failure found while the targets of `restarts_before` ran, if any."""
        if self._tp_failure is not None and self._tp_failure[0] == restarts_before:
            return self._tp_failure[1]
        return None

    def _down(self, why: str) -> None:
        """Mark the service down (once) and wake the watcher to restart the target."""
        if self._up.is_set():
            self._why_down = why
            self._up.clear()
            log.error("%s: target lost (%s): not serving until it is restarted", self.name, why)
            self._tell(False, why)
        self._watching.set()

    def _tell(self, serving: bool, why: str | None) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(serving, why)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the recovery
                log.exception("a health listener failed")

    def restart_targets(self) -> None:
        """Start every target rank again (a TP group cannot take one new rank),
        re-link the draft, and report SERVING."""
        self._down(self._why_down or "a target rank does not answer")
        started = time.monotonic()
        for target in self.targets:
            ray.kill(target, no_restart=True)
        self.targets = self._start_targets()
        if self.draft is not None:
            self._relink_after_target_loss()
        self.target_restarts += 1
        self._why_down = None
        self._up.set()
        log.info("%s: target restarted in %.1f s; serving", self.name, time.monotonic() - started)
        self._tell(True, None)

    def _relink_after_target_loss(self) -> None:
        """The speculator's link ended with its peer: link the same process again
        once its serve call has returned, else restart it."""
        try:
            ray.get(self._serving, timeout=self.config.cluster.draft_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.heal()
            return
        except Exception:  # noqa: BLE001 - the link's end is expected to raise here
            pass
        try:
            self.link()
        except Exception:  # noqa: BLE001 - a speculator that cannot link is restarted
            log.warning("re-linking the speculator failed; restarting it", exc_info=True)
            self.heal()

    # -------------------------------------------------------------- the draft

    def heal(self) -> None:
        """After the target lost its draft: restart the speculator (unless Ray
        already did) and link it again. A lost target is restarted instead
        (which re-links the draft)."""
        if not self.targets_alive():
            self._down("a target rank does not answer")
            return
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
        deadline = time.monotonic() + self._start_timeouts["draft"]  # Ray's restart loads the draft again
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
        """One request as a batch of one on target rank 0 (the one request path,
        ssd.cluster.batch: its faults, streaming and cancellation). For a caller
        without a serving worker; not alongside one over the same cluster."""
        mode = request.settings(self.config.speculation).mode
        if mode == "ssd" and self.draft is None:
            raise ValueError("mode ssd needs a draft device")
        with self.batch_engine(mode) as engine:
            return engine.generate(request)

    def wait_serving(self) -> None:
        """Block while the target restarts (GeneratorUnavailable past RECOVERY_WAIT_S)."""
        self._wait_up()

    def target_lost(self, why: str) -> None:
        """A caller found the target gone: not serving until the watcher restarts it."""
        self._down(why)

    def _wait_up(self) -> None:
        """Block while the target restarts."""
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while not self._up.wait(0.2):
            if self._stopping.is_set() or time.monotonic() > deadline:
                raise GeneratorUnavailable(f"the target is not back ({self._why_down})")

    def describe(self) -> dict[str, Any]:
        return ray.get(self.targets[0].describe.remote())

    def batch_engine(self, mode: str) -> RemoteBatchEngine:
        """A continuous batch of `mode` on target rank 0 (the serving worker drives it)."""
        return RemoteBatchEngine(self, mode)

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
