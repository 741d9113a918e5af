"""Continuous batching over the cluster: the driver's scheduler drives a batch
engine on target rank 0, one Ray call per step.

The serving worker (ssd.serve.worker) schedules exactly as for local engines:
it admits between steps and completes the rows that leave. Here each call
goes to the target actor; the tokens every row admitted in a step come back
with it and are handed to that row's callback. A step that finds the target
gone fails every row with TargetLost, a GeneratorUnavailable that says how
many tokens the row had streamed (the client retries, or ssd.cluster.replicas
moves a row that streamed nothing to another replica; the cluster restarts the
target in the background).
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol, Union

import ray

from ssd.engine.batch import Engine, Finished
from ssd.engine.request import GenerationRequest, GeneratorUnavailable

# A step on its way: (the call, the target's incarnation it went to), or why it could not be sent.
StepCall = Union[tuple[ray.ObjectRef, int], GeneratorUnavailable]


class TargetLost(GeneratorUnavailable):
    """The target was lost under a request after it had streamed `streamed` tokens.

    With none streamed the request may run again from its prompt, here once
    the target is back or at once on another replica (ssd.cluster.replicas)."""

    def __init__(self, message: str, streamed: int) -> None:
        super().__init__(message)
        self.streamed = streamed


class TargetHost(Protocol):
    """What a batch engine needs of the cluster that holds its target (ssd.cluster.runtime.Cluster)."""

    name: str
    serving: bool
    targets: list[Any]  # the target ranks' actor handles; rank 0 runs the batch
    target_restarts: int  # the target's incarnation

    def wait_serving(self) -> None: ...
    def target_lost(self, why: str) -> None: ...
    def forward_failure(self, incarnation: int) -> str | None: ...
    def look_now(self) -> None: ...


class RowError(RuntimeError):
    """A row failed on the target; the text is the target's error."""


class RemoteBatchEngine(Engine):
    def __init__(self, cluster: TargetHost, mode: str, wait_for_target: bool = True) -> None:
        """wait_for_target False: a call while the target restarts fails at once
        (GeneratorUnavailable) rather than waiting, for a caller with somewhere else to go."""
        self.cluster = cluster
        self.mode = mode
        self.wait_for_target = wait_for_target
        self._requests: dict[str, GenerationRequest] = {}
        self._streamed: dict[str, int] = {}  # tokens each row has streamed so far

    @property
    def rows(self) -> int:
        return len(self._requests)

    def can_admit(self, request: GenerationRequest) -> bool:
        return self._call("batch_can_admit", self.mode, request.portable())

    def admit(self, request: GenerationRequest) -> None:
        key = uuid.uuid4().hex
        self._call("batch_admit", self.mode, key, request.portable())
        self._requests[key] = request
        self._streamed[key] = 0

    def step(self) -> list[Finished]:
        return self.finish_step(self.start_step())

    def start_step(self) -> StepCall:
        """Send one step without waiting for it (replicas step side by side); finish_step collects it."""
        cancelled = [key for key, request in self._requests.items() if request.is_cancelled()]
        try:
            return self._send("batch_step", self.mode, cancelled)
        except GeneratorUnavailable as exc:
            return exc

    def finish_step(self, call: StepCall) -> list[Finished]:
        try:
            if isinstance(call, GeneratorUnavailable):
                raise call
            emitted, ended = self._receive("batch_step", call)
        except GeneratorUnavailable as exc:
            return self.drop_rows(str(exc))
        for key, tokens in emitted.items():
            self._requests[key].emit(tokens)
            self._streamed[key] += len(tokens)
        finished = []
        for key, result, error in ended:
            self._streamed.pop(key, None)
            finished.append(Finished(self._requests.pop(key), result, RowError(error) if error is not None else None))
        return finished

    def drop_rows(self, why: str) -> list[Finished]:
        """End every row, the target being lost: each fails with TargetLost saying what it had streamed."""
        lost, self._requests = self._requests, {}
        return [Finished(request, None, TargetLost(why, self._streamed.pop(key, 0))) for key, request in lost.items()]

    def _call(self, method: str, *args):
        """A call on target rank 0; a lost target marks the cluster down and raises GeneratorUnavailable."""
        return self._receive(method, self._send(method, *args))

    def _send(self, method: str, *args) -> tuple[ray.ObjectRef, int]:
        if not self.wait_for_target and not self.cluster.serving:
            raise GeneratorUnavailable(f"{self.cluster.name}: the target is restarting")
        self.cluster.wait_serving()
        return getattr(self.cluster.targets[0], method).remote(*args), self.cluster.target_restarts

    def _receive(self, method: str, call: tuple[ray.ObjectRef, int]):
        ref, incarnation = call
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self.cluster.target_lost(f"{type(exc).__name__} during a batched step")
            # A follower's failed forward: rank 0 waited until the watcher restarted the group.
            why = self.cluster.forward_failure(incarnation) or "the target was lost"
            raise GeneratorUnavailable(f"{why} with {self.rows} batched requests running; retry the request") from exc
        if method == "batch_step" and any(error for _, _, error in result[1]):
            self.cluster.look_now()  # a row's error may be rank 0's failed TP forward: restart promptly
        return result
