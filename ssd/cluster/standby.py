"""The warm standby (cluster.warm_standby): a second target, loaded and idle on
the target's node and devices, that takes over when the target dies, so the
service is back in the time it takes to link the draft again rather than a
model load (a part of ssd.cluster.runtime.Cluster).

The standby runs outside the placement group (its node by Ray's node
affinity, no Ray resources of its own): the group's bundles already reserve
the devices it would use, and it computes nothing until it takes over. On a
GPU it holds a second copy of the weights; hence opt-in. After a takeover a
new standby loads in the background; until it is ready a second loss
restarts the target the slow way. One target rank only (a tensor-parallel
group is refused up front).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ssd.cluster.actors import RemoteTarget
from ssd.cluster.devices import Placement
from ssd.cluster.placing import actor_env, group_node
from ssd.config import Config, ConfigError
from ssd.transport.distributed import free_port

log = logging.getLogger(__name__)

STANDBY_ANSWER_S = 5.0  # a standby that does not answer within this is not taken


def refuse_standby(config: Config, placement: Placement) -> None:
    if config.cluster.warm_standby and placement.tp_size > 1:
        raise ConfigError(
            f"cluster.warm_standby takes over from a target of one rank; this target has {placement.tp_size} "
            f"(tensor-parallel): set cluster.warm_standby false"
        )


class Standby:
    """Starts, hands over and stops the warm standby of one Cluster (the attributes are the
    Cluster's; _cores, _spare_cores and _await are Actors')."""

    config: Config
    placement: Placement
    name: str
    device: str
    _pg: Any
    _start_timeouts: dict[str, float]
    _stopping: threading.Event
    _standby: Any
    _standby_lock: threading.Lock
    _standby_loading: threading.Thread | None  # the background load after a takeover

    def _start_standby(self) -> None:
        """Load a standby target (blocking) unless one is there or the cluster stops."""
        if not self.config.cluster.warm_standby or self._stopping.is_set():
            return
        with self._standby_lock:
            if self._standby is not None:
                return
        device = self.placement.target[0]
        options = {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(group_node(self._pg), soft=False),
            "num_cpus": 0, "num_gpus": 0,
            "runtime_env": {"env_vars": actor_env(self.placement.kind, (device,), 0, self.device)},  # one rank
        }
        standby = RemoteTarget.options(**options).remote(
            dataclasses.asdict(self.config), 0, 1, self._cores(device), free_port(), self.device,
            self._spare_cores(0),
        )
        try:
            self._await([standby.first_forward.remote()], self._start_timeouts["target"])  # loaded and computing
        except Exception:
            ray.kill(standby, no_restart=True)
            raise
        with self._standby_lock:
            if self._stopping.is_set() or self._standby is not None:
                ray.kill(standby, no_restart=True)
                return
            self._standby = standby
        log.info("%s: a warm standby target is loaded", self.name)

    def _standby_in_background(self) -> None:
        """Load the next standby off the request path (after a takeover)."""
        def load() -> None:
            try:
                self._start_standby()
            except Exception:  # noqa: BLE001 - serving goes on; the next loss restarts the slow way
                if not self._stopping.is_set():
                    log.warning("%s: loading a new warm standby failed", self.name, exc_info=True)

        if self.config.cluster.warm_standby:
            self._standby_loading = threading.Thread(target=load, name="ssd-standby", daemon=True)
            self._standby_loading.start()

    def _take_standby(self) -> Any | None:
        """The standby, if one is loaded and answers, now the target (and no longer the standby)."""
        with self._standby_lock:
            standby, self._standby = self._standby, None
        if standby is None:
            return None
        try:
            ray.get(standby.ready.remote(), timeout=STANDBY_ANSWER_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            log.warning("%s: the warm standby does not answer; restarting the target", self.name)
            ray.kill(standby, no_restart=True)
            return None
        return standby

    def _stop_standby(self) -> None:
        """Stop a standby loading (it gives up within a second once the cluster stops: it must
        not outlive Ray) and the loaded one."""
        if self._standby_loading is not None:
            self._standby_loading.join(timeout=30)
        with self._standby_lock:
            standby, self._standby = self._standby, None
        if standby is not None:
            ray.kill(standby, no_restart=True)
