"""The served model, and vLLM's tokenizer routes.

    GET  /v1/models             GET  /v1/models/{id}        (OpenAI's; 404 for any other id)
    POST /tokenize              POST /detokenize            (vLLM's)

A model's card carries OpenAI's fields, the draft and the modes, and what an
omitted sampling field gets. No store.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ssd.openai import schema
from ssd.openai.common import Api, invalid, unavailable
from ssd.serve.service import InvalidArgument, NotServing


class ModelsRoutes:
    """The model list and card, /tokenize and /detokenize."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.created = int(time.time())  # a card's `created`: when this server started

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def models(self, request: Request) -> JSONResponse:
        self.api.authorize(request)
        return JSONResponse({"object": "list", "data": [self._card(name) for name in self.api.served()]})

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """OpenAI's model retrieval: the served model's card, 404 for any other id."""
        self.api.authorize(request)
        self.api.check_model(model_id)
        return JSONResponse(self._card(model_id))

    def _card(self, name: str) -> dict[str, Any]:
        """The model's card: OpenAI's fields, the draft and modes, and what an omitted field gets."""
        info = self.api.model_info()
        d = info.defaults
        try:
            up_to_context = self.api.service.info().defaults.serve_defaults.max_new_tokens is None
        except NotServing as exc:
            raise unavailable(exc) from None
        # seed None: a fresh random seed per request; coupling "auto": gumbel for a seeded request,
        # standard without; max_tokens None: up to the context (max_model_len minus the prompt),
        # within max_tokens_limit.
        defaults = d.sampling | {"seed": None if d.random_seed else d.sampling["seed"],
                                 "max_tokens": None if up_to_context else d.max_new_tokens}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ssd", "root": info.target_model,
                "draft_model": info.draft_model, "modes": list(info.modes),
                "max_model_len": info.limits.max_context_tokens, "max_tokens_limit": info.limits.max_new_tokens,
                "defaults": defaults}

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: the prompt's ids as a generation takes them (chat: rendered)."""
        self.api.authorize(request)
        body = await self.api.body(request, schema.TokenizeBody)
        self.api.check_model(body.model)
        try:
            ids = self.api.service.tokenize(schema.tokenize_request(body))
        except InvalidArgument as exc:
            raise invalid(exc, schema.body_param(exc.field, body)) from None
        except NotServing as exc:
            raise unavailable(exc) from None
        limits = self.api.model_info().limits
        return JSONResponse({"count": len(ids), "max_model_len": limits.max_context_tokens, "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids."""
        self.api.authorize(request)
        body = await self.api.body(request, schema.DetokenizeBody)
        self.api.check_model(body.model)
        try:
            return JSONResponse({"prompt": self.api.service.detokenize(body.tokens)})
        except InvalidArgument as exc:
            raise invalid(exc) from None
        except NotServing as exc:
            raise unavailable(exc) from None
