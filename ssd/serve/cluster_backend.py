"""The server's backend over the distributed runtime. AR and SSD rows batch on
target rank 0 (one Ray call per step, or per several fast ones within
cluster.step_call_s: ssd.cluster.batch), each row's tokens coming back with
the call that admitted them (a tensor-parallel target's too);
batching.max_rows 1 holds that batch at one row. Over replicas
(ssd.cluster.replicas) the rows route to the replica with the most room;
/metrics then carries per-replica series."""

from __future__ import annotations

from prometheus_client.registry import Collector

from ssd.cluster.replicas import Replicas
from ssd.cluster.runtime import Cluster
from ssd.cluster.workers import MODES
from ssd.engine.batch import Engine
from ssd.models import load_tokenizer
from ssd.serve.backend import BackendInfo, TokenizerMixin, backend_info


class ClusterBackend(TokenizerMixin):
    def __init__(self, cluster: Cluster | Replicas) -> None:
        self.cluster = cluster
        self.config = cluster.config
        self.tokenizer = load_tokenizer(self.config.target)  # tokenizing stays in the frontend
        self.info = self._describe()

    def watch_health(self, listener) -> None:
        """`listener(serving, why)` hears the cluster go down (target lost) and come back."""
        self.cluster.add_health_listener(listener)

    def batch_engine(self, mode: str) -> Engine:
        """`mode`'s batch on target rank 0 (a Ray call per step or few), held at one row
        there with batching.max_rows 1."""
        if mode not in self.info.modes:
            raise ValueError(f"the cluster serves modes {self.info.modes}, not {mode!r}")
        return self.cluster.batch_engine(mode)

    def metrics_collector(self) -> Collector | None:
        """Series of the backend's own for the server's /metrics: one per replica, when there are several."""
        make = getattr(self.cluster, "metrics_collector", None)
        return make() if make is not None else None

    def close(self) -> None:
        """The cluster belongs to whoever started it; nothing to free here."""

    def _describe(self) -> BackendInfo:
        remote = self.cluster.describe()
        return backend_info(
            self.config, self.tokenizer, modes=MODES if self.cluster.draft is not None else ("ar",),
            max_context_tokens=remote["max_positions"], eos_token_ids=remote["eos_token_ids"],
        )
