"""A cluster's actors: the placement group, the target ranks and the
speculator started in it, their priority, and waiting for them (the Cluster's
start-up half; see ssd.cluster.runtime)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ssd.cluster.devices import Placement
from ssd.cluster.placing import actor_env, group_node
from ssd.cluster.workers import COMPUTE, DraftWorker, TargetWorker
from ssd.config import Config
from ssd.hardware import heartbeat
from ssd.transport.distributed import free_port

log = logging.getLogger(__name__)

# The speculator holds the torch.distributed link in a blocking call, so it
# needs a second thread for ping/ready calls. A target's model calls all run on
# one thread (ssd.cluster.workers.COMPUTE: one OpenMP team); pings, the draft
# link and tokenizing take the others, so they answer while a step runs.
RemoteDraft = ray.remote(max_restarts=-1, max_concurrency=2, enable_task_events=False)(DraftWorker)
RemoteTarget = ray.remote(
    max_restarts=0, max_concurrency=4, concurrency_groups={COMPUTE: 1}, enable_task_events=False
)(TargetWorker)


class Actors:
    """Starts and stops the actors of one Cluster (a part of it: the attributes are the Cluster's)."""

    config: Config
    placement: Placement
    name: str
    device: str
    draft_node: str | None
    targets: list
    draft: Any
    _pg: Any
    _followers: list
    _start_timeouts: dict[str, float]
    _stopping: threading.Event
    _place: Callable[[str], Placement] | None
    _placed_on: str | None

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

    def _options(self, bundle: int | None, group: tuple[int, ...], index: int) -> dict[str, Any]:
        """The placement of the actor at `index` of its role's devices `group`: bundle `bundle`
        of the placement group, or (None) the draft's own node."""
        resources = self._bundle(group[index])
        if bundle is None:
            where = NodeAffinitySchedulingStrategy(self.draft_node, soft=False)
        else:
            where = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle)
        options: dict[str, Any] = {"scheduling_strategy": where, "num_cpus": resources["CPU"]}
        if self.placement.kind == "cuda":
            options["num_gpus"] = resources["GPU"]
        options["runtime_env"] = {"env_vars": actor_env(self.placement.kind, group, index, self.device)}
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

    def _spare_cores(self, rank: int) -> list[int] | None:
        """The draft's cores, lent to a lone target rank on the same node while the
        draft has nothing to do (ssd.cluster.workers.TargetWorker._step_cores)."""
        if self.placement.kind != "cpu" or rank > 0 or self.placement.tp_size > 1 or self.draft_node is not None:
            return None
        return list(self.placement.draft) or None

    def _place_on_node(self) -> None:
        """With `_place` (replicas): this group's devices on the node its placement group is
        on now (again after Ray moved the group to another node), disjoint from the others there."""
        if self._place is None:
            return
        self._await([self._pg.ready()], self._start_timeouts["target"])
        node = group_node(self._pg)
        if node != self._placed_on:
            self.placement, self._placed_on = self._place(node), node
            log.info("%s on node %s: target %s, draft %s (%s)", self.name, node, self.placement.target,
                     self.placement.draft, "GPUs" if self.placement.kind == "cuda" else "cores")

    def _start_targets(self) -> list:
        self._place_on_node()
        config = dataclasses.asdict(self.config)
        world, tp_port = self.placement.tp_size, free_port()
        targets = [
            RemoteTarget.options(**self._options(rank, self.placement.target, rank)).remote(
                config, rank, world, self._cores(device), tp_port, self.device, self._spare_cores(rank)
            )
            for rank, device in enumerate(self.placement.target)
        ]
        try:
            # loading is collective under TP
            self._await([t.ready.remote() for t in targets], self._start_timeouts["target"])
            self._followers = [t.run_follower.remote() for t in targets[1:]]
            # SERVING only once every rank has computed: the followers mirror rank 0's forward
            self._await([targets[0].first_forward.remote()], self._start_timeouts["target"])
        except Exception:
            for target in targets:  # none may linger holding a bundle
                ray.kill(target, no_restart=True)
            raise
        return targets

    def _start_actors(self) -> None:
        """The target ranks and the speculator, loading side by side (each mostly waits for its
        process to start and import); if either fails, neither is left running."""
        self._place_on_node()
        draft = self._launch_draft() if self.placement.draft else None
        try:
            # The actors' own lines start once their processes have imported (seconds on a busy host).
            with heartbeat(log, f"{self.name}: starting the actors (processes, imports, model loads)"):
                self.targets = self._start_targets()
                if draft is not None:
                    ray.get(draft.ready.remote(), timeout=self._start_timeouts["draft"])
        except BaseException:
            if draft is not None:
                ray.kill(draft, no_restart=True)
            raise
        self.draft = draft

    def _launch_draft(self):
        """The speculator's actor, started (not waited for)."""
        device = self.placement.draft[0]
        bundle = len(self.placement.target) if self.draft_node is None else None
        return RemoteDraft.options(**self._options(bundle, self.placement.draft, 0)).remote(
            dataclasses.asdict(self.config), self._cores(device), self.device
        )

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

    def _stop_actors(self) -> None:
        """Stop the speculator and the followers, then free the actors and the placement group."""
        try:
            ray.get(self.targets[0].shutdown.remote(), timeout=30)
            ray.get(self._followers, timeout=30)
        except Exception:  # noqa: BLE001 - tearing down; whatever is left is killed below
            log.warning("clean shutdown failed; killing the actors", exc_info=True)
        for actor in [*self.targets, self.draft]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)
