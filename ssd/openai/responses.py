"""OpenAI's Responses API (POST /v1/responses) as a chat completion underneath.

A Responses body becomes the ChatBody it means (ssd.openai.schema), so it
takes the one validation, admission and batch every other request takes, and
its output is the chat output laid out as Responses items:

    instructions                       -> a system message first
    input: a string                    -> one user message
    input: items                       -> messages (developer -> system), function_call
                                          items -> an assistant's tool_calls,
                                          function_call_output -> a tool message
    max_output_tokens                  -> max_completion_tokens
    text.format                        -> response_format (json_object, json_schema)
    tools [{type: function, name, ...}] -> tools [{type: function, function: {...}}]
    tool_choice {type: function, name} -> tool_choice {type: function, function: {name}}
    top_logprobs + include ["message.output_text.logprobs"] -> logprobs, top_logprobs

A response is stored unless `store` is false (OpenAI's default), and one
that names it as `previous_response_id` continues its conversation
(ssd.openai.stored); one that names a `conversation` (the Conversations API,
ssd.openai.routes.conversations) starts from its items and adds its own input
and output to it once it finishes. Items that came from either are named
`previous_response_id` or `conversation` in errors. An error a chat field
caused names the Responses field (`chat_param`). `background` answers at
once with the stored response queued; it is polled by id and can be
cancelled. Not offered, and refused by name: reasoning, and tools other than
functions. The request fields of ssd.fields and vLLM's extra fields ride along
as they do on chat: speculation, structured_outputs, priority.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from ssd.openai import schema
from ssd.openai.schema import Body
from ssd.serve.validation import InvalidArgument

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ContentPart(Body):
    """input_text, or output_text as an earlier response's output carries it (sent back as input)."""

    type: Literal["input_text", "output_text", "reasoning_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(Body):
    """A message, a function call the model made, its output, or the model's thinking before a message
    or call (the fields each type needs are checked)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class ConversationRef(Body):
    id: str


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(schema.JsonSchemaFormat):
    """Responses' text.format: chat's json_schema fields, flat beside the type."""

    type: Literal["text", "json_object", "json_schema"]


class TextOptions(Body):
    format: TextFormat | None = None


class ResponsesBody(schema.RequestFields):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool | None = False
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # None: OpenAI's default, stored
    background: bool | None = None  # answer at once (queued); poll GET /v1/responses/{id}
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None  # starts from its items; its input and output join it
    truncation: Literal["disabled", "auto"] | None = None  # auto: drop the oldest turns to fit (`turn_starts`)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's hints, as on chat (ssd.openai.schema)
    prompt_cache_key: str | None = None
    # vLLM's extra fields, as on chat (the request fields come with schema.RequestFields).
    speculation: schema.Speculation | None = None
    structured_outputs: schema.StructuredOutputs | None = None
    priority: int = 0


def to_chat(body: ResponsesBody, earlier: list[dict[str, Any]] | None = None, drop: int = 0
            ) -> tuple[schema.ChatBody, list[str]]:
    """The ChatBody the request means, and for each of its messages the Responses field it came from.
    `earlier`: the conversation of the response it continues (ssd.openai.stored), as items; `drop`:
    how many of the conversation's first items (earlier, then input) to leave out."""
    schema.check_metadata(body.metadata)
    for name in body.include or []:
        if name != LOGPROBS_INCLUDE:
            raise InvalidArgument("include", f"only {LOGPROBS_INCLUDE!r} is offered, got {name!r}")
    messages, origins = _messages(body, earlier or [], drop)
    logprobs = LOGPROBS_INCLUDE in (body.include or [])
    if body.top_logprobs is not None and not logprobs:
        raise InvalidArgument("top_logprobs", f"needs include: [{LOGPROBS_INCLUDE!r}]")
    extras = {name: getattr(body, name) for name in (*(spec.name for spec in schema.BODY_FIELDS), "speculation",
                                                     "structured_outputs", "priority")}
    chat = schema.ChatBody(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens, stream=body.stream,
        logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
        response_format=_response_format(body.text), tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, **extras,
    )
    return chat, origins


def turn_starts(body: ResponsesBody, earlier: list[dict[str, Any]]) -> list[int]:
    """Where the conversation's later user turns start (indices into earlier + input items): the
    `drop`s truncation "auto" may take, oldest turns first. A cut there never parts a function
    call from its output, nor a reasoning item from its message."""
    items, _ = _items(body, earlier)
    return [i for i, item in enumerate(items) if i > 0 and item.type == "message" and item.role == "user"]


def _items(body: ResponsesBody, earlier: list[dict[str, Any]]) -> tuple[list[InputItem], list[str]]:
    """The conversation's items, earlier then input, and the field each came from."""
    own = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not own:
        raise InvalidArgument("input", "must not be empty")
    places = ["input"] if isinstance(body.input, str) else [f"input[{i}]" for i in range(len(own))]
    source = "conversation" if body.conversation is not None else "previous_response_id"
    return [InputItem.model_validate(item) for item in earlier] + own, [source] * len(earlier) + places


def _messages(body: ResponsesBody, earlier: list[dict[str, Any]], drop: int = 0
              ) -> tuple[list[schema.Message], list[str]]:
    messages: list[schema.Message] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append(schema.Message(role="system", content=body.instructions))
        origins.append("instructions")
    items, places = _items(body, earlier)
    items, places = items[drop:], places[drop:]
    thought: tuple[str, str] | None = None  # a reasoning item's text, for the assistant turn after it
    for item, where in zip(items, places):
        if item.type == "reasoning":
            thought = (where, "".join(part.text for part in item.content or [] if not isinstance(item.content, str)))
            continue
        if item.type == "function_call":
            call = schema.ToolCall(id=_given(item.call_id, f"{where}.call_id"), function=schema.FunctionCall(
                name=_given(item.name, f"{where}.name"), arguments=_given(item.arguments, f"{where}.arguments")))
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls is not None and not thought:
                messages[-1].tool_calls.append(call)  # a turn's calls, one assistant message
                continue
            messages.append(schema.Message(role="assistant", content=None, tool_calls=[call]))
        elif item.type == "function_call_output":
            messages.append(schema.Message(role="tool", tool_call_id=_given(item.call_id, f"{where}.call_id"),
                                           content=_given(item.output, f"{where}.output")))
        else:
            role = _given(item.role, f"{where}.role")
            content = _given(item.content, f"{where}.content")
            text = content if isinstance(content, str) else "".join(part.text for part in content)
            messages.append(schema.Message(role="system" if role == "developer" else role, content=text))
        if thought is not None:
            if messages[-1].role != "assistant":
                raise InvalidArgument(thought[0], "a reasoning item must come just before the assistant message "
                                      "or function call it belongs to")
            messages[-1].reasoning_content, thought = thought[1], None
        origins.append(where)
    if thought is not None:
        raise InvalidArgument(thought[0], "a reasoning item must come just before the assistant message "
                              "or function call it belongs to")
    return messages, origins


def _given(value: Any, field: str) -> Any:
    if value is None:
        raise InvalidArgument(field, "must be given for this item type")
    return value


def _response_format(text: TextOptions | None) -> schema.ResponseFormat | None:
    if text is None or text.format is None:
        return None
    given = text.format
    if given.type != "json_schema":
        return schema.ResponseFormat(type=given.type)
    return schema.ResponseFormat(type="json_schema", json_schema=schema.JsonSchemaFormat.model_validate(
        given.model_dump(exclude={"type"}, by_alias=True)))


def _tools(tools: list[FunctionTool] | None) -> list[schema.Tool] | None:
    if tools is None:
        return None
    return [schema.Tool(type="function", function=schema.FunctionDef(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in tools]


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return schema.NamedToolChoice(type="function", function=schema.NamedFunction(name=choice.name))


# --- errors: chat's field names -> the Responses body's ----------------------------------------

_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_RENAMED = (
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)


def whole_chat_field(origins: list[str]) -> str:
    """The Responses field that holds most of the chat: the conversation or chain it continues, else input."""
    return next((o for o in ("conversation", "previous_response_id") if o in origins), "input")


def chat_param(param: str | None, origins: list[str]) -> str | None:
    """A chat field named in an error, as the Responses body names it."""
    if param is None:
        return None
    if param == "messages":
        return "input"
    found = _MESSAGE.match(param)
    if found:
        origin = origins[int(found.group(1))] if int(found.group(1)) < len(origins) else "input"
        rest = found.group(2)
        if rest.startswith(".tool_calls"):  # a function_call item's fields
            rest = re.sub(r"^\.tool_calls\[\d+\](\.function)?", "", rest)
        return origin + ("" if origin == "instructions" else rest.replace(".tool_call_id", ".call_id"))
    for pattern, replacement in _RENAMED:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


# --- the output ----------------------------------------------------------------------------------


def conversation_id(body: ResponsesBody) -> str | None:
    """The id of the conversation the request names (as its id, or {"id": ...})."""
    given = body.conversation
    return given.id if isinstance(given, ConversationRef) else given


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (ssd.openai.reasoning) as a reasoning item."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as a function_call item."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def response_object(body: ResponsesBody, response_id: str, created: float, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    incomplete: str | None = None, error: dict[str, Any] | None = None,
                    stored: bool = False) -> dict[str, Any]:
    """The Response object, as created (status in_progress, no output) or finished."""
    tool_choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "model": body.model, "output": output, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []],
        "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                            if body.text is not None and body.text.format is not None else {"type": "text"})},
        "background": bool(body.background), "store": stored, "truncation": body.truncation or "disabled",
        "metadata": body.metadata or {}, "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "previous_response_id": body.previous_response_id, "reasoning": None, "error": error,
        "conversation": None if body.conversation is None else {"id": conversation_id(body)},
        "incomplete_details": None if incomplete is None else {"reason": incomplete}, "usage": usage,
    }


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def now() -> float:
    return float(int(time.time()))
