"""The gRPC frontend: GenerationService over a Backend, plus health and reflection.

Lifecycle: `start()` binds the port at once with health NOT_SERVING and loads
the backend in a thread; health turns SERVING when it is loaded. `stop()`
turns health NOT_SERVING, refuses new requests, lets running ones finish for
the grace period, aborts the rest and closes the port. With
`metrics_port` set, Prometheus scrapes http://host:port/metrics from the
server's own registry, which also writes the Stats RPC's text.

The OpenAI-compatible HTTP API is not started here: ssd.openai.server.OpenAIServer
is this server with it beside gRPC (ssd.serve never imports ssd.openai; the
layers point down). A subclass adds front ends through `_start_front_ends` and
`_stop_front_ends`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from ssd.config import ConfigError
from ssd.serve import convert, decoding, protos
from ssd.serve.auth import BearerTokenInterceptor
from ssd.serve.backend import Backend
from ssd.serve.metrics import ServerMetrics, server_registry
from ssd.serve.options import ServeOptions
from ssd.serve.service import (
    Chunk,
    DuplicateRequestId,
    Final,
    Generation,
    GenerationService,
    InvalidArgument,
    NotServing,
    QueueFull,
    WorkerClosed,
)
from ssd.serve.worker import GenerationWorker

log = logging.getLogger(__name__)

SERVICE_NAME = "ssd.v1.GenerationService"
EVENT_POLL_S = 0.1  # how often a waiting stream checks that its client is still there
NO_DEADLINE_S = 1e9


class GenerationServicer:
    """The four ssd.v1 RPCs: a thin adapter over the GenerationService the HTTP
    front end (ssd.openai) shares. Protobuf in -> the neutral request
    (ssd.serve.convert), the service's answers -> protobuf, its errors -> status
    codes: INVALID_ARGUMENT naming the field, UNAVAILABLE, RESOURCE_EXHAUSTED,
    ALREADY_EXISTS."""

    def __init__(self, pb: Any, service: GenerationService) -> None:
        self.pb = pb
        self.service = service

    @property
    def unavailable(self) -> str | None:
        """Why requests are refused; None: serving."""
        return self.service.unavailable

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        gen = self._submit(request, context)
        # Runs on client cancel, deadline and normal end alike (a no-op then).
        if not context.add_callback(gen.cancel):
            gen.cancel()
        yield self.pb.GenerateResponse(
            request_id=gen.request_id,
            accepted=self.pb.Accepted(prompt_tokens=gen.prompt_tokens, queued_ahead=gen.queued_ahead),
        )
        yield from self._stream(gen, context)

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.pb.AbortResponse(found=self.service.abort(request.request_id))

    def ModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return convert.model_info(self.pb, self.service.model_info())
        except NotServing as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return convert.stats_response(self.pb, self.service.stats())

    def _submit(self, request: Any, context: grpc.ServicerContext) -> Generation:
        try:
            self.service.serving()  # loading or stopping: UNAVAILABLE before any field is looked at
            return self.service.submit(convert.from_proto(request), deadline=_deadline(context))
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DuplicateRequestId as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except (NotServing, WorkerClosed) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _stream(self, gen: Generation, context: grpc.ServicerContext) -> Iterator[Any]:
        """Round messages as the engine produces them, then the final one."""
        while True:
            event = gen.next(EVENT_POLL_S)
            if event is None:
                if not context.is_active():
                    gen.cancel()  # the client is gone (its callback has normally done this already)
                    return
                continue
            if isinstance(event, Chunk):
                logprobs = convert.token_logprobs(self.pb, event.logprobs)
                yield self.pb.GenerateResponse(request_id=gen.request_id, token_ids=event.token_ids,
                                               text=event.text, logprobs=logprobs)
                continue
            yield self._final(gen, event)
            self._set_status(event, context)
            return

    def _final(self, gen: Generation, final: Final) -> Any:
        pb, result = self.pb, final.result
        finished = pb.Finished(reason=protos.enum_values("FinishReason")[final.reason])
        if result is not None:
            finished.output_token_ids.extend(result.token_ids)
            finished.output_text = result.text
            finished.stats.CopyFrom(convert.request_stats(pb, final.stats))
            finished.output_logprobs.extend(convert.token_logprobs(pb, result.logprobs))
            finished.prompt_logprobs.extend(convert.token_logprobs(pb, result.prompt_logprobs))
        if final.error is not None:
            finished.error = f"{type(final.error).__name__}: {final.error}"
        return pb.GenerateResponse(request_id=gen.request_id, text=final.text, finished=finished)

    @staticmethod
    def _set_status(final: Final, context: grpc.ServicerContext) -> None:
        if final.unavailable:
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(f"{final.error}")
        elif final.refused:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(str(final.error))
        elif final.error is not None:
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"generation failed: {type(final.error).__name__}: {final.error}")
        elif final.deadline_exceeded:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details("deadline exceeded; generation stopped")


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

    serves_http = False  # whether options.http_port is served (ssd.openai.server.OpenAIServer's is)

    def __init__(self, options: ServeOptions, load_backend: Callable[[], Backend]) -> None:
        if options.http_port is not None and not self.serves_http:
            # Refused, not ignored: a caller that asked for the HTTP API must not get a server without it.
            raise ConfigError("serve.http_port is set, but GenerationServer serves gRPC only; "
                              "ssd.openai.server.OpenAIServer serves the OpenAI-compatible API beside it")
        self.options = options
        self.load_backend = load_backend
        self.pb, self.pb_grpc = protos.load()
        self.metrics = ServerMetrics()
        self.registry = server_registry(self.metrics, self._counts)
        self.service = GenerationService(options, self.metrics, self.registry)
        self.servicer = GenerationServicer(self.pb, self.service)
        self.health = health.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None  # the /metrics HTTP port, once started
        self._metrics_http: WSGIServer | None = None
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
        try:
            self._start_front_ends()
        except OSError:  # e.g. a busy HTTP port: nothing stays bound
            self._server.stop(0)
            self._stop_metrics_http()
            raise
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
        self.service.refuse("the server is shutting down")
        if self._worker is not None:
            self._worker.close(grace)
        if self._server is not None:
            self._server.stop(grace=min(grace, 1.0)).wait()
        self._stop_metrics_http()
        self._stop_front_ends()
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

    def _start_front_ends(self) -> None:
        """Front ends beside gRPC over self.service, started once the gRPC port is bound (an
        OSError stops what started): none here; ssd.openai.server.OpenAIServer adds HTTP."""

    def _stop_front_ends(self) -> None:
        """Stop them, after the worker drained and gRPC closed, before the backend closes."""

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
            self.service.refuse(f"the model failed to load: {exc}")
            self._ready.set()
            return
        with self._lock:
            if self._stopping.is_set():
                backend.close()
                self._ready.set()
                return
            self._backend = backend
            self._worker = GenerationWorker(backend, self.metrics, self.options.max_queue)
            self.service.attach(backend, self._worker)
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
                self.service.resume()
                self._set_health(health_pb2.HealthCheckResponse.SERVING)
                log.info("backend recovered: SERVING")
            else:
                self.service.refuse(f"the model is restarting: {why}")
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
