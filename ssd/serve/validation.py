"""The neutral request (ssd.serve.request) -> what the engine runs, or an error that names the field.

One validation for both front ends: gRPC and HTTP each turn what they
received into a `Request`, and everything a client sends is checked here, before it is queued: a request
that reaches the engine can only fail by an engine fault. A setting the
server could not honour exactly (a mode without its model, speculation
settings the mode ignores) is refused rather than silently changed. Errors
name the gRPC API's fields (`max_new_tokens`, `chat.messages[0].role`); the
HTTP front end maps them to the body's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ssd.config import (
    BACKUPS,
    COUPLINGS,
    FANOUT_KINDS,
    MODES,
    ConfigError,
    GenerationConfig,
    SamplingConfig,
    SpeculationConfig,
)
from ssd.engine.request import GenerationRequest
from ssd.serve.backend import Backend, BackendInfo, UnsupportedRequest
from ssd.serve.options import ServeOptions
from ssd.serve.request import ChatMessage, Request, Speculation

MAX_REQUEST_ID_CHARS = 128
SSD_ONLY = ("fanout_budget", "fanout_kind", "saguaro_c", "backup")
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1


class InvalidArgument(ValueError):
    """A request field is invalid; str() starts with the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate(request: Request, backend: Backend, options: ServeOptions) -> GenerationRequest:
    """Check a request against the server's limits and the model; the
    engine's request (without callbacks) when it passes."""
    info = backend.info
    request_id = _request_id(request)
    mode = _mode(request, info)
    generation = _generation(request, info, options)
    sampling = _sampling(request, info)
    speculation = _speculation(request, info, options, mode)
    prompt_ids = _prompt(request, backend, options)
    _check_context(request, len(prompt_ids), generation.max_new_tokens, info)
    return GenerationRequest(prompt_ids, sampling, generation, speculation, request_id=request_id,
                             logprobs=request.logprobs)


def max_new_tokens_limit(info: BackendInfo, options: ServeOptions) -> int:
    return max(1, min(options.max_new_tokens, info.max_context_tokens - 1))


def _request_id(request: Request) -> str:
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    if rid and not (rid.isascii() and rid.isprintable()):
        raise InvalidArgument("request_id", "must be printable ASCII")
    return rid


def _mode(request: Request, info: BackendInfo) -> str:
    mode = request.mode or info.defaults.speculation.mode
    if mode not in MODES:
        raise InvalidArgument("mode", f"unknown value {mode!r}; known: {', '.join(MODES)}")
    if mode not in info.modes:
        raise InvalidArgument(
            "mode", f"{mode} needs a draft model; this server serves {', '.join(info.modes)}"
        )
    return mode


def _sampling(request: Request, info: BackendInfo) -> SamplingConfig:
    default = info.defaults.sampling
    temperature = _given(request.temperature, default.temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidArgument("temperature", f"must be a finite number >= 0, got {temperature}")
    top_k = _given(request.top_k, default.top_k)
    if not 0 <= top_k <= MAX_INT32:
        raise InvalidArgument("top_k", f"must be in 0..{MAX_INT32} (0: off), got {top_k}")
    top_p = _given(request.top_p, default.top_p)
    if not 0 < top_p <= 1:  # also refuses NaN
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
    seed = _given(request.seed, default.seed)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidArgument("seed", f"must be in 0..2**64-1, got {seed}")
    coupling = request.coupling or default.coupling
    if coupling not in COUPLINGS:
        raise InvalidArgument("coupling", f"must be one of {', '.join(COUPLINGS)}, got {coupling!r}")
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, coupling=coupling)


def _generation(request: Request, info: BackendInfo, options: ServeOptions) -> GenerationConfig:
    limit = max_new_tokens_limit(info, options)
    default = min(info.defaults.generation.max_new_tokens, limit)
    max_new = _given(request.max_new_tokens, default)
    if not 1 <= max_new <= limit:
        raise InvalidArgument("max_new_tokens", f"must be in 1..{limit}, got {max_new}")
    stop = list(request.stop)
    if len(stop) > options.max_stop_strings:
        raise InvalidArgument("stop", f"at most {options.max_stop_strings} strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not 1 <= len(text) <= options.max_stop_chars:
            raise InvalidArgument(
                f"stop[{i}]", f"must be 1..{options.max_stop_chars} characters, got {len(text)}"
            )
    return GenerationConfig(max_new_tokens=max_new, stop=stop, ignore_eos=request.ignore_eos)


def _speculation(request: Request, info: BackendInfo, options: ServeOptions, mode: str) -> SpeculationConfig:
    default = dataclasses.replace(info.defaults.speculation, mode=mode)
    if request.speculation is None:
        return default
    given = request.speculation
    _refuse_ignored(given, mode)
    k = _in_range(given, "k", 1, options.max_k, default.k)
    budget = _in_range(given, "fanout_budget", 1, options.max_budget, default.fanout.budget)
    saguaro_c = _given(given.saguaro_c, default.saguaro_c)
    if not 0 <= saguaro_c <= 1:  # also refuses NaN
        raise InvalidArgument("speculation.saguaro_c", f"must be in [0, 1], got {saguaro_c}")
    kind = _one_of(given.fanout_kind, "speculation.fanout_kind", FANOUT_KINDS) or default.fanout.kind
    backup = _one_of(given.backup, "speculation.backup", BACKUPS)
    fanout = dataclasses.replace(default.fanout, budget=budget, kind=kind)
    spec = dataclasses.replace(default, k=k, fanout=fanout, saguaro_c=saguaro_c)
    if given.k is not None:  # the asked-for K, not the configured batch-size policy
        spec = dataclasses.replace(spec, k_policy={})
    if backup:
        # A configured batch-size policy would override the asked-for backup.
        spec = dataclasses.replace(spec, backup=backup, backup_policy={})
    try:
        return dataclasses.replace(spec)  # re-runs the config's own checks
    except ConfigError as exc:
        raise InvalidArgument("speculation", str(exc)) from None


def _refuse_ignored(given: Speculation, mode: str) -> None:
    ignored = {"ar": ("k", *SSD_ONLY), "sd": SSD_ONLY, "ssd": ()}[mode]
    for name in ignored:
        value = getattr(given, name)
        if value is not None and value != "":
            raise InvalidArgument(f"speculation.{name}", f"mode {mode} does not use it; leave it unset")


def _in_range(given: Speculation, name: str, low: int, high: int, default: int) -> int:
    value = getattr(given, name)
    if value is None:
        return default
    if not low <= value <= high:
        raise InvalidArgument(f"speculation.{name}", f"must be in {low}..{high}, got {value}")
    return value


def _one_of(value: str, field: str, allowed: tuple[str, ...]) -> str:
    if value and value not in allowed:
        raise InvalidArgument(field, f"must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _prompt(request: Request, backend: Backend, options: ServeOptions) -> list[int]:
    which = request.prompt_field()
    if which is None:
        raise InvalidArgument("prompt", "set exactly one of text, token_ids, chat")
    if which == "text":
        return _text_prompt(request.text, backend)
    if which == "token_ids":
        return _id_prompt(list(request.token_ids), backend.info.vocab_size)
    return _chat_prompt(request.chat, backend, options)


def _text_prompt(text: str, backend: Backend) -> list[int]:
    if not text:
        raise InvalidArgument("text", "must not be empty")
    try:
        ids = backend.encode(text)
    except ValueError as exc:
        raise InvalidArgument("text", str(exc)) from None
    if not ids:
        raise InvalidArgument("text", "encodes to no tokens")
    return ids


def _id_prompt(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise InvalidArgument("token_ids", "must not be empty")
    for position, token in enumerate(ids):
        if token < 0:
            raise InvalidArgument("token_ids", f"id {token} at position {position} is negative")
        if token >= vocab_size:
            raise InvalidArgument(
                "token_ids", f"id {token} at position {position} is outside the vocabulary 0..{vocab_size - 1}"
            )
    return ids


def _chat_prompt(messages: list[ChatMessage], backend: Backend, options: ServeOptions) -> list[int]:
    if not messages:
        raise InvalidArgument("chat", "must hold at least one message")
    if len(messages) > options.max_chat_messages:
        raise InvalidArgument("chat", f"at most {options.max_chat_messages} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    try:
        ids = backend.apply_chat([{"role": m.role, "content": m.content} for m in messages])
    except (UnsupportedRequest, ValueError) as exc:
        raise InvalidArgument("chat", str(exc)) from None
    except Exception as exc:  # a template's own complaint (e.g. roles must alternate)
        raise InvalidArgument("chat", f"the chat template refused it: {exc}") from None
    if not ids:
        raise InvalidArgument("chat", "renders to no tokens")
    return ids


def _check_context(request: Request, prompt_tokens: int, max_new: int, info: BackendInfo) -> None:
    if prompt_tokens + max_new > info.max_context_tokens:
        raise InvalidArgument(
            request.prompt_field(),
            f"prompt of {prompt_tokens} tokens plus max_new_tokens {max_new} exceeds the "
            f"model's context of {info.max_context_tokens} tokens",
        )


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
