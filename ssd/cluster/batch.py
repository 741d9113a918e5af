"""Continuous batching over the cluster: the driver's scheduler drives a batch
engine on target rank 0, one Ray call per step.

The serving worker (ssd.serve.worker) schedules exactly as for local engines:
it admits between steps and completes the rows that leave. Here each call
goes to the target actor; the tokens every row admitted in a step come back
with it and are handed to that row's callback. A step that finds the target
gone fails every row with GeneratorUnavailable (the client retries; the
cluster restarts the target in the background).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import ray

from ssd.engine.batch import Engine, Finished
from ssd.engine.request import GenerationRequest, GeneratorUnavailable

if TYPE_CHECKING:
    from ssd.cluster.runtime import Cluster


class RowError(RuntimeError):
    """A row failed on the target; the text is the target's error."""


class RemoteBatchEngine(Engine):
    def __init__(self, cluster: "Cluster", mode: str) -> None:
        self.cluster = cluster
        self.mode = mode
        self._requests: dict[str, GenerationRequest] = {}

    @property
    def rows(self) -> int:
        return len(self._requests)

    def can_admit(self, request: GenerationRequest) -> bool:
        return self._call("batch_can_admit", self.mode, request.portable())

    def admit(self, request: GenerationRequest) -> None:
        key = uuid.uuid4().hex
        self._call("batch_admit", self.mode, key, request.portable())
        self._requests[key] = request

    def step(self) -> list[Finished]:
        cancelled = [key for key, request in self._requests.items() if request.is_cancelled()]
        try:
            emitted, ended = self._call("batch_step", self.mode, cancelled)
        except GeneratorUnavailable as exc:
            lost, self._requests = list(self._requests.values()), {}
            return [Finished(request, None, exc) for request in lost]
        for key, tokens in emitted.items():
            self._requests[key].emit(tokens)
        return [
            Finished(self._requests.pop(key), result, RowError(error) if error is not None else None)
            for key, result, error in ended
        ]

    def _call(self, method: str, *args):
        """A call on target rank 0; a lost target marks the cluster down and raises GeneratorUnavailable."""
        self.cluster.wait_serving()
        incarnation = self.cluster.target_restarts
        try:
            result = ray.get(getattr(self.cluster.targets[0], method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            self.cluster.target_lost(f"{type(exc).__name__} during a batched step")
            # A follower's failed forward: rank 0 waited until the watcher restarted the group.
            why = self.cluster.forward_failure(incarnation) or "the target was lost"
            raise GeneratorUnavailable(f"{why} with {self.rows} batched requests running; retry the request") from exc
        if method == "batch_step" and any(error for _, _, error in result[1]):
            self.cluster.look_now()  # a row's error may be rank 0's failed TP forward: restart promptly
        return result
