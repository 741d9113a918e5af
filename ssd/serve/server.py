"""The gRPC frontend: GenerationService over a Backend, plus health and reflection.

Lifecycle: `start()` binds the port at once with health NOT_SERVING and loads
the backend in a thread; health turns SERVING when it is loaded. `stop()`
turns health NOT_SERVING, refuses new requests, lets running ones finish for
the grace period, aborts the rest and closes the port. With
`metrics_port` set, Prometheus scrapes http://host:port/metrics from the
server's own registry, which also writes the Stats RPC's text.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from ssd.engine.request import GeneratorUnavailable
from ssd.serve import convert, decoding, protos
from ssd.serve.auth import BearerTokenInterceptor
from ssd.serve.backend import Backend
from ssd.serve.metrics import ServerMetrics, prometheus_text, server_registry
from ssd.serve.options import ServeOptions
from ssd.serve.service import NotServing
from ssd.serve.streaming import TextStream
from ssd.serve.validation import InvalidArgument, validate
from ssd.serve.worker import (
    Done,
    DuplicateRequestId,
    GenerationWorker,
    Job,
    QueueFull,
    Round,
    WorkerClosed,
)

log = logging.getLogger(__name__)

SERVICE_NAME = "ssd.v1.GenerationService"
EVENT_POLL_S = 0.1  # how often a waiting stream checks that its client is still there
NO_DEADLINE_S = 1e9


class GenerationServicer:
    """The four ssd.v1 RPCs; serves once `attach` gives it a backend.

    `serving`, `submit` and `request_stats` are the admission path the HTTP
    front end (ssd.serve.http) shares, so both front ends refuse, count and
    describe requests alike.
    """

    def __init__(self, pb: Any, options: ServeOptions, metrics: ServerMetrics,
                 registry: CollectorRegistry) -> None:
        self.pb = pb
        self.options = options
        self.metrics = metrics
        self.registry = registry
        self.backend: Backend | None = None
        self.worker: GenerationWorker | None = None
        self.unavailable = "the model is loading"  # why Generate is refused; None: serving

    def attach(self, backend: Backend, worker: GenerationWorker) -> None:
        self.backend, self.worker = backend, worker
        self.unavailable = None

    def refuse(self, why: str) -> None:
        self.unavailable = why

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        backend, worker = self._serving(context)
        try:
            valid = validate(request, backend, self.options)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        job = Job(valid, request_id=valid.request_id, deadline=_deadline(context))
        ahead = self._submit(worker, job, context)
        # Runs on client cancel, deadline and normal end alike (a no-op then).
        if not context.add_callback(lambda: worker.cancel(job)):
            worker.cancel(job)
        yield self.pb.GenerateResponse(
            request_id=job.request_id,
            accepted=self.pb.Accepted(prompt_tokens=len(valid.prompt_ids), queued_ahead=ahead),
        )
        yield from self._stream(job, backend, context)

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        found = self.worker is not None and self.worker.abort(request.request_id)
        if found:
            log.info("abort requested for %s", request.request_id)
        return self.pb.AbortResponse(found=found)

    def serving(self) -> tuple[Backend, GenerationWorker]:
        """The backend and worker, or NotServing saying why not."""
        backend, worker, why = self.backend, self.worker, self.unavailable
        if why is not None or backend is None or worker is None:
            raise NotServing(why or "not serving")
        return backend, worker

    def submit(self, worker: GenerationWorker, job: Job) -> int:
        """Queue a job, counted as admitted or rejected; the jobs ahead of it.
        QueueFull, DuplicateRequestId and WorkerClosed pass through."""
        try:
            ahead = worker.submit(job)
        except QueueFull:
            self.metrics.rejected()
            raise
        self.metrics.admitted()
        return ahead

    def request_stats(self, job: Job, stats: Any) -> Any:
        """The finished request's RequestStats message (the HTTP API sends it as JSON)."""
        started = job.started if job.started is not None else job.arrived
        first = job.first_token if job.first_token is not None else started
        total = time.monotonic() - job.arrived
        return convert.request_stats(self.pb, stats, started - job.arrived, first - job.arrived, total)

    def ModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        backend, _ = self._serving(context)
        return convert.model_info(self.pb, backend.info, self.options)

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        running, waiting = self.worker.counts if self.worker is not None else (0, 0)
        counters = self.metrics.snapshot()
        text = prometheus_text(self.registry)
        return convert.stats_response(self.pb, counters, running, waiting, self.metrics.uptime_s(), text)

    def _serving(self, context: grpc.ServicerContext) -> tuple[Backend, GenerationWorker]:
        try:
            return self.serving()
        except NotServing as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _submit(self, worker: GenerationWorker, job: Job, context: grpc.ServicerContext) -> int:
        try:
            return self.submit(worker, job)
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DuplicateRequestId as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except WorkerClosed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _stream(self, job: Job, backend: Backend, context: grpc.ServicerContext) -> Iterator[Any]:
        """Round messages as the engine produces them, then the final one."""
        text = TextStream(backend.decode, job.request.generation.stop)
        while True:
            event = _next_event(job, context)
            if event is None:
                job.cancel()  # the client is gone (its callback has normally done this already)
                return
            if isinstance(event, Round):
                yield self.pb.GenerateResponse(
                    request_id=job.request_id, token_ids=event.ids, text=text.push(event.ids)
                )
                continue
            yield self._final(job, event, text)
            self._set_status(job, event, context)
            return

    def _final(self, job: Job, done: Done, text: TextStream) -> Any:
        pb, result = self.pb, done.result
        finished = pb.Finished(reason=protos.enum_values("FinishReason")[done.reason])
        delta = ""
        if result is not None:
            delta = text.finish(result.text)
            finished.output_token_ids.extend(result.token_ids)
            finished.output_text = result.text
            finished.stats.CopyFrom(self.request_stats(job, result.stats))
        if done.error is not None:
            finished.error = f"{type(done.error).__name__}: {done.error}"
        return pb.GenerateResponse(request_id=job.request_id, text=delta, finished=finished)

    @staticmethod
    def _set_status(job: Job, done: Done, context: grpc.ServicerContext) -> None:
        if isinstance(done.error, GeneratorUnavailable):
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(f"{done.error}")
        elif done.error is not None:
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"generation failed: {type(done.error).__name__}: {done.error}")
        elif done.reason == "aborted" and job.deadline is not None and time.monotonic() >= job.deadline:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details("deadline exceeded; generation stopped")


def _next_event(job: Job, context: grpc.ServicerContext) -> Round | Done | None:
    """The job's next event, or None once the client has gone away."""
    while True:
        try:
            return job.events.get(timeout=EVENT_POLL_S)
        except queue.Empty:
            if not context.is_active():
                return None


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + max(remaining, 0.0)


def _parsing(rpc: Callable[..., Any], request_cls: Any, streaming: bool) -> Callable[..., Any]:
    """`rpc` called on the parsed request; a request that does not parse is INVALID_ARGUMENT."""
    def parsed(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return decoding.parse(request_cls, raw)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    if streaming:
        def handle_stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            yield from rpc(parsed(raw, context), context)
        return handle_stream

    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        return rpc(parsed(raw, context), context)
    return handle


class GenerationServer:
    """A running gRPC server; `load_backend` runs in a thread after the port is bound."""

    def __init__(self, options: ServeOptions, load_backend: Callable[[], Backend]) -> None:
        self.options = options
        self.load_backend = load_backend
        self.pb, self.pb_grpc = protos.load()
        self.metrics = ServerMetrics()
        self.registry = server_registry(self.metrics, self._counts)
        self.servicer = GenerationServicer(self.pb, options, self.metrics, self.registry)
        self.health = health.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None  # the /metrics HTTP port, once started
        self._metrics_http: WSGIServer | None = None
        self.http_port: int | None = None  # the OpenAI-compatible API's port, once started
        self._http: Any = None  # ssd.serve.http.HttpServer
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._backend: Backend | None = None
        self._worker: GenerationWorker | None = None

    def start(self) -> int:
        """Bind, start serving health and reflection, begin loading; return the port."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = self._build_server()
        self.port = self._bind(self._server)
        self._server.start()
        log.info("listening on %s:%d (%s)", self.options.host, self.port, "TLS" if self.options.tls else "plaintext")
        if self.options.metrics_port is not None:
            self._start_metrics_http()
        if self.options.http_port is not None:
            self._start_openai_http()
        threading.Thread(target=self._load, name="ssd-serve-loader", daemon=True).start()
        return self.port

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the backend is loaded; False on timeout or a failed load."""
        return self._ready.wait(timeout) and self.load_error is None

    def stop(self, grace_s: float | None = None) -> None:
        grace = self.options.grace_s if grace_s is None else grace_s
        with self._lock:
            if self._stopping.is_set():
                self._stopped.wait()
                return
            self._stopping.set()
        log.info("stopping: NOT_SERVING, finishing running requests (grace %.1f s)", grace)
        self.health.enter_graceful_shutdown()
        self.servicer.refuse("the server is shutting down")
        if self._worker is not None:
            self._worker.close(grace)
        if self._server is not None:
            self._server.stop(grace=min(grace, 1.0)).wait()
        self._stop_metrics_http()
        if self._http is not None:
            self._http.stop()
        self._close_backend()
        self._stopped.set()
        log.info("stopped")

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def _counts(self) -> tuple[int, int]:
        """(running, waiting) for the gauges; zeros while the model loads."""
        worker = self._worker
        return worker.counts if worker is not None else (0, 0)

    def _start_metrics_http(self) -> None:
        """Serve this server's registry at /metrics (any path answers, as prometheus_client does)."""
        opts = self.options
        tls = {"certfile": str(opts.tls_cert), "keyfile": str(opts.tls_key)} if opts.tls else {}
        try:
            self._metrics_http, _ = start_http_server(opts.metrics_port, addr=opts.host, registry=self.registry, **tls)
        except OSError as exc:
            self._server.stop(0)
            raise OSError(f"cannot serve metrics on {opts.host}:{opts.metrics_port}: {exc}") from exc
        self.metrics_port = self._metrics_http.server_port
        host = f"[{opts.host}]" if ":" in opts.host else opts.host
        log.info("metrics at %s://%s:%d/metrics", "https" if opts.tls else "http", host, self.metrics_port)

    def _start_openai_http(self) -> None:
        """The OpenAI-compatible API over this server's servicer: one worker, one batch."""
        from ssd.serve.http import HttpServer, OpenAIFrontend  # FastAPI loads only when asked for

        self._http = HttpServer(OpenAIFrontend(self.servicer, self.options), self.options)
        try:
            self.http_port = self._http.start()
        except OSError:
            self._server.stop(0)
            self._stop_metrics_http()
            raise

    def _stop_metrics_http(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    def _add_generation_service(self, server: grpc.Server) -> None:
        """ssd.v1.GenerationService with requests parsed by us (ssd.serve.decoding), so
        a malformed one gets INVALID_ARGUMENT naming the field, not INTERNAL."""
        handlers = {}
        for method in self.pb.DESCRIPTOR.services_by_name["GenerationService"].methods:
            handle = _parsing(getattr(self.servicer, method.name), getattr(self.pb, method.input_type.name),
                              method.server_streaming)
            make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
            handlers[method.name] = make(handle, response_serializer=getattr(self.pb, method.output_type.name).SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

    def _build_server(self) -> grpc.Server:
        opts = self.options
        interceptors = [BearerTokenInterceptor(opts.token)] if opts.token else []
        # Each streaming request holds a thread while it waits or streams; the
        # spare ones answer Abort, Stats, health and refusals beyond the queue.
        pool = ThreadPoolExecutor(max_workers=opts.max_queue + 16, thread_name_prefix="ssd-grpc")
        server = grpc.server(pool, interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", opts.max_message_bytes),
            ("grpc.max_send_message_length", opts.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second server must fail to bind, not share the port
        ])
        self._add_generation_service(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        return server

    def _bind(self, server: grpc.Server) -> int:
        address = self.options.address
        try:
            if self.options.tls:
                port = server.add_secure_port(address, _tls_credentials(self.options))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if not port:
            raise OSError(f"cannot listen on {address}")
        return port

    def _load(self) -> None:
        try:
            backend = self.load_backend()
        except BaseException as exc:  # reported through health and wait_ready
            log.exception("loading the model failed")
            self.load_error = exc
            self.servicer.refuse(f"the model failed to load: {exc}")
            self._ready.set()
            return
        with self._lock:
            if self._stopping.is_set():
                backend.close()
                self._ready.set()
                return
            self._backend = backend
            self._worker = GenerationWorker(backend, self.metrics, self.options.max_queue)
            self.servicer.attach(backend, self._worker)
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            if hasattr(backend, "watch_health"):
                backend.watch_health(self._backend_health)
            collector = backend.metrics_collector() if hasattr(backend, "metrics_collector") else None
            if collector is not None:  # e.g. per-replica series (ssd.cluster.replicas)
                self.registry.register(collector)
        log.info("model loaded: %s; serving", backend.info.target_model)
        self._ready.set()

    def _backend_health(self, serving: bool, why: str | None) -> None:
        """The backend lost its model or got it back: health and admission follow.

        Requests already queued stay queued; the backend runs them once it is back."""
        with self._lock:
            if self._stopping.is_set():
                return
            if serving:
                self.servicer.unavailable = None
                self._set_health(health_pb2.HealthCheckResponse.SERVING)
                log.info("backend recovered: SERVING")
            else:
                self.servicer.refuse(f"the model is restarting: {why}")
                self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                log.warning("backend lost (%s): NOT_SERVING", why)

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _close_backend(self) -> None:
        if self._backend is not None:
            try:
                self._backend.close()
            except Exception:
                log.exception("closing the backend failed")


def _tls_credentials(options: ServeOptions) -> grpc.ServerCredentials:
    key = options.tls_key.read_bytes()
    cert = options.tls_cert.read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


def serve_config(config: Any, options: ServeOptions, with_draft: bool = True) -> GenerationServer:
    """A started server for a Config, loading a LocalBackend in the background."""
    from ssd.serve.backend import LocalBackend

    server = GenerationServer(options, lambda: LocalBackend(config, with_draft=with_draft))
    server.start()
    return server
