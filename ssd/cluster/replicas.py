"""Replicas: N independent target + draft groups (each a Cluster) behind one endpoint.

Placement: each replica is a Cluster with its own placement group, packed on
one node (STRICT_PACK); replica i asks for the i-th node (roomiest first) as
Ray's soft target, so the replicas spread over the nodes while a node has
room and share one where it does not.

Routing: a request goes to the serving replica with the most free batch
capacity (the fewest rows running); each replica keeps its own continuous
batch on its target rank 0, and the replicas step side by side (one Ray call
each per step, all sent before any is awaited).

Faults: each replica heals itself as one Cluster does (a lost draft is
re-linked, a lost target restarted). Meanwhile the others serve: the rows
of a lost replica that had streamed nothing move to another serving replica
and run again from their prompt; a row that had streamed tokens fails with
GeneratorUnavailable (the client retries), as on one Cluster. A node that
leaves the Ray cluster takes its actors with it: every replica it held finds
its target lost, and Ray places the restarted group on a node with room.
Health is SERVING while at least one replica serves.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ssd.cluster.batch import RemoteBatchEngine, TargetLost
from ssd.cluster.devices import Placement
from ssd.cluster.healing import RECOVERY_WAIT_S, HealthListener
from ssd.cluster.placing import start_ray
from ssd.cluster.runtime import Cluster
from ssd.config import Config, ConfigError
from ssd.engine.batch import Engine, Finished
from ssd.engine.request import GenerationRequest, GenerationResult, GeneratorUnavailable

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.2  # how long a step with only moving rows waits for a replica to take them


def start_cluster(
    config: Config, placement: Placement | Sequence[Placement], address: str | None = None,
) -> "Cluster | Replicas":
    """One Cluster, or Replicas when config.cluster.replicas asks for more than one."""
    if config.cluster.replicas > 1:
        return Replicas(config, placement, address)
    return Cluster(config, placement, address)


def check_room(placements: Sequence[Placement]) -> None:
    """Refuse a replica count the Ray cluster cannot hold, up front (rather than time out reserving)."""
    need = {"CPU": sum(len(p.target + p.draft) for p in placements)}  # a bundle per role, each with one CPU
    if placements[0].kind == "cuda":
        need["GPU"] = sum(len(set(p.target + p.draft)) for p in placements)  # colocated roles share a GPU
    have = ray.cluster_resources()
    replicas = len(placements)
    if any(have.get(name, 0) < amount for name, amount in need.items()):
        held = {name: have.get(name, 0) for name in need}
        raise ConfigError(f"cluster.replicas (--replicas) {replicas} needs {need} in all; the Ray cluster has {held}")


def spread_nodes(replicas: int, kind: str) -> list[str]:
    """A node (hex ID) for each replica: the alive nodes with the most of the
    resource the groups need first, then round again when there are more replicas."""
    resource = "GPU" if kind == "cuda" else "CPU"
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: -n["Resources"].get(resource, 0))
    return [nodes[i % len(nodes)]["NodeID"] for i in range(replicas)]


@dataclass
class ReplicaCounts:
    """One replica's traffic, for /metrics (guarded by Replicas' lock)."""

    routed: int = 0  # requests sent to it (a moved request counts again where it lands)
    moved: int = 0  # requests that left it unstreamed when its target was lost
    tokens: int = 0  # tokens of the requests that finished on it


class Replicas:
    """The serving backend's view of N Clusters: the same calls as one Cluster."""

    def __init__(
        self, config: Config, placement: Placement | Sequence[Placement], address: str | None = None,
    ) -> None:
        """`placement`: every replica's devices on its node, or one Placement per replica
        (e.g. other cores for each of several simulated nodes on one machine)."""
        n = config.cluster.replicas
        placements = [placement] * n if isinstance(placement, Placement) else list(placement)
        if len(placements) != n:
            raise ConfigError(f"cluster.replicas (--replicas) is {n} but {len(placements)} placements were given")
        self.placement = placements[0]  # the backend reads the kind and the TP size, the same for every replica
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            start_ray(address)
        self.clusters: list[Cluster] = []
        try:
            check_room(placements)
            for i, node in enumerate(spread_nodes(n, self.placement.kind)):
                self.clusters.append(Cluster(config, placements[i], node=node, name=f"replica {i}"))
        except BaseException:
            self.shutdown()
            raise
        self.config = self.clusters[0].config  # with the start-up plan's speculation, where one ran
        self.counts = [ReplicaCounts() for _ in self.clusters]
        self._lock = threading.Lock()
        self._engines: list[ReplicaBatchEngine] = []
        self._listeners: list[HealthListener] = []
        self._serving = True
        for i, cluster in enumerate(self.clusters):
            cluster.add_health_listener(functools.partial(self._replica_health, i))
        log.info("%d replicas on nodes %s", n, [self.node_of(i) for i in range(n)])

    # ------------------------------------------------------------------ health

    @property
    def serving(self) -> bool:
        return any(c.serving for c in self.clusters)

    @property
    def draft(self) -> Any:
        """Replica 0's speculator (None: no replica has one); the backend asks which modes run."""
        return self.clusters[0].draft

    def node_of(self, index: int) -> str | None:
        """The node replica `index`'s target rank 0 runs on."""
        try:
            return ray.get(self.clusters[index].targets[0].whereabouts.remote(), timeout=30)["node_id"]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def add_health_listener(self, listener: HealthListener) -> None:
        """`listener(serving, why)` hears the service go down (every replica lost) and come back."""
        with self._lock:
            self._listeners.append(listener)

    def _replica_health(self, index: int, serving: bool, why: str | None) -> None:
        log.log(logging.INFO if serving else logging.WARNING, "replica %d %s", index,
                "serving again" if serving else f"lost ({why}); the others serve")
        with self._lock:
            now = self.serving
            changed, self._serving = now != self._serving, now
            listeners = list(self._listeners)
        if not changed:
            return
        why_all = None if now else f"every replica is restarting (replica {index}: {why})"
        for listener in listeners:
            try:
                listener(now, why_all)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the recovery
                log.exception("a health listener failed")

    def wait_any_serving(self, request: GenerationRequest | None = None) -> None:
        """Block until some replica serves (GeneratorUnavailable past RECOVERY_WAIT_S or on cancel)."""
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while not self.serving:
            if time.monotonic() > deadline:
                raise GeneratorUnavailable("no replica came back")
            if request is not None and request.is_cancelled():
                raise GeneratorUnavailable("cancelled while every replica was restarting")
            time.sleep(IDLE_WAIT_S)

    # ---------------------------------------------------------------- requests

    def _first_serving(self) -> Cluster:
        self.wait_any_serving()
        return next(c for c in self.clusters if c.serving)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return self._first_serving().encode(text, chat)

    def describe(self) -> dict[str, Any]:
        return self._first_serving().describe()

    def running(self, index: int) -> int:
        """Requests replica `index` runs now: its rows in every batch."""
        return sum(engine.engines[index].rows for engine in list(self._engines))

    def by_room(self) -> list[int]:
        """The serving replicas, the most free capacity (fewest requests running) first."""
        return sorted((i for i, c in enumerate(self.clusters) if c.serving), key=self.running)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request as a batch of one (ReplicaBatchEngine: routed to the roomiest
        serving replica, moved to another if lost before it streamed anything)."""
        with self.batch_engine(request.settings(self.config.speculation).mode) as engine:
            return engine.generate(request)

    def count(self, index: int, **deltas: int) -> None:
        with self._lock:
            counts = self.counts[index]
            for name, delta in deltas.items():
                setattr(counts, name, getattr(counts, name) + delta)

    def batch_engine(self, mode: str) -> "ReplicaBatchEngine":
        engine = ReplicaBatchEngine(self, mode)
        self._engines.append(engine)
        return engine

    def forget(self, engine: "ReplicaBatchEngine") -> None:
        if engine in self._engines:
            self._engines.remove(engine)

    def metrics_collector(self) -> Collector:
        return ReplicaCollector(self)

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Shut every replica down (each frees its actors and placement group), then Ray."""
        for cluster in self.clusters:
            try:
                cluster.shutdown()
            except Exception:  # noqa: BLE001 - the other replicas still need shutting down
                log.exception("shutting %s down failed", cluster.name)
        if self._started_ray:
            ray.shutdown()

    def close(self) -> None:
        self.shutdown()

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ReplicaBatchEngine(Engine):
    """One mode's continuous batch on every replica, as one Engine for the serving worker."""

    def __init__(self, replicas: Replicas, mode: str) -> None:
        self.replicas = replicas
        self.mode = mode
        self.engines = [RemoteBatchEngine(c, mode, wait_for_target=False) for c in replicas.clusters]
        self._moving: list[tuple[GenerationRequest, float]] = []  # (request, since): lost unstreamed, to admit again
        self._fit: tuple[GenerationRequest, int] | None = None  # the replica can_admit found for a request

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.engines) + len(self._moving)

    def can_admit(self, request: GenerationRequest) -> bool:
        """Room on some serving replica (waiting, as one Cluster does, while every one restarts)."""
        self.replicas.wait_any_serving(request)
        index = self._find_room(request)
        self._fit = (request, index) if index is not None else None
        return index is not None

    def admit(self, request: GenerationRequest) -> None:
        index = self._fit[1] if self._fit is not None and self._fit[0] is request else self._find_room(request)
        self._fit = None
        if index is None or not self._admit_on(index, request):
            self._moving.append((request, time.monotonic()))  # taken at the next step, by whichever has room

    def step(self) -> list[Finished]:
        finished = self._place_moving()
        calls = [(i, e.start_step()) for i, e in enumerate(self.engines) if e.rows]  # every replica steps at once
        for index, call in calls:
            for row in self.engines[index].finish_step(call):
                if self._movable(row):
                    self.replicas.count(index, moved=1)
                    log.warning("request %s moves off replica %d: %s", row.request.request_id, index, row.error)
                    self._moving.append((row.request, time.monotonic()))
                    continue
                if row.result is not None:
                    self.replicas.count(index, tokens=len(row.result.token_ids))
                finished.append(row)
        if not calls and self._moving:
            time.sleep(IDLE_WAIT_S)  # no replica can take them yet: don't spin
        return finished

    def close(self) -> None:
        self.replicas.forget(self)

    def _find_room(self, request: GenerationRequest) -> int | None:
        """The roomiest serving replica whose batch admits `request` now."""
        for index in self.replicas.by_room():
            try:
                if self.engines[index].can_admit(request):
                    return index
            except GeneratorUnavailable:  # lost since by_room looked: try the next
                continue
        return None

    def _admit_on(self, index: int, request: GenerationRequest) -> bool:
        try:
            self.engines[index].admit(request)
        except GeneratorUnavailable:
            return False
        self.replicas.count(index, routed=1)
        return True

    @staticmethod
    def _movable(row: Finished) -> bool:
        """Lost with its replica before it streamed anything (and still wanted): it can run elsewhere."""
        return isinstance(row.error, TargetLost) and row.error.streamed == 0 and not row.request.is_cancelled()

    def _place_moving(self) -> list[Finished]:
        """Admit the moving rows where there is room; end those cancelled or waiting too long."""
        waiting, ended = [], []
        for request, since in self._moving:
            if request.is_cancelled():
                ended.append(Finished(request, None))  # aborted
            elif time.monotonic() - since > RECOVERY_WAIT_S:
                ended.append(Finished(request, None, GeneratorUnavailable("no replica could take the request")))
            elif (index := self._find_room(request)) is None or not self._admit_on(index, request):
                waiting.append((request, since))
        self._moving = waiting
        return ended


class ReplicaCollector(Collector):
    """Per-replica series for /metrics, labelled replica="0", "1", ..."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        r = self.replicas
        indices = range(len(r.clusters))
        yield _family(GaugeMetricFamily, "ssd:replica_serving", "1 while the replica's target serves.",
                      {i: float(r.clusters[i].serving) for i in indices})
        yield _family(GaugeMetricFamily, "ssd:replica_num_requests_running", "Requests the replica runs now.",
                      {i: r.running(i) for i in indices})
        yield _family(CounterMetricFamily, "ssd:replica_requests_routed", "Requests sent to the replica.",
                      {i: r.counts[i].routed for i in indices})
        yield _family(CounterMetricFamily, "ssd:replica_requests_moved",
                      "Requests that moved off the replica (its target lost before they streamed anything).",
                      {i: r.counts[i].moved for i in indices})
        yield _family(CounterMetricFamily, "ssd:replica_generation_tokens", "Tokens of requests finished on the replica.",
                      {i: r.counts[i].tokens for i in indices})
        yield _family(CounterMetricFamily, "ssd:replica_target_restarts", "Times the replica's target was restarted.",
                      {i: r.clusters[i].target_restarts for i in indices})


def _family(kind: type, name: str, help_text: str, values: dict[int, float]) -> Metric:
    family = kind(name, help_text, labels=["replica"])
    for index, value in values.items():
        family.add_metric([str(index)], value)
    return family
