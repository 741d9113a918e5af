"""The generation service both front ends sit on (gRPC: ssd.serve.server, HTTP: ssd.openai).

It holds the backend and the worker and says whether it is serving (and why
not). A request enters as a neutral `Request` (ssd.serve.request), is
validated (ssd.serve.validation) and queued, counted as admitted or rejected;
its `Generation` yields the rounds (token ids, their text delta, logprobs)
and then the final result with its stats as plain data. The front ends only
translate: their wire format into a `Request`, these answers into theirs,
and the exceptions below into their status codes:

    InvalidArgument     a field is invalid (str() starts with its name)
    NotServing          loading, restarting or shutting down
    QueueFull           --max-queue requests are queued or running
    DuplicateRequestId  a request with that id is queued or running
    WorkerClosed        the worker stopped (shutting down)
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Any
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from ssd.config import BACKUPS, FANOUT_KINDS, Config
from ssd.fields import SAMPLING
from ssd.engine.grammar import GrammarFailed
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest, GenerationResult, GeneratorUnavailable, TokenLogprob
from ssd.serve.backend import Backend, BackendInfo
from ssd.serve.metrics import Counters, ServerMetrics, prometheus_text
from ssd.serve.options import ServeOptions
from ssd.serve.request import Request
from ssd.serve.streaming import TextStream
from ssd.serve.validation import (
    InvalidArgument, default_coupling, max_new_tokens_limit, prompt_ids,
    token_ids_in_vocabulary, validate,
)
from ssd.serve.worker import (
    Done,
    DuplicateRequestId,
    GenerationWorker,
    Job,
    QueueFull,
    Round,
    WorkerClosed,
)

__all__ = [
    "DuplicateRequestId", "GenerationService", "Generation", "Health", "InvalidArgument", "NotServing",
    "QueueFull", "Request", "WorkerClosed",
]

log = logging.getLogger(__name__)


class NotServing(RuntimeError):
    """The model is loading, restarting or shutting down; str() says which."""


# --- plain answers ------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    serving: bool
    reason: str | None = None  # why not, while not serving


@dataclass
class SpecStats:
    """SSD's speculation cache for one request (field names as in ssd.v1.SpecStats)."""

    lookups: int = 0
    hits: int = 0
    hit_rate: float = 0.0
    lookups_by_k: dict[int, int] = field(default_factory=dict)
    hits_by_k: dict[int, int] = field(default_factory=dict)
    backups: dict[str, int] = field(default_factory=dict)
    tokens_per_round_after_hit: float = 0.0
    tokens_per_round_after_miss: float = 0.0
    target_wait_s: float = 0.0
    verify_s: float = 0.0
    build_s: float = 0.0
    backup_s: float = 0.0
    degraded_rounds: int = 0


@dataclass
class RequestStats:
    """One finished request's stats (field names as in ssd.v1.RequestStats)."""

    mode: str
    k: int
    prompt_tokens: int
    new_tokens: int
    queue_s: float  # waiting for the engine
    time_to_first_token_s: float  # from arrival, queue included
    total_s: float  # from arrival to the last token
    tokens_per_s: float
    decode_tokens_per_s: float
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: list[float]
    accepted_length_histogram: list[int]
    spec: SpecStats
    lookup_rounds: int = 0  # prompt lookup: rounds, tokens verified, tokens accepted
    looked_up: int = 0
    lookup_accepted: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, served by an earlier request's cache


@dataclass
class Limits:
    max_context_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_stop_strings: int
    max_stop_chars: int
    max_k: int
    max_budget: int
    max_queue: int
    max_message_bytes: int


@dataclass
class Defaults:
    """What a request that omits a field gets (ssd.serve.validation): the config's
    serve_defaults, else OpenAI's. random_seed: a fresh seed per request (then `seed` is 0);
    max_new_tokens: the configured default, else the most the server gives (the context
    minus the prompt caps it further)."""

    mode: str
    max_new_tokens: int
    sampling: dict[str, Any]  # each of ssd.fields.SAMPLING's by name (the proto's Defaults has them flat)
    k: int
    fanout_budget: int
    fanout_kind: str
    saguaro_c: float
    backup: str
    random_seed: bool = False


def _reported_coupling(config: Config) -> str:
    """Defaults.coupling: the coupling every request that names none gets, or "auto" where it
    follows the seed (gumbel for a seeded request, standard for an unseeded one)."""
    if config.serve_defaults.seed is not None:  # every request is seeded
        return default_coupling(config, seeded=True)
    seeded, unseeded = default_coupling(config, seeded=True), default_coupling(config, seeded=False)
    return seeded if seeded == unseeded else "auto"


@dataclass
class ModelInfo:
    target_model: str
    draft_model: str | None
    vocab_size: int
    modes: list[str]
    backups: list[str]
    fanout_kinds: list[str]
    chat_template: bool
    eos_token_ids: list[int]
    limits: Limits
    defaults: Defaults


@dataclass
class ServiceStats:
    counters: Counters
    running: int
    waiting: int
    uptime_s: float
    prometheus_text: str


@dataclass
class Chunk:
    """One engine round: the tokens it admitted, the text they add (may lag), their logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Final:
    """The end. `result` is None when aborted before any result or on an error."""

    reason: str  # eos | length | stop | aborted | error
    text: str  # the rest of the text (the deltas joined with it == result.text)
    result: GenerationResult | None
    error: Exception | None
    stats: RequestStats | None
    deadline_exceeded: bool = False

    @property
    def unavailable(self) -> bool:
        """The error is the backend being unavailable (not a fault in this request)."""
        return isinstance(self.error, GeneratorUnavailable)

    @property
    def refused(self) -> bool:
        """The error is the request's own (its grammar failed mid-run): a 400, not an engine fault."""
        return isinstance(self.error, InvalidArgument)


# --- one request -----------------------------------------------------------------------


class Generation:
    """An admitted request: its rounds, then its end (`next`), and its cancellation."""

    def __init__(self, service: "GenerationService", worker: GenerationWorker, backend: Backend, job: Job,
                 queued_ahead: int, grammar_field: str | None = None) -> None:
        self.service, self.worker, self.backend, self.job = service, worker, backend, job
        self.queued_ahead = queued_ahead
        self.grammar_field = grammar_field  # the request field its grammar came from, for errors
        # Not streamed: rounds carry no text and the end carries it all (no decode per round; and
        # a run that starts again after a lost target sends its rounds again, unseen).
        self.text = TextStream(self.decode, job.request.generation) if job.request.streams else None

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.request.prompt_ids)

    def next(self, timeout: float) -> Chunk | Final | None:
        """The next round or the end; None if nothing came within `timeout` seconds."""
        try:
            event = self.job.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, Round):
            text = self.text.push(event.ids) if self.text is not None else ""
            return Chunk(event.ids, text, event.logprobs)
        return self._final(event)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text, with the model's tokenizer, as the request's text is decoded
        (special tokens left out unless it asks for them)."""
        return self.backend.decode(ids, skip_special_tokens=self.job.request.generation.skip_special_tokens)

    def cancel(self) -> None:
        """Stop it within a round (a no-op once it finished); frees its row."""
        self.worker.cancel(self.job)

    def _final(self, done: Done) -> Final:
        result = done.result
        delta = "" if result is None else result.text if self.text is None else self.text.finish(result.text)
        stats = self.service.request_stats(self.job, result.stats) if result is not None else None
        job = self.job
        late = done.reason == "aborted" and job.deadline is not None and time.monotonic() >= job.deadline
        error = done.error
        if isinstance(error, GrammarFailed):  # the request's grammar, not the server, failed
            error = InvalidArgument(self.grammar_field or "structured_output", str(error))
        return Final(done.reason, delta, result, error, stats, deadline_exceeded=late)


# --- the service -----------------------------------------------------------------------


class GenerationService:
    """The backend and worker behind both front ends; serves once `attach` gives it them."""

    def __init__(self, options: ServeOptions, metrics: ServerMetrics, registry: CollectorRegistry) -> None:
        self.options = options
        self.metrics = metrics
        self.registry = registry
        self.backend: Backend | None = None
        self.worker: GenerationWorker | None = None
        self.unavailable: str | None = "the model is loading"  # why requests are refused; None: serving

    def attach(self, backend: Backend, worker: GenerationWorker) -> None:
        self.backend, self.worker = backend, worker
        self.unavailable = None

    def refuse(self, why: str) -> None:
        """Stop admitting requests (running ones go on), saying why."""
        self.unavailable = why

    def resume(self) -> None:
        """Admit again (the backend recovered)."""
        self.unavailable = None

    def health(self) -> Health:
        try:
            self.serving()
        except NotServing as exc:
            return Health(False, str(exc))
        return Health(True)

    def serving(self) -> tuple[Backend, GenerationWorker]:
        """The backend and worker, or NotServing saying why not."""
        backend, worker, why = self.backend, self.worker, self.unavailable
        if why is not None or backend is None or worker is None:
            raise NotServing(why or "not serving")
        return backend, worker

    def info(self) -> BackendInfo:
        backend, _ = self.serving()
        return backend.info

    def submit(self, request: Request, deadline: float | None = None, streams: bool = True) -> Generation:
        """Validate and queue a request (counted as admitted, or rejected when the queue is full).
        `deadline`: time.monotonic() seconds; `streams`: the client sees each round (text deltas
        with each), else only the end (and a run a lost target cut short may start again).

        Raises NotServing, InvalidArgument, QueueFull, DuplicateRequestId or WorkerClosed."""
        backend, worker = self.serving()
        valid = dataclasses.replace(validate(request, backend, self.options), streams=streams)
        job = Job(valid, request_id=valid.request_id, deadline=deadline,
                  rank=(request.background, request.priority))
        try:
            ahead = worker.submit(job)
        except QueueFull:
            self.metrics.rejected()
            raise
        self.metrics.admitted()
        return Generation(self, worker, backend, job, ahead,
                          grammar_field=request.structured.field if request.structured is not None else None)

    def tokenize(self, request: Request) -> list[int]:
        """The request's prompt ids, as a generation would take them (vLLM's /tokenize)."""
        backend, _ = self.serving()
        return prompt_ids(request, backend, self.options)

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, each in the vocabulary (vLLM's /detokenize)."""
        backend, _ = self.serving()
        return backend.decode(token_ids_in_vocabulary("tokens", ids, backend.info.vocab_size))

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request by id; False if there is none."""
        found = self.worker is not None and self.worker.abort(request_id)
        if found:
            log.info("abort requested for %s", request_id)
        return found

    def request_stats(self, job: Job, stats: GenerationStats) -> RequestStats:
        """A finished request's stats, its queue and first-token times measured from arrival."""
        started = job.started if job.started is not None else job.arrived
        first = job.first_token if job.first_token is not None else started
        return request_stats(stats, started - job.arrived, first - job.arrived, time.monotonic() - job.arrived)

    def model_info(self) -> ModelInfo:
        """The models, modes, limits and defaults; NotServing while loading."""
        info, options = self.info(), self.options
        d = info.defaults
        max_new = max_new_tokens_limit(info, options)
        limits = Limits(
            max_context_tokens=info.max_context_tokens, max_prompt_tokens=info.max_context_tokens - 1,
            max_new_tokens=max_new, max_stop_strings=options.max_stop_strings,
            max_stop_chars=options.max_stop_chars, max_k=options.max_k, max_budget=options.max_budget,
            max_queue=options.max_queue, max_message_bytes=options.max_message_bytes,
        )
        r = d.serve_defaults
        defaults = Defaults(
            mode=d.speculation.mode,
            max_new_tokens=max_new if r.max_new_tokens is None else min(r.max_new_tokens, max_new),
            sampling={f.name: f.resolve(None, getattr(r, f.name)) for f in SAMPLING}
            | {"seed": _or(r.seed, 0), "coupling": _reported_coupling(d)}, random_seed=r.seed is None,
            k=d.speculation.k, fanout_budget=d.speculation.fanout.budget,
            fanout_kind=d.speculation.fanout.kind, saguaro_c=d.speculation.saguaro_c,
            backup=d.speculation.backup,
        )
        return ModelInfo(
            target_model=info.target_model, draft_model=info.draft_model, vocab_size=info.vocab_size,
            modes=list(info.modes), backups=list(BACKUPS), fanout_kinds=list(FANOUT_KINDS),
            chat_template=info.chat_template, eos_token_ids=list(info.eos_token_ids),
            limits=limits, defaults=defaults,
        )

    def stats(self) -> ServiceStats:
        """Server-wide counters (they answer while loading too) and the Prometheus text."""
        running, waiting = self.worker.counts if self.worker is not None else (0, 0)
        return ServiceStats(self.metrics.snapshot(), running, waiting, self.metrics.uptime_s(),
                            prometheus_text(self.registry))


def _or(value: object, default: object) -> object:
    return default if value is None else value


def accepted_length_histogram(stats: GenerationStats) -> list[int]:
    """Drafting rounds by accepted length, from the per-position counts.

    Acceptance is a prefix, so rounds accepting >= j tokens are accepted_at[j-1]
    and rounds drafting anything are drafted_at[0].
    """
    if not stats.drafted_at:
        return []
    at_least = [stats.drafted_at[0], *stats.accepted_at, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]


def request_stats(stats: GenerationStats, queue_s: float, ttft_s: float, total_s: float) -> RequestStats:
    s = stats.spec
    spec = SpecStats(
        lookups=s.lookups, hits=s.hits, hit_rate=s.hit_rate,
        lookups_by_k=dict(s.lookups_by_k), hits_by_k=dict(s.hits_by_k), backups=dict(s.backups),
        tokens_per_round_after_hit=s.tokens_per_round_after_hit,
        tokens_per_round_after_miss=s.tokens_per_round_after_miss,
        target_wait_s=s.wait_s, verify_s=s.verify_s, build_s=s.build_s, backup_s=s.backup_s,
        degraded_rounds=s.degraded_rounds,
    )
    return RequestStats(
        mode=stats.mode, k=stats.k, prompt_tokens=stats.prompt_tokens, new_tokens=stats.new_tokens,
        queue_s=queue_s, time_to_first_token_s=ttft_s, total_s=total_s,
        tokens_per_s=stats.tokens_per_s, decode_tokens_per_s=stats.decode_tokens_per_s,
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted,
        acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
        acceptance_by_position=list(stats.acceptance_by_position),
        accepted_length_histogram=accepted_length_histogram(stats), spec=spec,
        lookup_rounds=stats.lookup_rounds, looked_up=stats.looked_up, lookup_accepted=stats.lookup_accepted,
        cached_prompt_tokens=stats.cached_prompt_tokens,
    )
