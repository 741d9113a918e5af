"""The front-end-neutral request: what a client asked for, as plain Python.

Both front ends build one (gRPC: ssd.serve.convert.from_proto; HTTP:
ssd.serve.http_schema.to_request) and ssd.serve.validation checks it, so the
two share one set of rules. Field names follow the gRPC API's
(protos/ssd/v1/generation.proto); validation errors name them, and the HTTP
front end maps them back to the body's names. None means "not given: the
server's default".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class Speculation:
    """Per-request speculation settings; "" for a string: not given."""

    k: int | None = None
    fanout_budget: int | None = None
    fanout_kind: str = ""
    saguaro_c: float | None = None
    backup: str = ""


@dataclass
class Request:
    """One generation request. Exactly one of text, token_ids and chat is the prompt."""

    request_id: str = ""
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None  # an empty list is a chat (and refused as one)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    coupling: str | None = None  # standard | gumbel (sampling.coupling)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    mode: str | None = None  # ar | sd | ssd
    speculation: Speculation | None = None
    logprobs: int | None = None  # None: none; n: each token's, with n alternatives (HTTP only)

    def prompt_field(self) -> str | None:
        """Which prompt field is set ("text", "token_ids", "chat"); None if none or several."""
        given = [name for name in ("text", "token_ids", "chat") if getattr(self, name) is not None]
        return given[0] if len(given) == 1 else None
