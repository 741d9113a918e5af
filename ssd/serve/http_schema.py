"""OpenAI request bodies (pydantic) -> the neutral Request both front ends' requests become.

The HTTP API has no validation of its own beyond types: a body is parsed
here (types, unknown fields, OpenAI settings we cannot honour), turned into
a ssd.serve.request.Request, and checked by ssd.serve.validation.validate
(through the GenerationService), the very function gRPC requests go
through. Its field names (the gRPC API's) are mapped back to the body's (`max_new_tokens` -> `max_tokens`, `chat` ->
`messages`, `text` -> `prompt`), so an error always names what the client sent.

Non-OpenAI settings travel as extra body fields, as vLLM's do: `top_k`,
`ignore_eos`, `coupling` (standard | gumbel: sampling.coupling), and `speculation` {mode, k, fanout_budget, fanout_kind,
saguaro_c, backup}.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ssd.serve.request import ChatMessage, Request, Speculation as SpeculationFields
from ssd.serve.validation import InvalidArgument

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
_TYPE_TAG = re.compile(r"[^a-z_]|^(str|int|float|bool|list|dict|none)$")  # pydantic's union-branch loc entries


class _Body(BaseModel):
    # strict: "0.5" is not a temperature and true is not a token count.
    model_config = ConfigDict(extra="forbid", strict=True)


class Speculation(_Body):
    """Per-request speculation settings (an ssd extension; see ModelInfo for the limits)."""

    mode: Literal["ar", "sd", "ssd"] | None = None
    k: int | None = None
    fanout_budget: int | None = None
    fanout_kind: str | None = None
    saguaro_c: float | None = None
    backup: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at their neutral values: anything else would change the
    # distribution in a way the engines do not implement.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions.
    top_k: int | None = None
    coupling: str | None = None  # standard | gumbel, checked by ssd.serve.validation
    ignore_eos: bool = False
    speculation: Speculation | None = None


class CompletionBody(_Common):
    prompt: str | list[int]
    logprobs: int | None = None  # the number of alternatives per token (0: the chosen token's only)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


def parse(model: type[_Body], data: Any) -> Any:
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
    """OpenAI settings this server cannot honour exactly: refused by name, never ignored."""
    if body.n not in (None, 1):
        raise InvalidArgument("n", f"only 1 choice per request is supported, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise InvalidArgument(name, "not supported (the engines sample the model's own distribution); leave it 0")
    if body.stream_options is not None and not body.stream:
        raise InvalidArgument("stream_options", "only allowed with stream: true")
    if isinstance(body, CompletionBody):
        if body.echo:
            raise InvalidArgument("echo", "not supported")
        if body.best_of not in (None, 1):
            raise InvalidArgument("best_of", f"only 1 is supported, got {body.best_of}")
        if body.suffix:
            raise InvalidArgument("suffix", "not supported")
    for name, value in logprobs_settings(body).items():
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(name, f"must be in 0..{MAX_TOP_LOGPROBS}, got {value}")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")


def logprobs_settings(body: _Common) -> dict[str, int | None]:
    """{the body's field: alternatives per token}; None: no logprobs."""
    if isinstance(body, CompletionBody):
        return {"logprobs": body.logprobs}
    if not body.logprobs:
        return {"top_logprobs": None}
    return {"top_logprobs": body.top_logprobs or 0}


def top_logprobs(body: _Common) -> int | None:
    return next(iter(logprobs_settings(body).values()))


def max_tokens_field(body: _Common) -> str:
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def to_request(body: _Common) -> Request:
    """The neutral Request this body asks for (validated afterwards by ssd.serve.validation)."""
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None and body.max_tokens is not None:
        raise InvalidArgument("max_tokens", "give max_tokens or max_completion_tokens, not both")
    request = Request(
        max_new_tokens=getattr(body, max_tokens_field(body)),
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
        coupling=body.coupling, stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        ignore_eos=body.ignore_eos, logprobs=top_logprobs(body),
    )
    if isinstance(body, ChatBody):
        request.chat = [ChatMessage(m.role, _content(m, i)) for i, m in enumerate(body.messages)]
    elif isinstance(body.prompt, str):
        request.text = body.prompt
    else:
        request.token_ids = list(body.prompt)
    given = body.speculation
    if given is not None:
        request.mode = given.mode
        request.speculation = SpeculationFields(
            k=given.k, fanout_budget=given.fanout_budget, fanout_kind=given.fanout_kind or "",
            saguaro_c=given.saguaro_c, backup=given.backup or "",
        )
    return request


def _content(message: Message, i: int) -> str:
    if message.content is None:
        raise InvalidArgument(f"messages[{i}].content", "must be given")
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def body_param(field: str, body: _Common) -> str:
    """A validation error's field (the proto's name) as the client named it."""
    head, dot, rest = field.partition(".")
    if head in ("text", "token_ids", "prompt"):
        return "messages" if isinstance(body, ChatBody) else "prompt"
    if head == "chat":
        return "messages" + (rest.removeprefix("messages") if rest else "")
    if head == "max_new_tokens":
        return max_tokens_field(body)
    if head == "mode":
        return "speculation.mode"
    if head.startswith("stop[") and isinstance(body.stop, str):
        return "stop"
    return field
