"""OpenAI's Conversations API.

    POST   /v1/conversations                        create (items, metadata)
    GET    /v1/conversations/{id}                   retrieve
    POST   /v1/conversations/{id}                   update its metadata
    DELETE /v1/conversations/{id}                   delete
    GET    /v1/conversations/{id}/items             list (order, limit, after)
    POST   /v1/conversations/{id}/items             add items
    GET    /v1/conversations/{id}/items/{item_id}   retrieve an item
    DELETE /v1/conversations/{id}/items/{item_id}   delete an item

A Responses request that names a conversation (`conversation`: its id, or
{"id": ...}) starts from its items, and its input and output items join it once
it finishes (ssd.openai.stored.Conversation). Conversations live in memory,
`serve.stored_conversations` of them at most, least recently used out first,
and over a restart with `serve.store_dir` (--store-dir).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from ssd.openai import responses
from ssd.openai.common import ApiError, invalid, listed
from ssd.openai.schema import Body, check_metadata
from ssd.openai.stored import Conversation, Kept, input_items, page
from ssd.serve.service import InvalidArgument

MAX_ITEMS = 20  # OpenAI's: items a create or an add may carry


class ConversationBody(Body):
    items: list[responses.InputItem] | None = Field(default=None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None


class MetadataBody(Body):
    metadata: dict[str, str]


class ItemsBody(Body):
    items: list[responses.InputItem] = Field(min_length=1, max_length=MAX_ITEMS)


class ConversationRoutes:
    """The routes, over one store; `authorize` and `parse` are the gate's (ssd.openai.common.Api)."""

    def __init__(self, capacity: int, authorize: Callable[[Request], None], parse: Callable[..., Any]) -> None:
        self.store: Kept[Conversation] = Kept(capacity)
        self.authorize, self.parse = authorize, parse

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/conversations", self.create, methods=["POST"])
        app.add_api_route("/v1/conversations/{conversation_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/conversations/{conversation_id}", self.update, methods=["POST"])
        app.add_api_route("/v1/conversations/{conversation_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/conversations/{conversation_id}/items", self.list_items, methods=["GET"])
        app.add_api_route("/v1/conversations/{conversation_id}/items", self.add_items, methods=["POST"])
        app.add_api_route("/v1/conversations/{conversation_id}/items/{item_id}", self.item, methods=["GET"])
        app.add_api_route("/v1/conversations/{conversation_id}/items/{item_id}", self.delete_item,
                          methods=["DELETE"])

    def find(self, conversation_id: str, param: str | None = None) -> Conversation:
        """The conversation, or a 404 (naming `param` where a request's field named it)."""
        found = self.store.get(conversation_id)
        if found is None:
            where = f"{param}: " if param else ""
            raise ApiError(404, f"{where}no conversation {conversation_id!r} (never created, deleted, or evicted: "
                           f"the server keeps the last {self.store.capacity})", param=param,
                           code="conversation_not_found")
        return found

    async def create(self, request: Request) -> JSONResponse:
        self.authorize(request)
        if self.store.capacity == 0:
            raise ApiError(400, "this server keeps no conversations (--stored-conversations 0)",
                           code="conversations_off")
        body = await self.parse(request, ConversationBody)
        conversation = Conversation(responses.new_id("conv"), int(responses.now()),
                                    _checked(body.metadata), _items(body.items or []))
        self.store.keep(conversation.id, conversation)
        return JSONResponse(conversation.public())

    async def retrieve(self, request: Request, conversation_id: str) -> JSONResponse:
        self.authorize(request)
        return JSONResponse(self.find(conversation_id).public())

    async def update(self, request: Request, conversation_id: str) -> JSONResponse:
        self.authorize(request)
        conversation = self.find(conversation_id)
        conversation.set_metadata(_checked((await self.parse(request, MetadataBody)).metadata))
        return JSONResponse(conversation.public())

    async def delete(self, request: Request, conversation_id: str) -> JSONResponse:
        self.authorize(request)
        if not self.store.delete(conversation_id):
            self.find(conversation_id)  # the 404
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Request, conversation_id: str) -> JSONResponse:
        self.authorize(request)
        conversation = self.find(conversation_id)
        return listed(conversation.snapshot(), request, f"conversation {conversation_id!r}")

    async def add_items(self, request: Request, conversation_id: str) -> JSONResponse:
        self.authorize(request)
        conversation = self.find(conversation_id)
        added = _items((await self.parse(request, ItemsBody)).items)
        conversation.add(added)
        return JSONResponse(page(added, "asc", len(added)))

    async def item(self, request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        self.authorize(request)
        found = self.find(conversation_id).item(item_id)
        if found is None:
            raise ApiError(404, f"no item {item_id!r} in conversation {conversation_id!r}", code="item_not_found")
        return JSONResponse(found)

    async def delete_item(self, request: Request, conversation_id: str, item_id: str) -> JSONResponse:
        self.authorize(request)
        conversation = self.find(conversation_id)
        if not conversation.remove(item_id):
            raise ApiError(404, f"no item {item_id!r} in conversation {conversation_id!r}", code="item_not_found")
        return JSONResponse(conversation.public())


def _checked(metadata: dict[str, str] | None) -> dict[str, str]:
    try:
        return check_metadata(metadata)
    except InvalidArgument as exc:
        raise invalid(exc) from None


def _items(given: list[responses.InputItem]) -> list[dict[str, Any]]:
    """Items as a conversation lists them: each with an id and a type, a message's content as parts."""
    return input_items([item.model_dump(exclude_none=True) for item in given])
