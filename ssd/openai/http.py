"""The OpenAI-compatible HTTP API, beside the gRPC one, in the same process.

    POST /v1/completions        POST /v1/chat/completions   (SSE with "stream": true)
    POST /v1/responses          (OpenAI's Responses API, as a chat: ssd.openai.responses)
    GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items   (stored: ssd.openai.stored)
    POST /v1/responses/{id}/cancel                                      (a background response)
    /v1/conversations, /v1/conversations/{id}/items                     (ssd.openai.routes.conversations)
    /v1/files, /v1/batches      (OpenAI's Batch API: ssd.openai.routes.batches)
    GET  /v1/models             GET  /v1/models/{id}
    GET  /health (and /ping)    GET  /metrics               GET  /version     GET  /load

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
restarting, shutting down; a request aborted by shutdown). A failure after a
stream began ends it with OpenAI's error event (`data: {"error": {...}}`);
finish_reason only takes OpenAI's values (stop, length, tool_calls). /health
and /metrics stay open without the token (as grpc.health.v1 and the metrics
port do); /v1 needs `Authorization: Bearer`.

Choices: each of a request's n (or best_of) samples of each prompt is its
own request to the service, hence its own row of the continuous batch, its
own seeded generator (choice i: ssd.serve.validation.choice_seed) and its own
stats; best_of keeps the n with the highest cumulative log-probability.

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
import hmac
import json
import logging
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import ssd
from ssd.openai import schema
from ssd.openai import responses
from ssd.openai.batch_disk import write_whole
from ssd.openai.routes.batches import BatchRoutes, batch_line
from ssd.openai.routes.conversations import ConversationRoutes, listed
from ssd.serve.metrics import BATCHES_GAUGES, RESPONSES_GAUGES, GaugesCollector
from ssd.openai.stored import ResponseStore, StoredResponse, dump_stores, load_stores, stores_version
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
    WorkerClosed,
)

log = logging.getLogger(__name__)

STORE_FILE = "responses.json"  # in --store-dir
STORE_WRITE_S = 10.0  # how often the stores are written to --store-dir while they change (and at the stop)
ENDED_STREAMS = 16  # background responses whose events stay readable after they end (late readers)
from ssd.openai.calls import (
    EVENT_POLL_S,
    ApiError,
    Call,
    Choice,
    JobStream,
    ResponsesCall,
    invalid,
    unavailable,
)

class OpenAIFrontend:
    """The routes, over the GenerationService the gRPC front end shares."""

    def __init__(self, service: GenerationService, options: Any) -> None:
        self.service = service
        self.options = options
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=options.max_queue + 8, thread_name_prefix="ssd-http")
        self.stored = ResponseStore(options.stored_responses)
        self.conversations = ConversationRoutes(options.stored_conversations, self._authorize, self._body)
        self.batches = BatchRoutes(options, self._authorize, self._body, self._rows)
        self._read_store()
        self._written = self._stores_version()
        self._closing = threading.Event()
        self._writer: threading.Thread | None = None
        if self._store_file() is not None:
            self._writer = threading.Thread(target=self._keep_writing, name="ssd-store", daemon=True)
            self._writer.start()
        self.running: dict[str, ResponsesCall] = {}  # background responses by id, until they end
        self.ended_streams: OrderedDict[str, ResponsesCall] = OrderedDict()  # the last few, for late readers
        service.registry.register(GaugesCollector(
            RESPONSES_GAUGES, lambda: (len(self.stored), len(self.running), len(self.conversations.store))))
        service.registry.register(GaugesCollector(BATCHES_GAUGES, self.batches.counts))
        self.app = self._build()

    # --- the app -----------------------------------------------------------------

    def _build(self) -> FastAPI:
        # No schema, docs or redoc routes: they would answer without the API key (every route's shapes
        # to anyone); docs/serving.md lists the routes.
        app = FastAPI(title="ssd OpenAI-compatible API", description=__doc__, docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_exception_handler(ApiError, lambda request, exc: exc.response())
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ping", self.health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for it
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/load", self.load, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.stored_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.response_input, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"])
        self.conversations.add_to(app)
        self.batches.add_to(app)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        """200 only while SERVING: the same truth as grpc.health.v1 (both follow the service)."""
        health = self.service.health()
        if not health.serving:
            return JSONResponse({"status": "NOT_SERVING", "reason": health.reason}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def version(self) -> JSONResponse:
        """vLLM's /version: this server's version (open, as /health)."""
        return JSONResponse({"version": ssd.__version__})

    async def load(self) -> JSONResponse:
        """vLLM's /load: the requests running and queued now (open, as /health)."""
        worker = self.service.worker
        running, waiting = worker.counts if worker is not None else (0, 0)
        return JSONResponse({"server_load": running + waiting})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.service.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card(name) for name in self._served()]})

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """OpenAI's model retrieval: the served model's card, 404 for any other id."""
        self._authorize(request)
        self._check_model(model_id)
        return JSONResponse(self._card(model_id))

    def _rows(self) -> int:
        """The rows the server's engines run in all (every replica's), from its configuration."""
        try:
            defaults = self.service.info().defaults
        except NotServing:
            return 1
        return defaults.batching.max_rows * defaults.cluster.replicas

    def _served(self) -> list[str]:
        """The names requests may give as `model`: --served-model-name's, else the target's."""
        return list(self.options.served_model_names) or [self._model_info().target_model]

    def _card(self, name: str) -> dict[str, Any]:
        """The model's card: OpenAI's fields, the draft and modes, and what an omitted field gets."""
        info = self._model_info()
        d = info.defaults
        try:
            up_to_context = self.service.info().defaults.serve_defaults.max_new_tokens is None
        except NotServing as exc:
            raise unavailable(exc) from None
        defaults = {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p,
                    "seed": None if d.random_seed else d.seed,  # None: a fresh random seed per request
                    "coupling": d.coupling,  # "auto": gumbel for a seeded request, standard without
                    # None: up to the context (max_model_len minus the prompt), within max_tokens_limit
                    "max_tokens": None if up_to_context else d.max_new_tokens}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ssd", "root": info.target_model,
                "draft_model": info.draft_model, "modes": list(info.modes),
                "max_model_len": info.limits.max_context_tokens, "max_tokens_limit": info.limits.max_new_tokens,
                "defaults": defaults}

    async def completions(self, request: Request) -> Response:
        """OpenAI completions. `seed`: in AR and SD the same request gives the same output; in
        SSD the same distribution (the output may depend on timing and batch composition)."""
        return await self._generate(request, schema.CompletionBody, chat=False)

    async def chat(self, request: Request) -> Response:
        """OpenAI chat completions (the model's chat template). `seed`: as for /v1/completions."""
        return await self._generate(request, schema.ChatBody, chat=True)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as the chat completion it means (ssd.openai.responses)."""
        self._authorize(request)
        body = await self._body(request, responses.ResponsesBody)
        self._check_model(body.model)
        earlier = self._continued(body)
        origins: list[str] = []
        try:
            chat, origins = (self._fitted(body, earlier) if body.truncation == "auto"
                             else responses.to_chat(body, earlier))
            cap = self.options.max_chat_messages
            if len(chat.messages) > cap:  # named here: validation would name the chat's `messages`
                raise InvalidArgument(responses.whole_chat_field(origins), f"at most {cap} messages, got "
                                      f"{len(chat.messages)}" + ("" if body.truncation == "auto" else
                                                                 '; truncation "auto" drops the oldest turns to fit'))
            schema.refuse_unsupported(chat)
            choices = self._submit_all(chat, batch_line(request))
        except InvalidArgument as exc:
            raise invalid(exc, responses.chat_param(exc.field, origins)) from None
        except ApiError as exc:
            if exc.param is None or exc.status != 400:
                raise
            renamed = responses.chat_param(exc.param, origins)
            raise invalid(InvalidArgument(renamed, exc.message.split(": ", 1)[-1])) from None
        call = ResponsesCall(self, chat, choices, body, earlier)
        if body.background:
            queued = self._start_background(call)
            return JobStream(call.replay(), on_close=_stays) if body.stream else JSONResponse(queued)
        if body.stream:
            return JobStream(call.events(), on_close=call.cancel)
        try:
            return await call.complete(request)
        finally:
            call.cancel()

    def _continued(self, body: responses.ResponsesBody) -> list[dict[str, Any]]:
        """The items the request continues: its conversation's, or those of the stored
        response it names (none: [])."""
        if body.store and self.stored.capacity == 0:
            raise invalid(InvalidArgument("store", "this server stores no responses (--stored-responses 0); "
                                                   "omit store or send false"))
        if body.background and (body.store is False or self.stored.capacity == 0):
            raise invalid(InvalidArgument("background", "a background response is stored to be polled: "
                                                        "it needs store (and --stored-responses > 0)"))
        if body.conversation is not None:
            if body.previous_response_id is not None:
                raise invalid(InvalidArgument("conversation", "cannot be combined with previous_response_id"))
            return self.conversations.find(responses.conversation_id(body), "conversation").snapshot()
        if body.previous_response_id is None:
            return []
        found = self._stored(body.previous_response_id, "previous_response_id")
        status = found.response["status"]
        if status not in ("completed", "incomplete"):  # a background one queued, running or stopped
            raise invalid(InvalidArgument("previous_response_id", f"response {body.previous_response_id!r} is "
                                          f"{status}: only a finished response (completed or incomplete) goes on"))
        return found.conversation

    def _fitted(self, body: responses.ResponsesBody, earlier: list[dict[str, Any]]) -> tuple[Any, list[str]]:
        """truncation "auto" (OpenAI's): the chat without its oldest user turns, as few dropped as
        let it fit --max-chat-messages and the prompt and max_output_tokens (at least one token)
        fit the model's context; with only the last turn left, that one (and validation says what
        does not fit)."""
        limit = self._model_info().limits.max_context_tokens
        room = body.max_output_tokens or 1
        drops = [0, *responses.turn_starts(body, earlier)]
        for drop in drops[:-1]:
            chat, origins = responses.to_chat(body, earlier, drop)
            if len(chat.messages) > self.options.max_chat_messages:
                continue  # validation would refuse it whatever its length in tokens
            try:
                prompt = self.service.tokenize(schema.to_request(chat))
            except NotServing as exc:
                raise unavailable(exc) from None
            if len(prompt) + room <= limit:
                return chat, origins
        return responses.to_chat(body, earlier, drops[-1])

    def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        found = self.stored.get(response_id)
        if found is None:
            raise ApiError(404, f"{param + ': ' if param else ''}no stored response {response_id!r} (never "
                           f"stored, deleted, or evicted: the server keeps the last {self.stored.capacity})",
                           param=param, code="previous_response_not_found" if param else "response_not_found")
        return found

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """OpenAI's response retrieval: a stored response as its request returned it; with
        `stream=true`, a background response's events after `starting_after` (a sequence
        number), while it runs or soon after."""
        self._authorize(request)
        query = request.query_params
        if query.get("stream", "false").lower() in ("false", "0"):
            return JSONResponse(self._stored(response_id).response)
        after = query.get("starting_after", "-1")
        if not after.lstrip("-").isdigit() or int(after) < -1:
            raise ApiError(400, f"starting_after: must be a sequence number, got {after!r}",
                           param="starting_after", code="invalid_value")
        call = self.running.get(response_id) or self.ended_streams.get(response_id)
        if call is None:
            self._stored(response_id)  # a 404 when it is not even stored
            raise ApiError(400, f"stream: response {response_id!r} is no background response this server "
                           f"still streams; retrieve it whole", param="stream", code="invalid_value")
        return JobStream(call.replay(int(after)), on_close=_stays)

    def background_ended(self, call: ResponsesCall) -> None:
        """A background response's run ended: no longer cancellable; its events stay readable
        for the last ENDED_STREAMS of them."""
        self.running.pop(call.id, None)
        if call.deleted:
            return
        self.ended_streams[call.id] = call
        while len(self.ended_streams) > ENDED_STREAMS:
            self.ended_streams.popitem(last=False)

    def _start_background(self, call: ResponsesCall) -> dict[str, Any]:
        """Store the response as queued, run it on the event loop, answer with it now."""
        queued = call.snapshot("queued")
        call.save(queued)
        self.running[call.id] = call  # and so its task, which leaves it as the response ends
        call.task = asyncio.get_running_loop().create_task(call.run_in_background())
        return queued

    async def cancel_response(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's cancel: a queued or running background response stops and is stored as
        cancelled (again: the same answer); any other is 400."""
        self._authorize(request)
        call = self.running.get(response_id)
        if call is not None and not call.ended:
            return JSONResponse(call.cancel_in_background())
        found = self._stored(response_id).response
        if found.get("background") and found["status"] == "cancelled":
            return JSONResponse(found)
        why = "ended" if found.get("background") else "not a background response"
        raise ApiError(400, f"response {response_id!r} is {found['status']} ({why}): only a queued or running "
                       f"background response can be cancelled", code="response_not_cancellable")

    async def delete_response(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's delete: the stored response, and its events; a background response that
        runs stops (else its run would store it again as it goes)."""
        self._authorize(request)
        call = self.running.get(response_id)
        if call is not None and not call.ended:
            call.delete_in_background()
        self.ended_streams.pop(response_id, None)
        if not self.stored.delete(response_id):
            self._stored(response_id)  # the 404
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def response_input(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's input item list: a stored response's own input items, `order` (default desc),
        `limit` (1-100, default 20) and the cursor `after`."""
        self._authorize(request)
        return listed(self._stored(response_id).input_items, request, f"response {response_id!r}")

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: the prompt's ids as a generation takes them (chat: rendered)."""
        self._authorize(request)
        body = await self._body(request, schema.TokenizeBody)
        self._check_model(body.model)
        try:
            ids = self.service.tokenize(schema.tokenize_request(body))
        except InvalidArgument as exc:
            raise invalid(exc, schema.body_param(exc.field, body)) from None
        except NotServing as exc:
            raise unavailable(exc) from None
        limits = self._model_info().limits
        return JSONResponse({"count": len(ids), "max_model_len": limits.max_context_tokens, "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids."""
        self._authorize(request)
        body = await self._body(request, schema.DetokenizeBody)
        self._check_model(body.model)
        try:
            return JSONResponse({"prompt": self.service.detokenize(body.tokens)})
        except InvalidArgument as exc:
            raise invalid(exc) from None
        except NotServing as exc:
            raise unavailable(exc) from None

    def _check_model(self, model: str | None) -> None:
        served = self._served()
        if model is not None and model not in served:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                           param="model", code="model_not_found")

    # --- one generation ------------------------------------------------------------

    async def _generate(self, request: Request, body_cls: type, chat: bool) -> Response:
        self._authorize(request)
        body = await self._body(request, body_cls)
        self._check_model(body.model)
        call = Call(self, body, self._submit_all(body, batch_line(request)), chat)
        if body.stream:
            return JobStream(call.events(), on_close=call.cancel)
        try:
            return await call.complete(request)
        finally:
            call.cancel()  # a no-op once they finished; frees the rows if the client left

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
            raise unavailable(exc) from None

    def _submit_all(self, body: Any, background: bool = False) -> list[Choice]:
        """Every choice as its own request (a row of the batch): each prompt's n samples
        (best_of, when larger), sample i seeded choice_seed(seed, i) (ssd.serve.validation).
        If one is refused, those already queued are cancelled. `background`: a batch line's
        (queued after live requests)."""
        prompts = schema.prompts(body)
        batch = isinstance(body, schema.CompletionBody) and isinstance(body.prompt, list) \
            and bool(body.prompt) and not isinstance(body.prompt[0], int)  # a list of prompts
        samples = getattr(body, "best_of", None) or body.n or 1
        ranked = samples > (body.n or 1)  # best_of ranks by log-probability: every sample needs them
        choices: list[Choice] = []
        try:
            for p, prompt in enumerate(prompts):
                for i in range(samples):
                    request = self._request(body, prompt, i, p if batch else None)
                    request.background = background
                    if ranked and request.logprobs is None:
                        request.logprobs = 0
                    gen = self._submit(request, body, p if batch else None)
                    choices.append(Choice(p, i, gen, echo=self._echo(body, prompt, gen)))
        except BaseException:
            for choice in choices:
                choice.gen.cancel()
            raise
        return choices

    @staticmethod
    def _request(body: Any, prompt: Any, choice: int, prompt_index: int | None) -> Any:
        try:
            return schema.to_request(body, prompt, choice=choice)
        except InvalidArgument as exc:
            raise invalid(exc, schema.body_param(exc.field, body, prompt_index)) from None

    @staticmethod
    def _echo(body: Any, prompt: Any, gen: Generation) -> str:
        """What the reply starts with: completions' prompt, or chat's last message where it is the assistant's (vLLM's)."""
        if not body.echo:
            return ""
        if isinstance(body, schema.ChatBody):
            last = body.messages[-1]
            return schema.message_content(last, len(body.messages) - 1, True) if last.role == "assistant" else ""
        whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None
        return prompt if whole else gen.decode(gen.request.prompt_ids)

    def _submit(self, request: Any, body: Any, prompt_index: int | None) -> Generation:
        """The shared validation and admission (the gRPC API's), through the service."""
        try:
            return self.service.submit(request, streams=bool(body.stream))
        except InvalidArgument as exc:
            raise invalid(exc, schema.body_param(exc.field, body, prompt_index)) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") from None
        except (NotServing, WorkerClosed, DuplicateRequestId) as exc:
            raise unavailable(exc) from None

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
        self.batches.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._closing.set()
        if self._writer is not None:
            self._writer.join(timeout=STORE_WRITE_S)
            self._write_store()
            log.info("wrote %d stored responses and %d conversations to %s", len(self.stored),
                     len(self.conversations.store), self._store_file())

    def _stores_version(self) -> tuple[int, int, int]:
        return stores_version(self.stored, self.conversations.store)

    def _keep_writing(self) -> None:
        """Write the stores every STORE_WRITE_S while they change, so a crash loses at most that."""
        while not self._closing.wait(STORE_WRITE_S):
            if self._stores_version() != self._written:
                self._write_store()

    def _store_file(self) -> Path | None:
        directory = self.options.store_dir
        return None if directory is None else Path(directory) / STORE_FILE

    def _read_store(self) -> None:
        """The responses and conversations the last run wrote (--store-dir), if any."""
        path = self._store_file()
        if path is None or not path.exists():
            return
        try:
            load_stores(json.loads(path.read_text()), self.stored, self.conversations.store)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("%s unreadable (%s); starting with no stored responses or conversations", path, exc)
            return
        log.info("read %d stored responses and %d conversations from %s", len(self.stored),
                 len(self.conversations.store), path)

    def _write_store(self) -> None:
        """Both stores to --store-dir, whole or not at all (a file written aside, then moved).
        Runs on the writer thread, and once more at the stop after it has ended."""
        path = self._store_file()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            version = self._stores_version()
            write_whole(path, json.dumps(dump_stores(self.stored, self.conversations.store)).encode())
            self._written = version
        except OSError as exc:
            log.error("could not write %s: %s", path, exc)
            return
        log.debug("wrote %d stored responses and %d conversations to %s", len(self.stored),
                  len(self.conversations.store), path)


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
        try:
            sock = listening_socket(opts.host, opts.http_port)
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


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, made with proto IPPROTO_TCP: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on connections whose socket says TCP, and those that
    socket.create_server's sockets accept say 0. With Nagle on, each response after a kept-alive
    connection's first (its body written after its headers), and each streamed chunk after the
    first, waited about 40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server: a restart rebinds
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


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


def _stays() -> None:
    """A background response's reader left: the response runs on (cancel it by id)."""


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown path, wrong method) in OpenAI's shape."""
    return ApiError(exc.status_code, str(exc.detail), param=None, code=None).response()
