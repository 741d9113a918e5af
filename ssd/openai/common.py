"""What every router of the OpenAI API shares: its errors, and the gate each request passes.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: ApiError,
`invalid` (400 naming the field), `unavailable` (503). `Api` holds the service and
the options, and checks the token, reads and parses the body (413 past
--max-message-bytes without reading it all; not JSON, not UTF-8 or a refused field:
400 naming it), checks `model` against the served names, and waits on a request's
events in a thread pool so the event loop never blocks. `listed` is OpenAI's list
object (order, limit, after) for every list route.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.openai import schema
from ssd.openai.stored import page
from ssd.serve.service import Chunk, Final, Generation, GenerationService, InvalidArgument, ModelInfo, NotServing

EVENT_POLL_S = 0.1  # how often a waiting handler checks that its client is still there
BATCH_LINE = "ssd.batch_line"  # the ASGI scope key that marks a batch line's request (ssd.openai.routes.batches)


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


def unavailable(exc: Exception) -> ApiError:
    """503: the model is loading or the server is stopping (NotServing, WorkerClosed, ...)."""
    return ApiError(503, str(exc), type_="server_error", code="unavailable")


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown path, wrong method) in OpenAI's shape."""
    return ApiError(exc.status_code, str(exc.detail), param=None, code=None).response()


def batch_line(request: Request) -> bool:
    """Whether `request` is a batch line (ssd.openai.routes.batches.asgi_post marks its scope;
    no client can): it queues behind live requests."""
    return bool(request.scope.get(BATCH_LINE))


class Api:
    """The gate every route passes, over the GenerationService the gRPC front end shares."""

    def __init__(self, service: GenerationService, options: Any) -> None:
        self.service = service
        self.options = options
        # Handlers wait on a request's events here; one thread per queued request, and spares.
        self.pool = ThreadPoolExecutor(max_workers=options.max_queue + 8, thread_name_prefix="ssd-http")

    def authorize(self, request: Request) -> None:
        token = self.options.token
        if token is None:
            return
        given = request.headers.get("authorization", "").encode()
        # Constant time, as the gRPC interceptor: a guess must not learn how much of it was right.
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):
            raise ApiError(401, "authorization: expected 'Bearer <token>'", type_="authentication_error",
                           param=None, code="invalid_api_key")

    async def body(self, request: Request, body_cls: type) -> Any:
        """The request's JSON body as `body_cls`, or a 400 naming what is wrong with it."""
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

    def model_info(self) -> ModelInfo:
        try:
            return self.service.model_info()
        except NotServing as exc:
            raise unavailable(exc) from None

    def served(self) -> list[str]:
        """The names requests may give as `model`: --served-model-name's, else the target's."""
        return list(self.options.served_model_names) or [self.model_info().target_model]

    def check_model(self, model: str | None) -> None:
        served = self.served()
        if model is not None and model not in served:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                           param="model", code="model_not_found")

    def rows(self) -> int:
        """The rows the server's engines run in all (every replica's), from its configuration."""
        try:
            defaults = self.service.info().defaults
        except NotServing:
            return 1
        return defaults.batching.max_rows * defaults.cluster.replicas

    async def next_event(self, gen: Generation) -> Chunk | Final | None:
        """The request's next event, or None after EVENT_POLL_S (the caller checks its client)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, gen.next, EVENT_POLL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _page_query(request: Request, most: int, default: int) -> tuple[str, int, str | None]:
    """A list's `order` (default desc), `limit` (1..most) and cursor `after`."""
    query = request.query_params
    order, limit = query.get("order", "desc"), query.get("limit", str(default))
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be asc or desc, got {order!r}", param="order", code="invalid_value")
    if not limit.isdigit() or not 1 <= int(limit) <= most:
        raise ApiError(400, f"limit: must be an integer in 1..{most}, got {limit!r}", param="limit",
                       code="invalid_value")
    return order, int(limit), query.get("after")


def listed(items: list[dict[str, Any]], request: Request, owner: str, most: int = 100,
           default: int = 20) -> JSONResponse:
    """OpenAI's list object over `items`, as the request's query asks (`limit` 1..most, by
    default `default`: OpenAI's 100 and 20 for most lists)."""
    order, limit, after = _page_query(request, most, default)
    try:
        return JSONResponse(page(items, order, limit, after))
    except KeyError:
        raise ApiError(400, f"after: no item {after!r} in {owner}", param="after", code="invalid_value") from None


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


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"body: larger than {limit} bytes", param="body", code="request_too_large")
