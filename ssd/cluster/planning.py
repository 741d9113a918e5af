"""SSD's start-up plan through a cluster: each half of the probes timed on
its own actor, both at once (or read from the cache), then the plan, with
the link's round trip on every round (a part of ssd.cluster.runtime.Cluster)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import ray

from ssd.config import Config


class StartupPlan:
    """Plans SSD's speculation for one Cluster (the attributes are the Cluster's)."""

    config: Config
    device: str
    targets: list
    draft: object
    plan: object
    link_round_trip_s: float | None
    _spare_cores: Callable[[int], list[int] | None]  # ssd.cluster.actors.Actors'

    def _probe(self) -> tuple[dict, dict, dict] | None:
        """SSD's start-up probes (ssd.saguaro.startup), each half timed on its own actor while
        the other's computes (or read from the cache), where a plan is wanted: (target part,
        draft part, meta). The role done first keeps its core busy until the other is done."""
        from ssd.saguaro import startup

        if not startup.wanted(self.config):
            return None

        def measure() -> tuple[dict, dict]:
            target, draft = self.targets[0], self.draft
            continued = target.plan_continuations.remote()
            # the target times once its continuations are done (an argument: awaited); the draft
            # times at once, then scores them (in a list: not awaited before the call)
            parts = [target.plan_probe.remote(continued), draft.plan_probe.remote([continued])]
            [first], _ = ray.wait(parts)
            other = parts[1] if first == parts[0] else parts[0]
            busy = (target if first == parts[0] else draft).plan_busy.remote([other])
            target_part, draft_part = ray.get(parts)
            ray.get(busy)
            wide = ray.get(target.plan_wide_probe.remote())  # the draft idle, as while it lends its core
            return target_part | ({"ar_wide_step_s": wide} if wide else {}), draft_part

        device = "one cpu core each" if self.device == "cpu" else self.device  # each role's, for the cache key
        lent = ["draft's core lent"] if self._spare_cores(0) else []  # then the probes time AR on both
        tp = [f"target tp{len(self.targets)}"] if len(self.targets) > 1 else []  # probed through its leader
        key, meta = startup.config_key(self.config, [device, "cluster", *lent, *tp])
        return (*startup.cached_probes(key, measure, meta), meta)

    def _plan(self, target_part: dict, draft_part: dict, meta: dict) -> None:
        """The plan, with the link's round trip on every round; the speculation defaults of
        the driver and the target change (before the first request)."""
        from ssd.saguaro import startup

        self.plan = startup.plan_from_probes(target_part, draft_part, meta, link_s=self.link_round_trip_s or 0.0)
        self.config = startup.planned(self.config, self.plan)
        ray.get(self.targets[0].set_speculation.remote(dataclasses.asdict(self.config.speculation)))
