"""The generation worker: one thread that schedules every request.

Handler threads submit jobs and drain each job's event queue; the worker
thread alone touches the engines. Admission bounds queued + running jobs.

Scheduling policy:

* Batched modes. A backend may give an `Engine` per mode
  (`backend.batch_engine(mode)`, see `BatchingBackend`); the worker makes one
  per mode on first use and owns it. Between rounds, queued jobs are admitted
  in queue order while their mode's engine `can_admit` them. The queue is in
  arrival order within a rank: batch lines (/v1/batches) after the rest, then
  vLLM's `priority`, lower first; a job joins behind every queued job of its
  rank or a lower one. Admission is strictly in queue order: when the head
  does not fit, the jobs behind it wait too, so among equals a large request
  is never overtaken forever.
* Modes in turn. Each loop steps one engine that has rows, round-robin over
  the modes (one `step` each), so a busy mode cannot starve another.
* One path. Every mode runs on its batch engine, including those held at one
  row (batching.max_rows 1): there a
  request waits at the head of the queue until the row is free.
* Rows leave the moment they end: every `Finished` the step returns is
  completed at once (result, error or aborted); a row's tokens stream through
  its job's `on_tokens` as each round lands. Cancel, Abort and deadlines reach
  a row through the request's `cancelled` hook, which the engine polls every
  step. A step that raises as a whole fails that engine's rows; the engine is
  closed and a fresh one made for the next request of that mode.
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
from typing import Protocol

import torch

from ssd.engine.batch import Engine, Finished
from ssd.engine.request import GenerationRequest, GenerationResult, TokenLogprob
from ssd.serve.backend import Backend
from ssd.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


class DuplicateRequestId(ValueError):
    pass


class WorkerClosed(RuntimeError):
    pass


class Unschedulable(RuntimeError):
    """A request its batch engine can never admit, even with no other rows."""


class BatchingBackend(Protocol):
    """What the worker asks of a backend (ssd.serve.backend.Backend has it)."""

    def batch_engine(self, mode: str) -> Engine:
        """A new batch engine for `mode`, owned (and closed) by the caller; one
        held at one row (max_rows 1) runs its mode's requests one at a time."""


@dataclass
class Round:
    """Tokens one engine round admitted (and their log-probabilities, when asked
    for and the engine runs in this process; a remote one returns them with the result)."""

    ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


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
    # Where it queues: after every queued job of a lower or equal rank (batch lines after the
    # rest; then vLLM's priority, lower first). Ties in arrival order.
    rank: tuple[bool, int] = (False, 0)
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # admitted into an engine
    first_token: float | None = None
    events: "queue.Queue[Round | Done]" = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _bound: GenerationRequest | None = None
    _logprobs: list[TokenLogprob] = field(default_factory=list)  # this round's, until on_tokens

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
        logprobs, self._logprobs = self._logprobs, []
        self.events.put(Round(list(ids), logprobs))

    def on_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        """The engine calls this just before on_tokens, for the same tokens."""
        self._logprobs = list(logprobs)

    def bound(self) -> GenerationRequest:
        """The request as engines see it: this job's id, token callbacks and cancel hook."""
        if self._bound is None:
            self._bound = dataclasses.replace(
                self.request, request_id=self.request_id, on_tokens=self.on_tokens, cancelled=self.cancelled,
                on_logprobs=self.on_logprobs,
            )
        return self._bound


class GenerationWorker:
    def __init__(self, backend: Backend, metrics: ServerMetrics, max_queue: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Condition()
        self._pending: deque[Job] = deque()
        self._jobs: dict[str, Job] = {}  # queued + running, for Abort and admission
        self._running: dict[str, Job] = {}  # rows in an engine
        self._engines: dict[str, Engine] = {}  # worker thread only
        self._last_stepped = ""
        self._idle_work = False  # engines may have idle work (Engine.warm) since a row finished
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ssd-generation-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; return how many jobs are ahead of it (queued or running)."""
        with self._lock:
            if self._closed:
                raise WorkerClosed("the server is shutting down")
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(f"{len(self._jobs)} requests queued or running (limit {self.max_queue})")
            job.request_id = job.request_id or uuid.uuid4().hex
            if job.request_id in self._jobs:
                raise DuplicateRequestId(f"request_id {job.request_id!r} is already queued or running")
            place = next((i for i, queued in enumerate(self._pending) if queued.rank > job.rank), len(self._pending))
            self._jobs[job.request_id] = job
            self._pending.insert(place, job)
            self._lock.notify_all()
            return len(self._running) + place

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
            return len(self._running), len(self._pending)

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

    # --- the worker thread ----------------------------------------------------

    def _loop(self) -> None:
        threads = self.backend.info.defaults.runtime.threads
        try:
            while self._wait_for_work():
                # Set where the engines run, before every step: under OpenMP the count is per OS
                # thread, yet torch also keeps the last count set in the process and hands it to
                # threads it initialises, so another server in this process (the serving bench
                # runs one per thread count) would otherwise move this one's.
                if threads and torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                self._admit_queued()
                self._step_next()
        finally:
            self._close_engines()

    def _wait_for_work(self) -> bool:
        """Block until something is queued or running; False once closed and drained. While
        nothing is, the engines do their idle work (`_warm`), a piece at a time."""
        with self._lock:
            while not (self._pending or self._running or self._closed):
                if not self._idle_work:
                    self._lock.wait()
                    continue
                self._lock.release()
                try:
                    self._idle_work = self._warm()
                finally:
                    self._lock.acquire()
            return bool(self._pending or self._running)

    def _warm(self) -> bool:
        """One piece of some engine's idle work (a finished chat's reply prefilled for its next
        turn: ssd.engine.prefix); whether any is left. A failure only ends it."""
        for mode, engine in list(self._engines.items()):
            try:
                if engine.warm():
                    return True
            except Exception:  # noqa: BLE001 - idle work is optional; the engine serves on
                log.exception("idle work of the %s engine failed", mode)
        return False

    def _admit_queued(self) -> None:
        """Admit queued jobs into their engines in arrival order, while they fit."""
        while (head := self._peek()) is not None:
            try:
                engine = self._engine_for(self._mode(head))
                if not head.cancelled() and not self._fits(engine, head):
                    return  # the head waits for room; the jobs behind it wait too (FIFO)
            except Exception as exc:  # no engine for this mode, or it refuses the request for good
                log.exception("request %s cannot be scheduled", head.request_id)
                if self._take(head):
                    self._finish(head, Done(error=exc))
                continue
            if not self._take(head):
                continue  # cancelled and removed meanwhile
            if head.cancelled():
                self._finish(head, Done())  # its deadline passed, or it was cancelled, while queued
            else:
                self._admit(engine, head)

    def _fits(self, engine: Engine, job: Job) -> bool:
        if engine.can_admit(job.bound()):
            return True
        if not engine.rows:
            raise Unschedulable(f"request {job.request_id} exceeds the batch limits even alone")
        return False

    def _peek(self) -> Job | None:
        with self._lock:
            return self._pending[0] if self._pending else None

    def _take(self, job: Job) -> bool:
        """Move `job` from the head of the queue to running; False if it already left."""
        with self._lock:
            if not self._pending or self._pending[0] is not job:
                return False
            self._pending.popleft()
            self._running[job.request_id] = job
            job.started = time.monotonic()
            return True

    def _mode(self, job: Job) -> str:
        return job.request.settings(self.backend.info.defaults.speculation).mode

    def _engine_for(self, mode: str) -> Engine:
        """This mode's batch engine, made on first use (a mode the backend cannot run raises)."""
        if mode not in self._engines:
            self._engines[mode] = self.backend.batch_engine(mode)
            log.info("mode %s: a batch engine", mode)
        return self._engines[mode]

    def _admit(self, engine: Engine, job: Job) -> None:
        try:
            engine.admit(job.bound())
        except Exception as exc:  # this request alone is refused; the rows go on
            log.exception("admitting request %s failed", job.request_id)
            self._finish(job, Done(error=exc))

    def _step_next(self) -> None:
        """One step of the next mode (in turn) that has rows; complete the rows that left."""
        mode = self._next_mode()
        if mode is None:
            self._fail_orphans()
            return
        engine = self._engines[mode]
        rows = engine.rows
        try:
            finished = engine.step()
        except Exception as exc:
            log.exception("a %s batch step failed; its %d row(s) fail with it", mode, engine.rows)
            self._drop_engine(mode, exc)
            return
        for stepped in engine.stepped_rows(rows):  # replicas: a call may send no step, or several
            self.metrics.stepped(stepped)
        for row in finished:
            self._finish_row(row)
        self._idle_work = self._idle_work or bool(finished)

    def _next_mode(self) -> str | None:
        """Round-robin over the modes whose engine has rows, after the last one stepped."""
        order = list(self._engines)
        start = order.index(self._last_stepped) + 1 if self._last_stepped in order else 0
        for mode in order[start:] + order[:start]:
            if self._engines[mode].rows:
                self._last_stepped = mode
                return mode
        return None

    def _finish_row(self, row: Finished) -> None:
        with self._lock:
            job = self._running.get(row.request.request_id)
        if job is None:
            log.warning("the engine finished an unknown request %r", row.request.request_id)
            return
        if row.error is not None:
            log.error("request %s failed: %s: %s", job.request_id, type(row.error).__name__, row.error)
        self._finish(job, Done(result=row.result, error=row.error))

    def _drop_engine(self, mode: str, exc: Exception) -> None:
        engine = self._engines.pop(mode)
        _close_quietly(engine)
        for job in self._running_jobs():
            if self._mode(job) == mode:
                self._finish(job, Done(error=exc))

    def _fail_orphans(self) -> None:
        """Running jobs that no engine holds (an engine broke its contract): end them,
        rather than wait forever."""
        for job in self._running_jobs():
            self._finish(job, Done(error=RuntimeError("the batch engine lost this request")))

    def _running_jobs(self) -> list[Job]:
        with self._lock:
            return list(self._running.values())

    def _close_engines(self) -> None:
        while self._engines:
            _close_quietly(self._engines.popitem()[1])

    # --- every job ends here -------------------------------------------------

    def _finish(self, job: Job, done: Done) -> None:
        """A running job ended: free its slot, then complete it."""
        with self._lock:
            self._running.pop(job.request_id, None)
            self._jobs.pop(job.request_id, None)
            self._lock.notify_all()
        self._complete(job, done)

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


def _close_quietly(engine: Engine) -> None:
    try:
        engine.close()
    except Exception:  # closing a broken engine must not hide why it broke
        log.exception("closing a batch engine failed")


def _log_finished(job: Job, done: Done) -> None:
    tokens = len(done.result.token_ids) if done.result is not None else 0
    reason = done.reason
    if reason == "aborted":  # say by what: the deadline, or a cancel (client gone, Abort, shutdown)
        expired = job.deadline is not None and time.monotonic() >= job.deadline
        reason += " (deadline)" if expired else " (cancelled)"
    log.info("request %s finished: %s, %d tokens in %.3f s", job.request_id, reason, tokens,
             time.monotonic() - job.arrived)

