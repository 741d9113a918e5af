"""OpenAI tool calls in the Qwen2.5 / Hermes format the model family was trained on.

Qwen2.5's chat template lays the `tools` out in the system turn and asks
for each call as

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

(the template itself: huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct,
tokenizer_config.json). This module is everything tool-shaped between the
OpenAI body and that format: checking `tools` and `tool_choice`, rendering
an assistant's earlier calls for the template, the grammar that "required"
or a named function puts on the output (so the call is always well-formed
JSON for a declared function, and the mask keeps the sampling exact), and
parsing the text back into `message.tool_calls`, whole or streamed.

tool_choice: "auto" (the default with tools) renders them and parses what
the model writes; "none" neither renders nor parses (as vLLM's
--exclude-tools-when-tool-choice-none); "required" and a named function
also constrain the output to calls (one when parallel_tool_calls is false).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ssd.engine import grammar
from ssd.serve.validation import InvalidArgument

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


# --- the request ----------------------------------------------------------------------------


def check(body: Any) -> None:
    """tools and tool_choice agree: named functions exist, names are unique, choices need tools."""
    names = [t.function.name for t in body.tools or []]
    for i, name in enumerate(names):
        if not name or names.index(name) != i:
            raise InvalidArgument(f"tools[{i}].function.name", f"must be a unique non-empty name, got {name!r}")
    for i, tool in enumerate(body.tools or []):
        if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
            raise InvalidArgument(f"tools[{i}].function.parameters", "must be a JSON schema of an object")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise InvalidArgument("tool_choice", "needs tools")
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise InvalidArgument("tool_choice.function.name", f"no tool is named {choice.function.name!r}")


def active(body: Any) -> bool:
    """Whether the output is parsed for tool calls."""
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def constrained(body: Any) -> bool:
    """Whether a grammar forces the output to be calls ("required" or a named function)."""
    return active(body) and body.tool_choice not in (None, "auto")


def rendered(body: Any) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI's own shape), or None."""
    if not active(body):
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def message_calls(message: Any, i: int) -> list[dict[str, Any]] | None:
    """An assistant message's tool_calls for the template: arguments as the object the template prints."""
    if not message.tool_calls:
        return None
    calls = []
    for j, call in enumerate(message.tool_calls):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}].function.arguments",
                                  f"not valid JSON: {exc}") from None
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def call_grammar(body: Any) -> str:
    """A Lark grammar (llguidance's dialect) for one or more calls in the template's format,
    each naming a permitted function with arguments valid under its parameters schema."""
    tools = body.tools
    if not isinstance(body.tool_choice, str):  # a named function
        tools = [t for t in tools if t.function.name == body.tool_choice.function.name]
    schemas = [_call_schema(t.function.name, t.function.parameters) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": grammar.JSON_OPTIONS}  # the template's own JSON layout
    repeat = ' ("\\n" call)*' if body.parallel_tool_calls is not False else ""
    return "\n".join([
        f"start: call{repeat}",
        'call: "<tool_call>\\n" arguments "\\n</tool_call>"',
        f"arguments: %json {json.dumps(schema)}",
    ])


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


# --- the response ---------------------------------------------------------------------------


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output. Calls are taken only when every block
    parses; otherwise the text stays content, untouched (no call is made up)."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = [_call(m.group(1)) for m in blocks]
    if any(c is None for c in calls):
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def _call(block: str) -> dict[str, Any] | None:
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": data["name"], "arguments": text}}


@dataclass
class ToolStream:
    """A stream's text split into content (sent as it comes) and calls (sent at the end).

    Content before the first `<tool_call>` streams as usual, minus any tail
    that could be the start of the marker; from the marker on, the text is
    held and parsed at the end (OpenAI streams a call's arguments in pieces;
    one piece is also OpenAI's shape, and it is never a call that fails to parse).
    """

    held: str = ""
    in_call: bool = False

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        self.held += delta
        if self.in_call:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            self.in_call = True
            out, self.held = self.held[:at], self.held[at:]
        else:
            keep = _partial_marker(self.held)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(the content still to send, the calls) at the end of the stream."""
        rest = self.feed(delta)
        content, calls = parse(self.held)
        if not calls:  # no well-formed call: what was held is content after all
            return rest + self.held, []
        return rest + (content or ""), calls


def _partial_marker(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
