"""Replicas: N independent target + draft groups (each a Cluster) behind one endpoint.

Placement: each replica is a Cluster with its own placement group, packed on
one node (STRICT_PACK); replica i asks for the i-th node (roomiest first) as
Ray's soft target, so the replicas spread over the nodes while a node has
room and share one where it does not. Replicas on one node never share a
device: the k-th there runs on the given devices shifted k spans up (cores
0-1 -> 2-3; ssd.cluster.devices.NodeSlots), as many as the node's CPUs (GPUs)
make whole groups of; a count the nodes cannot hold is refused up front.

Routing: a request goes to the serving replica with the most free batch
capacity (the fewest rows running), unless another no more than ROUTE_SLACK
rows busier recently finished a request whose text the prompt continues
(ROUTE_MIN_PREFIX tokens or more): each replica has its own prefix cache
(ssd.engine.prefix), so a chat's next turn goes where its last one ran, as
SGLang's cache-aware router sends it. A replica admits rows between its
steps: a request passes over one mid-step only for one no more than
ROUTE_SLACK rows busier, else it waits a step (route_order). Each replica
keeps its own continuous batch on its target rank 0, and steps on its own
schedule: a step goes to every replica with rows and no step on its way, and
each result is taken as it comes back (ray.wait), so a slow replica holds
only its own rows. A replica whose step passes cluster.step_deadline_s is lost.

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

import collections
import functools
from concurrent.futures import ThreadPoolExecutor, wait
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Sequence

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ssd.cluster.batch import RemoteBatchEngine, StepCall, TargetLost
from ssd.cluster.devices import NodeSlots, Placement, groups_per_node, span
from ssd.cluster.healing import RECOVERY_WAIT_S, HealthListener
from ssd.cluster.placing import node_resources, start_ray
from ssd.cluster.runtime import Cluster
from ssd.config import Config, ConfigError
from ssd.engine.batch import Engine, Finished
from ssd.engine.prefix import common_prefix
from ssd.engine.request import GenerationRequest, GenerationResult, GeneratorUnavailable

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.2  # how long a step with only moving rows waits for a replica to take them
POLL_S = 0.02  # how long a step waits for a replica's step while another replica could take new rows


def start_cluster(
    config: Config, placement: Placement | Sequence[Placement], address: str | None = None,
) -> "Cluster | Replicas":
    """One Cluster, or Replicas when config.cluster.replicas asks for more than one."""
    if config.cluster.replicas > 1:
        return Replicas(config, placement, address)
    return Cluster(config, placement, address)


def check_room(placements: Sequence[Placement], slotted: bool) -> None:
    """Refuse a replica count the Ray cluster cannot hold, up front (rather than time out reserving).

    `slotted`: the replicas share one placement, shifted per node (ssd.cluster.devices.NodeSlots),
    so each node holds as many as its devices make whole groups of."""
    need = {"CPU": sum(len(p.target + p.draft) for p in placements)}  # a bundle per role, each with one CPU
    if placements[0].kind == "cuda":
        need["GPU"] = sum(len(set(p.target + p.draft)) for p in placements)  # colocated roles share a GPU
    have = ray.cluster_resources()
    replicas = len(placements)
    held = {name: have.get(name, 0) for name in need}
    if any(have.get(name, 0) < amount for name, amount in need.items()):
        raise ConfigError(f"cluster.replicas (--replicas) {replicas} needs {need} in all; the Ray cluster has {held}")
    if slotted:
        fits = {n["NodeID"]: groups_per_node(placements[0], n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0))
                for n in ray.nodes() if n["Alive"]}
        if sum(fits.values()) < replicas:
            noun = "GPUs" if placements[0].kind == "cuda" else "cores"
            raise ConfigError(
                f"cluster.replicas (--replicas) {replicas} needs {need} in all, {span(placements[0])} {noun} "
                f"per replica on one node; the Ray cluster's nodes hold {sum(fits.values())} replica(s): {fits}"
            )


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
        """`placement`: every replica's devices on a node of its own (replicas that share a
        node get them shifted, disjoint: NodeSlots), or one Placement per replica, taken as
        given (e.g. other cores for each of several simulated nodes on one machine)."""
        n = config.cluster.replicas
        slotted = isinstance(placement, Placement)
        placements = [placement] * n if slotted else list(placement)
        if len(placements) != n:
            raise ConfigError(f"cluster.replicas (--replicas) is {n} but {len(placements)} placements were given")
        self.placement = placements[0]  # the backend reads the kind and the TP size, the same for every replica
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            start_ray(address)
        self.clusters: list[Cluster] = []
        self._lock = threading.Lock()
        self._slots = NodeSlots(self.placement)
        try:
            check_room(placements, slotted)
            self.clusters = self._start(config, placements, slotted)
        except BaseException:
            self.shutdown()
            raise
        self.config = self.clusters[0].config  # with the start-up plan's speculation, where one ran
        self.counts = [ReplicaCounts() for _ in self.clusters]
        self._engines: list[ReplicaBatchEngine] = []
        self._steps: dict[int, Stepping] = {}  # replica -> its step on its way (one at a time per target)
        self._listeners: list[HealthListener] = []
        self._serving = True
        for i, cluster in enumerate(self.clusters):
            cluster.add_health_listener(functools.partial(self._replica_health, i))
        log.info("%d replicas on nodes %s", n, [self.node_of(i) for i in range(n)])

    def _start(self, config: Config, placements: list[Placement], slotted: bool) -> list[Cluster]:
        """Start the replicas side by side (each mostly waits for its actors' processes);
        if one fails, the others that started are shut down and the first failure raised."""
        nodes = spread_nodes(len(placements), self.placement.kind)

        def start(i: int) -> Cluster:
            place = functools.partial(self._place, i) if slotted else None
            return Cluster(config, placements[i], node=nodes[i], name=f"replica {i}", place=place)

        with ThreadPoolExecutor(len(placements), thread_name_prefix="ssd-replica-start") as pool:
            futures = [pool.submit(start, i) for i in range(len(placements))]
            wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            self.clusters = started  # shut down by the caller
            raise failed[0]
        return started

    # ------------------------------------------------------------------ health

    @property
    def serving(self) -> bool:
        return any(c.serving for c in self.clusters)

    @property
    def draft(self) -> Any:
        """Replica 0's speculator (None: no replica has one); the backend asks which modes run."""
        return self.clusters[0].draft

    def _place(self, index: int, node: str) -> Placement:
        """Replica `index`'s devices on `node`, disjoint from the other replicas there."""
        have = node_resources(node)
        with self._lock:
            return self._slots.take(index, node, have.get("CPU", 0), have.get("GPU", 0))

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
        with self._lock:
            if engine in self._engines:
                self._engines.remove(engine)
            for index in [i for i, s in self._steps.items() if s.engine is engine]:
                del self._steps[index]  # its late result is dropped with it

    # ------------------------------------------------------------------ steps

    def send_step(self, index: int, engine: "ReplicaBatchEngine", remote: RemoteBatchEngine) -> None:
        """Send `remote`'s step to replica `index` unless a step is on its way there."""
        with self._lock:
            if index not in self._steps:
                self._steps[index] = Stepping(engine, remote.start_step(), time.monotonic())

    def stepping(self, index: int) -> bool:
        with self._lock:
            return index in self._steps

    def steps_of(self, engine: "ReplicaBatchEngine") -> dict[int, Stepping]:
        with self._lock:
            return {i: s for i, s in self._steps.items() if s.engine is engine}

    def step_done(self, index: int) -> None:
        with self._lock:
            self._steps.pop(index, None)

    def any_stepping(self) -> bool:
        with self._lock:
            return bool(self._steps)

    def idle_serving(self) -> bool:
        """Some serving replica has no step on its way (new rows could go there now)."""
        with self._lock:
            return any(c.serving and i not in self._steps for i, c in enumerate(self.clusters))

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


@dataclass
class Stepping:
    """A replica's step on its way: the batch engine that sent it, the call, when it went."""

    engine: "ReplicaBatchEngine"
    call: StepCall
    sent: float


ROUTE_MIN_PREFIX = 64  # prompt tokens a replica's recent text must hold for the prompt to go there
ROUTE_SLACK = 1  # how many more rows than the roomiest such a replica may run
ROUTE_MEMORY = 32  # finished texts remembered per replica


def route_order(roomiest: Sequence[int], running: dict[int, int], shared: dict[int, int],
                stepping: Collection[int] = ()) -> list[int]:
    """The replicas to try for a prompt now, in order: `roomiest` (the fewest rows `running` first),
    except that the one whose recent text shares the most of the prompt (`shared`, at least
    ROUTE_MIN_PREFIX tokens) goes first if it runs at most ROUTE_SLACK rows more than the roomiest:
    its prefix cache holds that start, and the load stays near even.

    A replica mid-step (`stepping`) takes rows only between steps, so it is left out, and with it
    every replica running more than ROUTE_SLACK rows above it: the prompt waits a step (a round)
    rather than pile onto a busier replica for the life of its request. If the holder of the
    prompt's start is mid-step, the order is empty: wait for its step, not a prefill elsewhere."""
    if not roomiest:
        return []
    least = min(running[i] for i in roomiest)
    holders = [i for i in roomiest if shared.get(i, 0) >= ROUTE_MIN_PREFIX and running[i] <= least + ROUTE_SLACK]
    order = list(roomiest)
    if holders:
        best = max(holders, key=lambda i: shared[i])  # the roomiest among equals: max keeps the first
        if best in stepping:
            return []
        order = [best, *(i for i in roomiest if i != best)]
    busy = [running[i] for i in order if i in stepping]
    ceiling = min(busy) + ROUTE_SLACK if busy else None
    return [i for i in order if i not in stepping and (ceiling is None or running[i] <= ceiling)]


class ReplicaBatchEngine(Engine):
    """One mode's continuous batch on every replica, as one Engine for the serving worker.

    Each replica steps on its own schedule: a step goes to every replica with
    rows and none on its way (one step at a time per target, whichever mode
    sent it), and `step` returns what the steps that came back by then
    finished. A replica whose step passes cluster.step_deadline_s is lost.
    """

    def __init__(self, replicas: Replicas, mode: str) -> None:
        self.replicas = replicas
        self.mode = mode
        call_s = replicas.config.cluster.step_call_s
        self.deadline_s = replicas.config.cluster.step_deadline_s
        self.engines = [RemoteBatchEngine(c, mode, wait_for_target=False, call_s=call_s, deadline_s=self.deadline_s)
                        for c in replicas.clusters]
        self._stepped: list[int] = []  # rows of each replica step that came back in the last `step` (for /metrics)
        self._moving: list[tuple[GenerationRequest, float]] = []  # (request, since): lost unstreamed, to admit again
        self._fit: tuple[GenerationRequest, int] | None = None  # the replica can_admit found for a request
        self._recent: dict[int, collections.deque] = {}  # per replica: the texts of its last finished rows

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.engines) + len(self._moving)

    def can_admit(self, request: GenerationRequest) -> bool:
        """Room on some serving replica between its steps (waiting, as one Cluster does,
        while every one restarts)."""
        self.replicas.wait_any_serving(request)
        index = self._find_room(request)
        self._fit = (request, index) if index is not None else None
        if index is None and not self.rows and self.replicas.any_stepping():
            return True  # every replica mid-step (another mode's): admit() holds it until one is free
        return index is not None

    def admit(self, request: GenerationRequest) -> None:
        index = self._fit[1] if self._fit is not None and self._fit[0] is request else self._find_room(request)
        self._fit = None
        if index is None or not self._admit_on(index, request):
            self._moving.append((request, time.monotonic()))  # taken at the next step, by whichever has room

    def step(self) -> list[Finished]:
        """Send a step to each replica free to take one; wait for the first of this engine's to
        come back (briefly, while some replica could take new rows); collect every one back."""
        finished = self._place_moving()
        self._stepped = []
        for index, engine in enumerate(self.engines):
            if engine.rows:
                self.replicas.send_step(index, self, engine)
        mine = self.replicas.steps_of(self)
        if not mine:
            if self._moving:  # no replica can take them yet: don't spin
                time.sleep(POLL_S if self.replicas.any_stepping() else IDLE_WAIT_S)
            return finished
        for index, ended in self._collect(mine):
            self._stepped += self.engines[index].stepped_rows(0)
            finished += self._settle(index, ended)
        return finished

    def stepped_rows(self, rows_before: int) -> list[int]:
        """Each replica step that came back in the last call, however many rows this engine had."""
        return self._stepped

    def warm(self) -> bool:
        """A piece of idle work on each replica not stepping (Engine.warm); whether any is left."""
        left = [engine.warm() for index, engine in enumerate(self.engines)
                if not engine.rows and not self.replicas.stepping(index)]
        return any(left)

    def close(self) -> None:
        self.replicas.forget(self)

    def _collect(self, mine: dict[int, Stepping]) -> Iterator[tuple[int, list[Finished]]]:
        """(replica, its rows that ended) for each of `mine` back by the wait, or past its deadline."""
        refs = {s.call[0]: i for i, s in mine.items() if not isinstance(s.call, GeneratorUnavailable)}
        now = time.monotonic()
        wait = min(s.sent + self.deadline_s for s in mine.values()) - now
        if self.replicas.idle_serving():
            wait = min(wait, POLL_S)  # a replica is free for new rows: let the worker admit soon
        if len(refs) == len(mine) and refs:
            ray.wait(list(refs), num_returns=1, timeout=max(wait, 0.0))
        back = set(ray.wait(list(refs), num_returns=len(refs), timeout=0)[0]) if refs else set()
        now = time.monotonic()
        for index, stepping in mine.items():
            engine = self.engines[index]
            if isinstance(stepping.call, GeneratorUnavailable) or stepping.call[0] in back:
                self.replicas.step_done(index)
                yield index, engine.finish_step(stepping.call)
            elif now - stepping.sent > self.deadline_s:
                self.replicas.step_done(index)
                why = f"{engine.cluster.name}: a step ran past cluster.step_deadline_s ({self.deadline_s:g} s)"
                engine.cluster.target_lost(why)  # the watcher restarts it
                yield index, engine.drop_rows(why)

    def _settle(self, index: int, ended: list[Finished]) -> list[Finished]:
        """The rows that left replica `index`: those lost unstreamed move, the rest finish."""
        finished = []
        for row in ended:
            if self._movable(row):
                self.replicas.count(index, moved=1)
                log.warning("request %s moves off replica %d: %s", row.request.request_id, index, row.error)
                self._moving.append((row.request, time.monotonic()))
                continue
            if row.result is not None:
                self.replicas.count(index, tokens=len(row.result.token_ids))
                texts = self._recent.setdefault(index, collections.deque(maxlen=ROUTE_MEMORY))
                texts.append((*row.request.prompt_ids, *row.result.token_ids))
            finished.append(row)
        return finished

    def _find_room(self, request: GenerationRequest) -> int | None:
        """The serving replica, between its steps, whose batch admits `request` now: the roomiest,
        or one that holds the prompt's start if it is not much busier (`route_order`)."""
        roomiest = self.replicas.by_room()
        shared = {i: max((common_prefix(text, request.prompt_ids) for text in self._recent.get(i, ())), default=0)
                  for i in roomiest}
        stepping = [i for i in roomiest if self.replicas.stepping(i)]
        for index in route_order(roomiest, {i: self.replicas.running(i) for i in roomiest}, shared, stepping):
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
