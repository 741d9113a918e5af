"""OpenAI's Responses API, with stored and background responses.

    POST   /v1/responses                         (as a chat: ssd.openai.responses)
    GET    /v1/responses/{id}                    a stored response; ?stream=true: a background one's events
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items
    POST   /v1/responses/{id}/cancel             a background response

This router owns the response store (ssd.openai.stored: the last
serve.stored_responses, least recently used out first) and the background
responses while they run (`running`) and shortly after (`ended_streams`, for
late readers). A response that names a conversation reads and extends the
Conversations router's store.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ssd.openai import responses, schema
from ssd.openai.calls import Choice, JobStream, ResponsesCall
from ssd.openai.common import Api, ApiError, batch_line, invalid, listed, unavailable
from ssd.openai.routes.completions import submit_all
from ssd.openai.routes.conversations import ConversationRoutes
from ssd.openai.stored import Conversation, ResponseStore, StoredResponse
from ssd.serve.service import InvalidArgument, NotServing

ENDED_STREAMS = 16  # background responses whose events stay readable after they end (late readers)
GAUGES = (
    ("ssd:responses_stored", "Responses API responses stored (--stored-responses)."),
    ("ssd:responses_background_running", "Background responses queued or running."),
    ("ssd:conversations_stored", "Conversations kept (--stored-conversations)."),
)


class ResponsesRoutes:
    """The routes, over the response store and the background runs."""

    def __init__(self, api: Api, conversations: ConversationRoutes) -> None:
        self.api = api
        self.conversations = conversations
        self.stored = ResponseStore(api.options.stored_responses)
        self.running: dict[str, ResponsesCall] = {}  # background responses by id, until they end
        self.ended_streams: OrderedDict[str, ResponsesCall] = OrderedDict()  # the last few, for late readers

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])

    def gauges(self) -> tuple[int, int, int]:
        """GAUGES' values, for /metrics."""
        return len(self.stored), len(self.running), len(self.conversations.store)

    # --- the Keeper a ResponsesCall stores through (ssd.openai.calls) ---------------------

    def conversation(self, conversation_id: str) -> Conversation | None:
        return self.conversations.store.get(conversation_id)

    def background_ended(self, call: ResponsesCall) -> None:
        """A background response's run ended: no longer cancellable; its events stay readable
        for the last ENDED_STREAMS of them."""
        self.running.pop(call.id, None)
        if call.deleted:
            return
        self.ended_streams[call.id] = call
        while len(self.ended_streams) > ENDED_STREAMS:
            self.ended_streams.popitem(last=False)

    # --- POST /v1/responses ------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        """OpenAI's Responses API, as the chat completion it means (ssd.openai.responses)."""
        api = self.api
        api.authorize(request)
        body = await api.body(request, responses.ResponsesBody)
        api.check_model(body.model)
        earlier = self._continued(body)
        chat, choices = self._submitted(body, earlier, batch_line(request))
        call = ResponsesCall(api, self, chat, choices, body, earlier)
        if body.background:
            queued = self._start_background(call)
            return JobStream(call.replay(), on_close=_stays) if body.stream else JSONResponse(queued)
        if body.stream:
            return JobStream(call.events(), on_close=call.cancel)
        try:
            return await call.complete(request)
        finally:
            call.cancel()

    def _submitted(self, body: responses.ResponsesBody, earlier: list[dict[str, Any]],
                   background: bool) -> tuple[Any, list[Choice]]:
        """The chat the body means, admitted; an error names the Responses field, not the chat's."""
        origins: list[str] = []
        try:
            chat, origins = (self._fitted(body, earlier) if body.truncation == "auto"
                             else responses.to_chat(body, earlier))
            cap = self.api.options.max_chat_messages
            if len(chat.messages) > cap:  # named here: validation would name the chat's `messages`
                raise InvalidArgument(responses.whole_chat_field(origins), f"at most {cap} messages, got "
                                      f"{len(chat.messages)}" + ("" if body.truncation == "auto" else
                                                                 '; truncation "auto" drops the oldest turns to fit'))
            schema.refuse_unsupported(chat)
            return chat, submit_all(self.api, chat, background)
        except InvalidArgument as exc:
            raise invalid(exc, responses.chat_param(exc.field, origins)) from None
        except ApiError as exc:
            if exc.param is None or exc.status != 400:
                raise
            renamed = responses.chat_param(exc.param, origins)
            raise invalid(InvalidArgument(renamed, exc.message.split(": ", 1)[-1])) from None

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
        limit = self.api.model_info().limits.max_context_tokens
        room = body.max_output_tokens or 1
        drops = [0, *responses.turn_starts(body, earlier)]
        for drop in drops[:-1]:
            chat, origins = responses.to_chat(body, earlier, drop)
            if len(chat.messages) > self.api.options.max_chat_messages:
                continue  # validation would refuse it whatever its length in tokens
            try:
                prompt = self.api.service.tokenize(schema.to_request(chat))
            except NotServing as exc:
                raise unavailable(exc) from None
            if len(prompt) + room <= limit:
                return chat, origins
        return responses.to_chat(body, earlier, drops[-1])

    def _start_background(self, call: ResponsesCall) -> dict[str, Any]:
        """Store the response as queued, run it on the event loop, answer with it now."""
        queued = call.snapshot("queued")
        call.save(queued)
        self.running[call.id] = call  # and so its task, which leaves it as the response ends
        call.task = asyncio.get_running_loop().create_task(call.run_in_background())
        return queued

    # --- stored responses --------------------------------------------------------------

    def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        found = self.stored.get(response_id)
        if found is None:
            raise ApiError(404, f"{param + ': ' if param else ''}no stored response {response_id!r} (never "
                           f"stored, deleted, or evicted: the server keeps the last {self.stored.capacity})",
                           param=param, code="previous_response_not_found" if param else "response_not_found")
        return found

    async def retrieve(self, request: Request, response_id: str) -> Response:
        """OpenAI's response retrieval: a stored response as its request returned it; with
        `stream=true`, a background response's events after `starting_after` (a sequence
        number), while it runs or soon after."""
        self.api.authorize(request)
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

    async def cancel(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's cancel: a queued or running background response stops and is stored as
        cancelled (again: the same answer); any other is 400."""
        self.api.authorize(request)
        call = self.running.get(response_id)
        if call is not None and not call.ended:
            return JSONResponse(call.cancel_in_background())
        found = self._stored(response_id).response
        if found.get("background") and found["status"] == "cancelled":
            return JSONResponse(found)
        why = "ended" if found.get("background") else "not a background response"
        raise ApiError(400, f"response {response_id!r} is {found['status']} ({why}): only a queued or running "
                       f"background response can be cancelled", code="response_not_cancellable")

    async def delete(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's delete: the stored response, and its events; a background response that
        runs stops (else its run would store it again as it goes)."""
        self.api.authorize(request)
        call = self.running.get(response_id)
        if call is not None and not call.ended:
            call.delete_in_background()
        self.ended_streams.pop(response_id, None)
        if not self.stored.delete(response_id):
            self._stored(response_id)  # the 404
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request, response_id: str) -> JSONResponse:
        """OpenAI's input item list: a stored response's own input items, `order` (default desc),
        `limit` (1-100, default 20) and the cursor `after`."""
        self.api.authorize(request)
        return listed(self._stored(response_id).input_items, request, f"response {response_id!r}")


def _stays() -> None:
    """A background response's reader left: the response runs on (cancel it by id)."""
