"""The front-end-neutral request: what a client asked for, as plain Python.

Both front ends build one (gRPC: ssd.serve.convert.from_proto; HTTP:
ssd.openai.schema.to_request) and ssd.serve.validation checks it, so the
two share one set of rules. Field names follow the gRPC API's
(protos/ssd/v1/generation.proto); validation errors name them, and the HTTP
front end maps them back to the body's names. None means "not given: the
server's default".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatMessage:
    role: str
    content: str
    # An assistant's tool calls, as chat templates read them: [{"type": "function", "function":
    # {"name", "arguments": a dict}}]; a tool message's call id and name.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier thinking (Qwen3's template reads it)

    def template_dict(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it (unset fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class ChatOptions:
    """How a chat is rendered (vLLM's chat fields; a chat prompt only). add_generation_prompt: end
    with the assistant's header; continue_final_message: leave the last message open, so the model
    continues it (an assistant's prefill; not with add_generation_prompt); template_kwargs: more
    variables for the chat template, each one the template reads (Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None


@dataclass
class Speculation:
    """Per-request speculation settings; "" for a string: not given."""

    k: int | None = None
    fanout_budget: int | None = None
    fanout_kind: str = ""
    saguaro_c: float | None = None
    backup: str = ""


@dataclass
class Structured:
    """Structured output: what the generated text must match (ssd.engine.grammar).

    kind: json_object (any JSON object), json_schema (`value`: the schema),
    regex or lark (`value`: the pattern or grammar). `field`: where the
    client put it, for errors (HTTP: "response_format", "structured_outputs.regex").
    """

    kind: str
    value: Any = None
    field: str = "structured_output"


@dataclass
class Request:
    """One generation request. Exactly one of text, token_ids and chat is the prompt."""

    request_id: str = ""
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None  # an empty list is a chat (and refused as one)
    chat_options: ChatOptions | None = None  # None: the defaults
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    coupling: str | None = None  # standard | gumbel (sampling.coupling)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    mode: str | None = None  # ar | sd | ssd
    speculation: Speculation | None = None
    logprobs: int | None = None  # None: none; n: each token's, with n alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after the first (HTTP: echo)
    # Logits processing (ssd.engine.processing; HTTP only): OpenAI's logit_bias {token id: bias},
    # presence and frequency penalties, and structured output (a grammar's mask).
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's: > 0, 1 off; over the prompt and the output
    min_tokens: int | None = None  # vLLM's: no EOS, stop token or stop string before that many tokens
    stop_token_ids: list[int] | None = None  # vLLM's: each ends the output, kept in it
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens (EOS, <|im_end|>) in the text
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context's)
    suffix: str | None = None  # the text after the insertion: a fill-in-the-middle prompt (code models)
    prediction: str | None = None  # OpenAI's predicted output: a text prompt lookup may draw proposals from
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be drawn
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    structured: Structured | None = None
    tools: list[dict[str, Any]] | None = None  # function definitions for the chat template (OpenAI's `tools`)
    # Which of n choices this request is: its seed is choice_seed(seed, choice) (ssd.serve.validation).
    choice: int = 0
    # vLLM's priority: among queued requests a lower value is admitted sooner (admission only).
    priority: int = 0
    # A batch line (/v1/batches): admitted after every queued request that is not one.
    background: bool = False

    def prompt_field(self) -> str | None:
        """Which prompt field is set ("text", "token_ids", "chat"); None if none or several."""
        given = [name for name in ("text", "token_ids", "chat") if getattr(self, name) is not None]
        return given[0] if len(given) == 1 else None
