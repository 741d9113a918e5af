"""The OpenAI-compatible HTTP API, beside the gRPC one, in the same process.

    POST /v1/completions        POST /v1/chat/completions   (SSE with "stream": true)
    GET  /v1/models             GET  /health                GET /metrics

This is a thin adapter over the GenerationService (ssd.serve.service) the
gRPC front end shares: JSON -> the neutral Request (http_schema.to_request),
the service's answers -> OpenAI objects, its errors -> HTTP statuses. One
admission path, one validation and one worker, so HTTP and gRPC requests
run in the same batch. No protobuf here. FastAPI
parses and routes, uvicorn serves (in a thread with its own event loop) and
FastAPI's SSE encoder frames the stream; handlers wait on a job's events in a
small thread pool so the event loop never blocks.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}:
400 invalid_request_error naming the field, 401, 404 (unknown model or
path), 413 (body over --max-message-bytes), 429 (queue full), 503 (loading,
restarting, shutting down). /health and /metrics stay open without the token
(as grpc.health.v1 and the metrics port do); /v1 needs `Authorization: Bearer`.

Speculation statistics ride in `speculation_stats` (the gRPC RequestStats as
JSON, the same fields) on each response and on the stream's last chunk. `logprobs` are the
target's, from the logits verification already scored (ssd.sampling.token_logprobs).

What `seed` guarantees: in AR and SD the same request (prompt, settings,
seed) gives the same output, alone or batched. In SSD it gives the same
distribution, but the output may depend on timing and batch composition:
a cache hit and a miss consume different draws.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.engine.request import TokenLogprob
from ssd.serve import http_schema as schema
from ssd.serve.service import (
    Chunk,
    DuplicateRequestId,
    Final,
    Generation,
    GenerationService,
    InvalidArgument,
    ModelInfo,
    NotServing,
    QueueFull,
    RequestStats,
    WorkerClosed,
)

log = logging.getLogger(__name__)

EVENT_POLL_S = 0.1  # how often a waiting handler checks that its client is still there
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports masked tokens the same way
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "aborted": "abort", "error": "error"}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(exc: InvalidArgument, param: str | None = None) -> ApiError:
    param = param or exc.field
    message = str(exc).split(": ", 1)[-1]
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


class OpenAIFrontend:
    """The routes, over the GenerationService the gRPC front end shares."""

    def __init__(self, service: GenerationService, options: Any) -> None:
        self.service = service
        self.options = options
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=options.max_queue + 8, thread_name_prefix="ssd-http")
        self.app = self._build()

    # --- the app -----------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="ssd OpenAI-compatible API", description=__doc__, docs_url=None, redoc_url=None)
        app.add_exception_handler(ApiError, lambda request, exc: exc.response())
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        """200 only while SERVING: the same truth as grpc.health.v1 (both follow the service)."""
        health = self.service.health()
        if not health.serving:
            return JSONResponse({"status": "NOT_SERVING", "reason": health.reason}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.service.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        info = self._model_info()
        card = {"id": info.target_model, "object": "model", "created": self.created, "owned_by": "ssd",
                "draft_model": info.draft_model, "modes": list(info.modes)}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        """OpenAI completions. `seed`: in AR and SD the same request gives the same output; in
        SSD the same distribution (the output may depend on timing and batch composition)."""
        return await self._generate(request, schema.CompletionBody, chat=False)

    async def chat(self, request: Request) -> Response:
        """OpenAI chat completions (the model's chat template). `seed`: as for /v1/completions."""
        return await self._generate(request, schema.ChatBody, chat=True)

    # --- one generation ------------------------------------------------------------

    async def _generate(self, request: Request, body_cls: type, chat: bool) -> Response:
        self._authorize(request)
        body = await self._body(request, body_cls)
        served = self._model_info().target_model
        if body.model != served:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves "
                           f"{served!r}", param="model", code="model_not_found")
        gen = self._submit(body)
        call = Call(self, body, gen, chat)
        if body.stream:
            return JobStream(call.events(), on_close=gen.cancel)
        try:
            return await call.complete(request)
        finally:
            gen.cancel()  # a no-op once it finished; frees the row if the client left

    async def _body(self, request: Request, body_cls: type) -> Any:
        raw = await self._read(request)
        try:
            # Bytes that are not UTF-8 survive as lone surrogates, so the error can name their field.
            data = json.loads(raw.decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"body: not valid JSON: {exc}", param="body", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "body: nested too deeply", param="body", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body: must be a JSON object", param="body", code="invalid_json")
        where = _first_surrogate(data)
        if where is not None:
            raise ApiError(400, f"{where or 'body'}: not valid UTF-8 (or a lone surrogate)",
                           param=where or "body", code="invalid_utf8")
        try:
            body = schema.parse(body_cls, data)
            schema.refuse_unsupported(body)
        except InvalidArgument as exc:
            raise invalid(exc) from None
        return body

    async def _read(self, request: Request) -> bytes:
        """The body, refused (413) past max_message_bytes without reading it all."""
        limit = self.options.max_message_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _model_info(self) -> ModelInfo:
        try:
            return self.service.model_info()
        except NotServing as exc:
            raise ApiError(503, str(exc), type_="server_error", code="unavailable") from None

    def _submit(self, body: Any) -> Generation:
        """The shared validation and admission (the gRPC API's), through the service."""
        try:
            return self.service.submit(schema.to_request(body), stream_text=bool(body.stream))
        except InvalidArgument as exc:
            raise invalid(exc, schema.body_param(exc.field, body)) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") from None
        except (NotServing, WorkerClosed, DuplicateRequestId) as exc:
            raise ApiError(503, str(exc), type_="server_error", code="unavailable") from None

    def _authorize(self, request: Request) -> None:
        token = self.options.token
        if token is None:
            return
        given = request.headers.get("authorization", "").encode()
        # Constant time, as the gRPC interceptor: a guess must not learn how much of it was right.
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):
            raise ApiError(401, "authorization: expected 'Bearer <token>'", type_="authentication_error",
                           param=None, code="invalid_api_key")

    async def next_event(self, gen: Generation) -> Chunk | Final | None:
        """The request's next event, or None after EVENT_POLL_S (the caller checks its client)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, gen.next, EVENT_POLL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Call:
    """One request's response: the OpenAI objects built from its generation's events."""

    def __init__(self, front: OpenAIFrontend, body: Any, gen: Generation, chat: bool) -> None:
        self.front, self.body, self.gen, self.chat = front, body, gen, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.logprobs_sent = 0
        self.text_offset = 0  # completions' text_offset: where the next token's text starts

    async def complete(self, request: Request) -> JSONResponse:
        """Wait for the end (the rounds only feed the text); abort if the client leaves."""
        checked = time.monotonic()
        while True:
            event = await self.front.next_event(self.gen)
            if isinstance(event, Final):
                return self._response(event)
            if time.monotonic() - checked >= EVENT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    log.info("client of %s disconnected; aborting", self.gen.request_id)
                    self.gen.cancel()
                    return JSONResponse({}, status_code=499)

    async def events(self) -> AsyncIterator[bytes]:
        """SSE events: a first chunk (chat: the role), one per round, the finish, usage, [DONE]."""
        if self.chat:
            yield self._sse(self._chunk({"role": "assistant", "content": ""}))
        while True:
            event = await self.front.next_event(self.gen)
            if event is None:
                continue
            if isinstance(event, Chunk):
                chunk = self._round_chunk(event)
                if chunk is not None:
                    yield self._sse(chunk)
                continue
            for chunk in self._final_chunks(event):
                yield self._sse(chunk)
            yield format_sse_event(data_str="[DONE]")
            return

    # --- building the objects ------------------------------------------------------

    def _response(self, final: Final) -> JSONResponse:
        result = self._result(final)
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH[final.reason],
                                  "logprobs": self._logprobs(result.logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return JSONResponse({
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.body.model, "choices": [choice],
            "usage": self._usage(result), "speculation_stats": _stats_json(final.stats),
        })

    def _result(self, final: Final) -> Any:
        if final.error is not None:
            status = 503 if final.unavailable else 500
            raise ApiError(status, f"generation failed: {type(final.error).__name__}: {final.error}",
                           type_="server_error", code="generation_failed")
        if final.result is None:
            raise ApiError(503, "the request was aborted (the server is shutting down)",
                           type_="server_error", code="aborted")
        return final.result

    def _round_chunk(self, event: Chunk) -> dict[str, Any] | None:
        delta = event.text
        logprobs = self._stream_logprobs(event.logprobs)
        if not delta and logprobs is None:
            return None
        return self._chunk({"content": delta} if self.chat else delta, logprobs=logprobs)

    def _final_chunks(self, final: Final) -> list[dict[str, Any]]:
        if final.error is not None or final.result is None:
            try:
                self._result(final)
            except ApiError as exc:
                return [exc.body()]
        result = final.result
        delta = final.text
        rest = (result.logprobs or [])[self.logprobs_sent:]  # a remote engine sends them with the result
        last = self._chunk({"content": delta} if self.chat else delta, FINISH[final.reason],
                           self._stream_logprobs(rest))
        last["speculation_stats"] = _stats_json(final.stats)
        chunks = [last]
        options = self.body.stream_options
        if options is not None and options.include_usage:
            chunks.append({"id": self.id, "object": last["object"], "created": self.created,
                           "model": self.body.model, "choices": [], "usage": self._usage(result)})
        return chunks

    def _chunk(self, delta: Any, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "choices": [choice]}

    def _stream_logprobs(self, entries: list[TokenLogprob]) -> Any:
        if schema.top_logprobs(self.body) is None or not entries:
            return None
        self.logprobs_sent += len(entries)
        return self._logprobs(entries)

    def _logprobs(self, entries: list[TokenLogprob] | None) -> Any:
        """OpenAI's logprobs object: chat's `content` list, or the completions' parallel lists."""
        if entries is None or schema.top_logprobs(self.body) is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token) for e in entries]
        offsets = _offsets(tokens, self.text_offset)
        self.text_offset += sum(map(len, tokens))
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self._token(i): _finite(v) for i, v in e.top} for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        def one(token: int, value: float) -> dict[str, Any]:
            text = self._token(token)
            return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

        return one(entry.token, entry.logprob) | {"top_logprobs": [one(i, v) for i, v in entry.top]}

    def _token(self, token: int) -> str:
        return self.gen.decode([token])

    def _usage(self, result: Any) -> dict[str, int]:
        prompt, completion = self.gen.prompt_tokens, len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _sse(data: dict[str, Any]) -> bytes:
        return format_sse_event(data_str=json.dumps(data, separators=(",", ":")))


class JobStream(EventSourceResponse):
    """An SSE response that cancels its job however it ends (finished, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class HttpServer:
    """uvicorn serving an OpenAIFrontend in a thread of its own, on a socket bound here
    (so a busy port fails `start` at once and port 0 reports the port it got)."""

    def __init__(self, front: OpenAIFrontend, options: Any) -> None:
        self.front = front
        self.options = options
        self.port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        opts = self.options
        family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
        try:
            sock = socket.create_server((opts.host, opts.http_port), family=family)
        except OSError as exc:
            raise OSError(f"cannot serve HTTP on {opts.host}:{opts.http_port}: {exc}") from exc
        self.port = sock.getsockname()[1]
        tls = {"ssl_certfile": str(opts.tls_cert), "ssl_keyfile": str(opts.tls_key)} if opts.tls else {}
        config = uvicorn.Config(self.front.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name="ssd-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        scheme = "https" if opts.tls else "http"
        log.info("OpenAI-compatible API at %s://%s:%d/v1", scheme, opts.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.front.close()


def _stats_json(stats: RequestStats) -> dict[str, Any]:
    """The request's stats as the gRPC API's RequestStats reads in JSON (proto field names; map
    keys as strings; a non-finite number as "NaN"/"Infinity"), the mode by name."""
    return _json_value(dataclasses.asdict(stats))


def _json_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _first_surrogate(value: Any, path: str = "") -> str | None:
    """The path ("messages[0].content") of the first string (or key) holding a lone surrogate."""
    if isinstance(value, str):
        return path if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _first_surrogate(key) is not None:
            return path or "body"
        where = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
        found = _first_surrogate(item, where)
        if found is not None:
            return found
    return None


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _offsets(tokens: list[str], at: int) -> list[int]:
    out = []
    for token in tokens:
        out.append(at)
        at += len(token)
    return out


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"body: larger than {limit} bytes", param="body", code="request_too_large")


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown path, wrong method) in OpenAI's shape."""
    return ApiError(exc.status_code, str(exc.detail), param=None, code=None).response()
