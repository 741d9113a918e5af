"""One engine, one request at a time: a single worker thread over a FIFO queue.

Handler threads submit jobs and drain each job's event queue; the worker
runs jobs in arrival order (fair), so a long request delays the ones behind
it but never starves them. Admission bounds queued + running jobs.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ssd.engine.request import GenerationRequest, GenerationResult, GeneratorUnavailable
from ssd.serve.backend import Backend
from ssd.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


class DuplicateRequestId(ValueError):
    pass


class WorkerClosed(RuntimeError):
    pass


@dataclass
class Round:
    """Tokens one engine round admitted."""

    ids: list[int]


@dataclass
class Done:
    """The job's end: a result (possibly "aborted"), or the engine's exception."""

    result: GenerationResult | None = None
    error: Exception | None = None

    @property
    def reason(self) -> str:
        if self.error is not None:
            return "error"
        return self.result.finish_reason if self.result is not None else "aborted"


@dataclass
class Job:
    request: GenerationRequest  # without callbacks: the job supplies them
    request_id: str = ""
    deadline: float | None = None  # time.monotonic() seconds
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    first_token: float | None = None
    events: "queue.Queue[Round | Done]" = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancel.set()

    def cancelled(self) -> bool:
        """Polled by the engine before every round."""
        if self._cancel.is_set():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def on_tokens(self, ids: list[int]) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()
        self.events.put(Round(list(ids)))


class GenerationWorker:
    def __init__(self, backend: Backend, metrics: ServerMetrics, max_queue: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._pending: deque[Job] = deque()
        self._jobs: dict[str, Job] = {}  # queued + running, for Abort
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ssd-generation-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; return how many jobs are ahead of it."""
        with self._lock:
            if self._closed:
                raise WorkerClosed("the server is shutting down")
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(f"{len(self._jobs)} requests queued or running (limit {self.max_queue})")
            job.request_id = job.request_id or uuid.uuid4().hex
            if job.request_id in self._jobs:
                raise DuplicateRequestId(f"request_id {job.request_id!r} is already queued or running")
            ahead = len(self._jobs)
            self._jobs[job.request_id] = job
            self._pending.append(job)
            self._lock.notify_all()
            return ahead

    def abort(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        self.cancel(job)
        return True

    def cancel(self, job: Job) -> None:
        """Stop a job: a running one within a round, a queued one now (its slot frees at once)."""
        job.cancel()
        with self._lock:
            if job not in self._pending:
                return  # running (the engine polls the flag) or already finished
            self._pending.remove(job)
            del self._jobs[job.request_id]
            self._lock.notify_all()
        self._complete(job, Done())

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return int(self._running is not None), len(self._pending)

    def close(self, grace_s: float) -> None:
        """Refuse new jobs, let queued and running ones finish for grace_s, abort the rest."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            idle = self._lock.wait_for(lambda: not self._jobs, timeout=grace_s)
            leftover = list(self._jobs.values())
        if not idle:
            log.warning("aborting %d request(s) still running after %.1f s", len(leftover), grace_s)
        for job in leftover:
            job.cancel()
        self._thread.join(timeout=grace_s + 30.0)

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            done = self._run(job)
            with self._lock:
                self._running = None
                del self._jobs[job.request_id]
                self._lock.notify_all()
            self._complete(job, done)

    def _next(self) -> Job | None:
        with self._lock:
            self._lock.wait_for(lambda: self._pending or self._closed)
            if not self._pending:
                return None  # closed and drained
            self._running = self._pending.popleft()
            return self._running

    def _run(self, job: Job) -> Done:
        job.started = time.monotonic()
        if job.cancelled():
            return Done()  # its deadline passed while queued
        request = dataclasses.replace(
            job.request, request_id=job.request_id, on_tokens=job.on_tokens, cancelled=job.cancelled
        )
        try:
            result = self.backend.generate(request)
            return Done(result=result)
        except GeneratorUnavailable as exc:  # the model was lost mid-request: the client retries
            log.warning("request %s failed: %s", job.request_id, exc)
            return Done(error=exc)
        except Exception as exc:  # an engine fault ends this request, never the server
            log.exception("request %s failed", job.request_id)
            return Done(error=exc)

    def _complete(self, job: Job, done: Done) -> None:
        """Every job ends here, however it ended: counted, logged, handed to its stream."""
        self._record(job, done)
        _log_finished(job, done)
        job.events.put(done)

    def _record(self, job: Job, done: Done) -> None:
        now = time.monotonic()
        started = job.started if job.started is not None else now
        ttft = job.first_token - job.arrived if job.first_token is not None else None
        stats = done.result.stats if done.result is not None else None
        self.metrics.finished(done.reason, stats, ttft, now - job.arrived, started - job.arrived)


def _log_finished(job: Job, done: Done) -> None:
    tokens = len(done.result.token_ids) if done.result is not None else 0
    reason = done.reason
    if reason == "aborted":  # say by what: the deadline, or a cancel (client gone, Abort, shutdown)
        expired = job.deadline is not None and time.monotonic() >= job.deadline
        reason += " (deadline)" if expired else " (cancelled)"
    log.info("request %s finished: %s, %d tokens in %.3f s", job.request_id, reason, tokens,
             time.monotonic() - job.arrived)
