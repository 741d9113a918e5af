"""OpenAI request bodies (pydantic) -> the neutral Request both front ends' requests become.

The HTTP API has no validation of its own beyond types: a body is parsed
here (types, unknown fields, OpenAI settings we cannot honour), turned into
a ssd.serve.request.Request, and checked by ssd.serve.validation.validate
(through the GenerationService), the very function gRPC requests go
through. Its field names (the gRPC API's) are mapped back to the body's (`max_new_tokens` -> `max_tokens`, `chat` ->
`messages`, `text` -> `prompt`), so an error always names what the client sent.

Non-OpenAI settings travel as extra body fields, as vLLM's do: the request
fields of ssd.fields OpenAI lacks (RequestFields), `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `allowed_token_ids`, `bad_words`, `ignore_eos`,
`skip_special_tokens`, `truncate_prompt_tokens`, chat's `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs` and `echo`, `speculation`
{mode, k, fanout_budget, fanout_kind, saguaro_c, backup}, and structured output
beside OpenAI's `response_format`: `structured_outputs` {json, regex, grammar,
choice} (vLLM's; `grammar` in llguidance's Lark dialect) or vLLM's older
`guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`.

Tools (chat): `tools` are rendered by the model's chat template; the model's
own tool-call format (Qwen2.5: `<tool_call>{"name", "arguments"}</tool_call>`,
ssd.openai.tools) is parsed back into `message.tool_calls`. "required" and a
named function constrain the output with a grammar, so the call is always
well-formed.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ssd.fields import FIELDS
from ssd.openai import tools as tooling
from ssd.serve.request import ChatMessage, ChatOptions, Request, Speculation as SpeculationFields, Structured
from ssd.serve.validation import MAX_LOGPROBS, InvalidArgument

MAX_TOP_LOGPROBS = MAX_LOGPROBS  # OpenAI's limit for chat top_logprobs
MAX_CHOICES = 128  # n and best_of (OpenAI's limit for n); each choice is a row, within --max-queue too
_TYPE_TAG = re.compile(r"[^a-z_]|^(str|int|float|bool|list|dict|none)$")  # pydantic's union-branch loc entries


# A name from a fixed set, checked by ssd.serve.validation. Over gRPC "" means unset (proto3's
# default string); over HTTP leaving the field out does, and "" is refused rather than read as unset.
Name = Annotated[str, Field(min_length=1)]


class Body(BaseModel):
    # strict: "0.5" is not a temperature and true is not a token count.
    model_config = ConfigDict(extra="forbid", strict=True)


# The request fields of ssd.fields as the bodies spell them (max_tokens has names of its own).
BODY_FIELDS = tuple(spec for spec in FIELDS if spec.name != "max_new_tokens")
RequestFields = create_model(
    "RequestFields", __base__=Body,
    **{spec.name: ((Name if spec.kind is str else spec.kind) | None, None) for spec in BODY_FIELDS},
)


class Speculation(Body):
    """Per-request speculation settings (an ssd extension; see ModelInfo for the limits)."""

    mode: Literal["ar", "sd", "ssd"] | None = None
    k: int | None = None
    fanout_budget: int | None = None
    fanout_kind: Name | None = None
    saguaro_c: float | None = None
    backup: Name | None = None


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # a BaseModel attribute's name otherwise
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class _Common(RequestFields):
    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's hints, taken and left alone: who asks (abuse checks there), and a key grouping
    # requests that share a prefix (cache routing there; here the prefix cache and the replicas'
    # routing already match prompts by their tokens).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Logits processing (ssd.engine.processing): part of the target's law, exact in every mode.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    # Extensions.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    min_tokens: int | None = None  # vLLM's
    stop_token_ids: list[int] | None = None  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens' logprobs, rank and alternatives
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    truncate_prompt_tokens: int | None = None  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    ignore_eos: bool = False
    priority: int = 0  # vLLM's: among queued requests a lower value is admitted sooner
    speculation: Speculation | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the number of alternatives per token (0: the chosen token's only)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class Prediction(Body):
    """OpenAI's predicted output: text much of the answer will repeat (a file a code edit rewrites)."""

    type: Literal["content"]
    content: str | list[TextPart]


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    # An assistant's earlier thinking, sent back (vLLM's `reasoning`, DeepSeek's `reasoning_content`).
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatLayout(Body):
    """vLLM's chat layout fields (ssd.serve.request.ChatOptions), on chat and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatBody(_Common, ChatLayout):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat fields (ssd.serve.request.ChatOptions; echo: the reply starts with the last
    # message's content when that is the assistant's, the prefill continue_final_message continues).
    echo: bool = False


class TokenizeBody(ChatLayout):
    """vLLM's /tokenize: a completion's prompt or a chat's messages (and tools)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[int]


def tokenize_request(body: TokenizeBody) -> Request:
    """The neutral Request whose prompt /tokenize reports (validation encodes it as for a generation)."""
    if (body.prompt is None) == (body.messages is None):
        raise InvalidArgument("prompt", "give prompt or messages")
    if body.prompt is not None:
        for name in _CHAT_OPTIONS.values():
            if name in body.model_fields_set:
                raise InvalidArgument(name, "applies to messages only")
        return Request(text=body.prompt)
    chat = ChatBody(model=body.model or "", messages=body.messages, tools=body.tools)
    return Request(chat=[_message(m, i) for i, m in enumerate(body.messages)], tools=tooling.rendered(chat),
                   chat_options=chat_options(body))


# ChatOptions' fields -> the body's.
_CHAT_OPTIONS = {"add_generation_prompt": "add_generation_prompt", "continue_final_message": "continue_final_message",
                 "template_kwargs": "chat_template_kwargs"}


def chat_options(body: ChatLayout) -> ChatOptions | None:
    """The body's chat layout fields; None where it sets none."""
    if not set(_CHAT_OPTIONS.values()) & body.model_fields_set:
        return None
    return ChatOptions(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)


MAX_METADATA = (16, 64, 512)  # OpenAI's metadata: pairs, key characters, value characters


def check_metadata(metadata: dict[str, str] | None, param: str = "metadata") -> dict[str, str]:
    """`metadata` (Responses, conversations) within OpenAI's limits, or InvalidArgument naming it."""
    pairs, key_chars, value_chars = MAX_METADATA
    metadata = metadata or {}
    if len(metadata) > pairs:
        raise InvalidArgument(param, f"at most {pairs} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > key_chars or len(value) > value_chars:
            raise InvalidArgument(f"{param}.{key[:key_chars]}", f"keys are at most {key_chars} characters "
                                  f"and values at most {value_chars}")
    return metadata


def parse(model: type[Body], data: Any) -> Any:
    """The body as `model`, or InvalidArgument naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = max(exc.errors(), key=lambda e: len(e["loc"]))  # the deepest: "stop[1]", not "stop"
        param = loc_param(error["loc"]) or "body"
        if error["type"] == "extra_forbidden":
            raise InvalidArgument(param, "unknown field; this server does not support it") from None
        raise InvalidArgument(param, error["msg"]) from None


def loc_param(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content', without pydantic's union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            out += f".{part}" if out else part
    return out


def refuse_unsupported(body: _Common) -> None:
    """OpenAI settings this server cannot honour exactly (or that contradict each other):
    refused by name, never ignored. Value ranges are ssd.serve.validation's."""
    if not isinstance(body, _Common):  # /tokenize, /detokenize: nothing to refuse
        return
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise InvalidArgument("n", f"must be in 1..{MAX_CHOICES}, got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise InvalidArgument("stream_options", "only allowed with stream: true")
    if isinstance(body, CompletionBody):
        _refuse_completion(body)
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidArgument("prompt_logprobs", "is not streamed (the prompt's log-probabilities come with the "
                              "result); send stream: false")
    for name, value in (logprobs_settings(body) | {"prompt_logprobs": body.prompt_logprobs}).items():
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(name, f"must be in 0..{MAX_TOP_LOGPROBS}, got {value}")
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        tooling.check(body)
    structured_fields = [name for name in _STRUCTURED if _structured_given(body, name)]
    if len(structured_fields) > 1:
        raise InvalidArgument(structured_fields[1], f"give one of {', '.join(structured_fields)}, not several")
    if structured_fields and tooling.constrained(body):
        raise InvalidArgument(structured_fields[0], "cannot be combined with tool_choice required or a named function")


def _refuse_completion(body: "CompletionBody") -> None:
    n = body.n or 1
    if body.best_of is not None:
        if not n <= body.best_of <= MAX_CHOICES:
            raise InvalidArgument("best_of", f"must be in n..{MAX_CHOICES} (n is {n}), got {body.best_of}")
        if body.stream and body.best_of > n:
            raise InvalidArgument("best_of", "cannot exceed n with stream: true (the best are known only at the end)")
    if body.echo and body.logprobs is not None and body.stream:
        raise InvalidArgument("echo", "with logprobs is not streamed (the prompt's log-probabilities come with "
                              "the result); send stream: false")
    if body.suffix is not None and body.echo:
        raise InvalidArgument("echo", "cannot be combined with suffix (the output is the middle)")
    if isinstance(body.prompt, list) and not body.prompt:
        raise InvalidArgument("prompt", "must not be empty")


_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
               "guided_choice")


def _structured_given(body: _Common, name: str) -> bool:
    value = getattr(body, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def structured(body: _Common) -> Structured | None:
    """The body's structured output (response_format, structured_outputs, guided_*, or the
    grammar that "required" / a named tool_choice implies), as validation compiles it."""
    if isinstance(body, ChatBody) and tooling.constrained(body):
        return Structured("lark", tooling.call_grammar(body), "tool_choice")
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        return Structured("json_object", None, "response_format")
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidArgument("response_format.json_schema.schema", "must be given for type json_schema")
        return Structured("json_schema", rf.json_schema.schema_, "response_format.json_schema.schema")
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar),
                                      ("choice", so.choice)) if v is not None]
        if len(given) != 1:
            raise InvalidArgument("structured_outputs", "give exactly one of json, regex, grammar, choice")
        return _structured_field(*given[0], f"structured_outputs.{given[0][0]}")
    for kind in ("json", "regex", "grammar", "choice"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            return _structured_field(kind, value, f"guided_{kind}")
    return None


def _structured_field(kind: str, value: Any, field: str) -> Structured:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(field, f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidArgument(field, "must be a JSON schema (an object)")
        return Structured("json_schema", value, field)
    if kind == "choice":
        if not value or any(not c for c in value):
            raise InvalidArgument(field, "must list at least one non-empty string")
        return Structured("lark", "start: " + " | ".join(json.dumps(c) for c in value), field)
    return Structured("regex" if kind == "regex" else "lark", value, field)


def _prediction_text(prediction: Prediction | None) -> str | None:
    if prediction is None:
        return None
    content = prediction.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def logit_bias(body: _Common) -> dict[int, float] | None:
    """OpenAI's logit_bias, its keys (token ids as JSON strings) as ints."""
    if body.logit_bias is None:
        return None
    out = {}
    for key, value in body.logit_bias.items():
        if not key.isdigit():
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key!r}")
        out[int(key)] = value
    return out


def logprobs_settings(body: _Common) -> dict[str, int | None]:
    """{the body's field: alternatives per token}; None: no logprobs."""
    if isinstance(body, CompletionBody):
        return {"logprobs": body.logprobs}
    if not body.logprobs:
        return {"top_logprobs": None}
    return {"top_logprobs": body.top_logprobs or 0}


def prompt_logprobs(body: _Common) -> int | None:
    """Alternatives per prompt token the request computes: vLLM's prompt_logprobs, or completions'
    echo with logprobs (the echoed prompt's tokens get theirs too); each view shows its own number."""
    wanted = [body.prompt_logprobs]
    if isinstance(body, CompletionBody) and body.echo:
        wanted.append(body.logprobs)
    wanted = [n for n in wanted if n is not None]
    return max(wanted) if wanted else None


def top_logprobs(body: _Common) -> int | None:
    return next(iter(logprobs_settings(body).values()))


def max_tokens_field(body: _Common) -> str:
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def prompts(body: _Common) -> list[str | list[int] | None]:
    """The body's prompts: chat has one (None: its messages); completions a string, ids, or a list of either."""
    if isinstance(body, ChatBody):
        return [None]
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def to_request(body: _Common, prompt: str | list[int] | None = None, choice: int = 0) -> Request:
    """The neutral Request for one choice of one prompt (default: the body's first)
    (validated afterwards by ssd.serve.validation)."""
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None and body.max_tokens is not None:
        raise InvalidArgument("max_tokens", "give max_tokens or max_completion_tokens, not both")
    request = Request(
        max_new_tokens=getattr(body, max_tokens_field(body)),
        **{spec.name: getattr(body, spec.name) for spec in BODY_FIELDS}, stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        ignore_eos=body.ignore_eos, logprobs=top_logprobs(body), choice=choice,
        logit_bias=logit_bias(body), min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids,
        include_stop_str_in_output=body.include_stop_str_in_output, allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words, skip_special_tokens=body.skip_special_tokens,
        truncate_prompt_tokens=body.truncate_prompt_tokens, prompt_logprobs=prompt_logprobs(body),
        prediction=_prediction_text(body.prediction),
        structured=structured(body), priority=body.priority,
    )
    if isinstance(body, ChatBody):
        request.chat = [_message(m, i) for i, m in enumerate(body.messages)]
        request.tools = tooling.rendered(body)
        request.chat_options = chat_options(body)
    else:
        request.suffix = body.suffix
        prompt = prompts(body)[0] if prompt is None else prompt
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids = list(prompt)
    given = body.speculation
    if given is not None:
        request.mode = given.mode
        request.speculation = SpeculationFields(
            k=given.k, fanout_budget=given.fanout_budget, fanout_kind=given.fanout_kind or "",
            saguaro_c=given.saguaro_c, backup=given.backup or "",
        )
    return request


def _message(message: Message, i: int) -> ChatMessage:
    calls = tooling.message_calls(message, i)
    if message.reasoning is not None and message.reasoning_content is not None:
        raise InvalidArgument(f"messages[{i}].reasoning_content", "give reasoning or reasoning_content, not both")
    thought = message.reasoning if message.reasoning is not None else message.reasoning_content
    return ChatMessage(message.role, message_content(message, i, allow_none=bool(calls)), tool_calls=calls,
                       tool_call_id=message.tool_call_id, name=message.name, reasoning_content=thought)


def message_content(message: Message, i: int, allow_none: bool = False) -> str:
    if message.content is None:
        if allow_none:  # an assistant's turn that only called tools
            return ""
        raise InvalidArgument(f"messages[{i}].content", "must be given")
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def body_param(field: str, body: _Common, prompt_index: int | None = None) -> str:
    """A validation error's field (the proto's name) as the client named it
    (`prompt_index`: which of a list of prompts the request held)."""
    head, dot, rest = field.partition(".")
    if head in ("text", "token_ids", "prompt"):
        if isinstance(body, ChatBody):
            return "messages"
        return "prompt" if prompt_index is None else f"prompt[{prompt_index}]"
    if head == "chat":
        option, _, key = rest.partition(".")
        if option in _CHAT_OPTIONS:
            return _CHAT_OPTIONS[option] + (f".{key}" if key else "")
        return "messages" + (rest.removeprefix("messages") if rest else "")
    if head == "max_new_tokens":
        return max_tokens_field(body)
    if head == "mode":
        return "speculation.mode"
    if head.startswith("stop[") and isinstance(body.stop, str):
        return "stop"
    return field
