"""The OpenAI-compatible HTTP API over the GenerationService the gRPC front end shares.

    POST /v1/completions        POST /v1/chat/completions   (SSE with "stream": true)
    POST /v1/responses          (OpenAI's Responses API, as a chat: ssd.openai.responses)
    GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items   (stored: ssd.openai.stored)
    POST /v1/responses/{id}/cancel                                      (a background response)
    /v1/conversations, /v1/conversations/{id}/items                     (the Conversations API)
    /v1/files, /v1/batches      (OpenAI's Files and Batch APIs)
    GET  /v1/models             GET  /v1/models/{id}        POST /tokenize    POST /detokenize
    GET  /health (and /ping)    GET  /metrics               GET  /version     GET  /load

One router per API (ssd.openai.routes), each with its store, over one gate
(ssd.openai.common.Api: the token, the body, the served model). This is a thin
adapter: JSON -> the neutral Request (ssd.openai.schema.to_request), the
service's answers -> OpenAI objects (ssd.openai.calls), its errors -> HTTP
statuses. One admission path, one validation and one worker, so HTTP and gRPC
requests run in the same batch. No protobuf here.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}:
400 invalid_request_error naming the field, 401, 404 (unknown model or
path), 413 (body over --max-message-bytes), 429 (queue full), 503 (loading,
restarting, shutting down; a request aborted by shutdown). A failure after a
stream began ends it with OpenAI's error event (`data: {"error": {...}}`);
finish_reason only takes OpenAI's values (stop, length, tool_calls). /health
and /metrics stay open without the token (as grpc.health.v1 and the metrics
port do); /v1 needs `Authorization: Bearer`.

Speculation statistics ride in `speculation_stats` (the gRPC RequestStats as
JSON, the same fields) on each response and on the stream's last chunk. `logprobs` are the
target's, from the logits verification already scored (ssd.sampling.token_logprobs).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.openai.common import Api, ApiError, http_error
from ssd.openai.routes.batches import GAUGES as BATCHES_GAUGES
from ssd.openai.routes.batches import BatchRoutes
from ssd.openai.routes.completions import CompletionsRoutes
from ssd.openai.routes.conversations import ConversationRoutes
from ssd.openai.routes.health import HealthRoutes
from ssd.openai.routes.models import ModelsRoutes
from ssd.openai.routes.responses import GAUGES as RESPONSES_GAUGES
from ssd.openai.routes.responses import ResponsesRoutes
from ssd.openai.store_file import StoreFile
from ssd.serve.metrics import GaugesCollector
from ssd.serve.service import GenerationService


class Router(Protocol):
    """One API's routes (ssd.openai.routes)."""

    def add_to(self, app: FastAPI) -> None:
        """Add the routes to `app`."""


class OpenAIFrontend:
    """The routers over one service, their stores' file, their gauges, and the app."""

    def __init__(self, service: GenerationService, options: Any) -> None:
        self.api = Api(service, options)
        self.health = HealthRoutes(service)
        self.models = ModelsRoutes(self.api)
        self.completions = CompletionsRoutes(self.api)
        self.conversations = ConversationRoutes(options.stored_conversations, self.api.authorize, self.api.body)
        self.responses = ResponsesRoutes(self.api, self.conversations)
        self.batches = BatchRoutes(options, self.api.authorize, self.api.body, self.api.rows)
        self.store_file = StoreFile(options.store_dir, self.responses.stored, self.conversations.store)
        self.store_file.start()
        service.registry.register(GaugesCollector(RESPONSES_GAUGES, self.responses.gauges))
        service.registry.register(GaugesCollector(BATCHES_GAUGES, self.batches.counts))
        self.app = create_app(self.health, self.models, self.completions, self.responses, self.conversations,
                              self.batches)

    def close(self) -> None:
        """Stop the batches' loop and the handlers' pool, then write the stores a last time."""
        self.batches.close()
        self.api.close()
        self.store_file.close()


def create_app(*routers: Router) -> FastAPI:
    """A FastAPI app with each router's routes (`add_to`), errors in OpenAI's shape."""
    # No schema, docs or redoc routes: they would answer without the API key (every route's shapes
    # to anyone); docs/serving.md lists the routes.
    app = FastAPI(title="ssd OpenAI-compatible API", description=__doc__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(StarletteHTTPException, http_error)
    for router in routers:
        router.add_to(app)
    return app
