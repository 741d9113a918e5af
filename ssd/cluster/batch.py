"""Continuous batching over the cluster: the driver's scheduler drives a batch
engine on target rank 0, one Ray call per step (or per several fast steps,
up to cluster.step_call_s: a call costs a few milliseconds).

The serving worker (ssd.serve.worker) schedules exactly as for local engines:
it admits between steps and completes the rows that leave. Here each call
goes to the target actor; the tokens every row admitted in a step come back
with it and are handed to that row's callback. This is the one request path:
a tensor-parallel target batches as one rank does (its other ranks mirror each
row), and `Engine.generate` runs one request as a batch of one.

Faults. A call that finds the target gone marks the cluster down (its
watcher restarts the target in the background). A row that had streamed
nothing to its client runs again from its prompt once the target is back
(or, with `wait_for_target` False, leaves with TargetLost(streamed=0), and
ssd.cluster.replicas moves it to another replica); so does a row whose
client sees only the result (`GenerationRequest.streams` False: OpenAI's
stream false), however far it got: nobody saw the lost run. Greedy and
seeded output (AR, SD, coupled sampling) comes out as it would have; an
unseeded sampled row draws afresh, and which of its runs is returned then
depends on how long each ran, as with a client's retry. A row that had streamed tokens fails with
TargetLost, a GeneratorUnavailable (the client retries), since a re-run need
not reproduce a sampled prefix. A forward that failed on
a tensor-parallel rank fails its rows at once with GeneratorUnavailable
naming that error (a re-run would likely fail the same way).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Protocol, Union

import ray

from ssd.cluster.healing import RECOVERY_WAIT_S
from ssd.engine.batch import Engine, Finished
from ssd.engine.grammar import GrammarFailed
from ssd.engine.request import GenerationRequest, GeneratorUnavailable

log = logging.getLogger(__name__)

RESTART_POLL_S = 0.1  # how often rows waiting for a restarting target look for a cancel

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


class Lost(GeneratorUnavailable):
    """A call found the target gone; `rerun`: its rows that streamed nothing may run again
    (not after a failed tensor-parallel forward)."""

    def __init__(self, message: str, rerun: bool) -> None:
        super().__init__(message)
        self.rerun = rerun


def row_error(text: str) -> Exception:
    """A row's error from its text: a failed tensor-parallel forward is GeneratorUnavailable
    (the group restarts; the client retries), a grammar's failure GrammarFailed (the request's
    own), anything else a RowError."""
    if text.startswith("TPForwardError: "):
        why = text.removeprefix("TPForwardError: ")
        return GeneratorUnavailable(f"{why}; the tensor-parallel target restarts, retry the request")
    if text.startswith("GrammarFailed: "):  # the request's own grammar: the front ends say so (400)
        return GrammarFailed(text.removeprefix("GrammarFailed: "))
    return RowError(text)


class RemoteBatchEngine(Engine):
    def __init__(
        self, cluster: TargetHost, mode: str, wait_for_target: bool = True, call_s: float = 0.0,
        deadline_s: float | None = None,
    ) -> None:
        """wait_for_target False: a call while the target restarts fails at once
        (GeneratorUnavailable) rather than waiting, for a caller with somewhere else to go.
        call_s: how long one step call may keep stepping (cluster.step_call_s); deadline_s:
        how long any call may take before the target counts as hung (cluster.step_deadline_s;
        None: no limit)."""
        self.cluster = cluster
        self.mode = mode
        self.wait_for_target = wait_for_target
        self.call_s = call_s
        self.deadline_s = deadline_s
        self._stepped: list[int] = []  # rows of each step the last call ran (for /metrics)
        self._requests: dict[str, GenerationRequest] = {}
        self._streamed: dict[str, int] = {}  # tokens each row has streamed to its client so far
        self._again: list[GenerationRequest] = []  # lost before they streamed anything: to run again
        self._rows_on = 0  # the target incarnation (cluster.target_restarts) holding the rows
        self._waiting_since: float | None = None  # when rows began waiting to run again

    @property
    def rows(self) -> int:
        return len(self._requests) + len(self._again)

    def can_admit(self, request: GenerationRequest) -> bool:
        if self._again:
            return False  # the rows to run again come first
        try:
            return self._call("batch_can_admit", self.mode, request.portable())
        except Lost as exc:
            if not (exc.rerun and self.wait_for_target):
                raise
            return True  # admit() holds it until the target is back

    def admit(self, request: GenerationRequest) -> None:
        key = uuid.uuid4().hex
        try:
            call = self._send("batch_admit", self.mode, key, request.portable())
            self._receive("batch_admit", call)
        except Lost as exc:
            if not (exc.rerun and self.wait_for_target):
                raise
            self._again.append(request)  # runs once the target is back
            return
        self._rows_on = call[1]
        self._requests[key] = request
        self._streamed[key] = 0

    def step(self) -> list[Finished]:
        self._stepped = []
        finished = self._admit_again()
        if not self._requests:
            return finished
        return finished + self.finish_step(self.start_step())

    def start_step(self) -> StepCall:
        """Send one step without waiting for it (replicas step side by side); finish_step collects it."""
        cancelled = [key for key, request in self._requests.items() if request.is_cancelled()]
        try:
            return self._send("batch_step", self.mode, cancelled, self.call_s)
        except GeneratorUnavailable as exc:
            return exc

    def finish_step(self, call: StepCall) -> list[Finished]:
        self._stepped = []
        try:
            if isinstance(call, GeneratorUnavailable):
                raise call
            emitted, ended, self._stepped = self._receive("batch_step", call)
        except GeneratorUnavailable as exc:
            return self.drop_rows(str(exc), rerun=isinstance(exc, Lost) and exc.rerun and self.wait_for_target)
        for key, tokens in emitted.items():
            request = self._requests[key]
            request.emit(tokens)
            if request.streams:  # a client that waits for the result has seen nothing yet
                self._streamed[key] += len(tokens)
        finished = []
        for key, result, error in ended:
            self._streamed.pop(key, None)
            finished.append(Finished(self._requests.pop(key), result, row_error(error) if error is not None else None))
        return finished

    def stepped_rows(self, rows_before: int) -> list[int]:
        """The rows of each step the last call ran on the target (several within cluster.step_call_s)."""
        return self._stepped

    def warm(self) -> bool:
        """The target engine's idle work (Engine.warm), one piece a call; none while rows run
        here or the target is not serving."""
        if self._requests or self._again or not self.cluster.serving:
            return False
        try:
            return self._call("batch_warm", self.mode)
        except GeneratorUnavailable:
            return False

    def drop_rows(self, why: str, rerun: bool = False) -> list[Finished]:
        """End every row, the target being lost: each fails with TargetLost saying what it had
        streamed, but with `rerun` a row that streamed nothing waits to run again."""
        lost, self._requests = self._requests, {}
        finished = []
        for key, request in lost.items():
            streamed = self._streamed.pop(key, 0)
            if rerun and not streamed and not request.is_cancelled():
                log.warning("%s: request %s streamed nothing before the target was lost: it runs again once "
                            "the target is back", self.cluster.name, request.request_id or "(unnamed)")
                self._again.append(request)
            else:
                finished.append(Finished(request, None, TargetLost(why, streamed)))
        return finished

    def _admit_again(self) -> list[Finished]:
        """Admit the rows to run again once the target is back; the cancelled ones leave
        (aborted) at once, also while it restarts, so a step never blocks on it."""
        again, self._again, ended = self._again, [], []
        if not again:
            self._waiting_since = None
            return ended
        self._waiting_since = self._waiting_since or time.monotonic()
        wait = not self.cluster.serving and time.monotonic() - self._waiting_since < RECOVERY_WAIT_S
        for request in again:
            if request.is_cancelled():
                ended.append(Finished(request, None))
            elif wait:
                self._again.append(request)
            else:
                self.admit(request)  # past RECOVERY_WAIT_S: wait_serving says the target is not back
        if self._again and not self._requests and not ended:
            time.sleep(RESTART_POLL_S)  # the target restarts: the worker steps again shortly
        return ended

    def _call(self, method: str, *args):
        """A call on target rank 0; a lost target marks the cluster down and raises GeneratorUnavailable."""
        return self._receive(method, self._send(method, *args))

    def _send(self, method: str, *args) -> tuple[ray.ObjectRef, int]:
        if not self.wait_for_target and not self.cluster.serving:
            raise GeneratorUnavailable(f"{self.cluster.name}: the target is restarting")
        self.cluster.wait_serving()
        if self._requests and self.cluster.target_restarts != self._rows_on:
            # The watcher replaced the target between two of our calls (another engine's call, or
            # its own pings, found it gone): the new one never held these rows.
            raise Lost(f"the target was lost with {self.rows} batched requests running; retry the request", True)
        return getattr(self.cluster.targets[0], method).remote(*args), self.cluster.target_restarts

    def _receive(self, method: str, call: tuple[ray.ObjectRef, int]):
        ref, incarnation = call
        try:
            result = ray.get(ref, timeout=self.deadline_s)
        except ray.exceptions.GetTimeoutError:
            # A hung rank (a collective that never completes, a stuck host): health goes
            # NOT_SERVING now and the watcher restarts the group, as for a lost rank. Its rows
            # end UNAVAILABLE rather than run again: a request may be what hangs it.
            why = f"{self.cluster.name}: a {method} call ran past cluster.step_deadline_s ({self.deadline_s:g} s)"
            self.cluster.target_lost(why)
            raise Lost(f"{why} with {self.rows} batched requests running; retry the request", False) from None
        except ray.exceptions.RayActorError as exc:
            self.cluster.target_lost(f"{type(exc).__name__} during a batched step")
            # A follower's failed forward: rank 0 waited until the watcher restarted the group.
            failure = self.cluster.forward_failure(incarnation)
            why = failure or "the target was lost"
            raise Lost(f"{why} with {self.rows} batched requests running; retry the request", failure is None) from exc
        if method == "batch_step" and any(error for _, _, error in result[1]):
            self.cluster.look_now()  # a row's error may be rank 0's failed TP forward: restart promptly
        return result
