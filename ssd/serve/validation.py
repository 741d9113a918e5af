"""The neutral request (ssd.serve.request) -> what the engine runs, or an error that names the field.

One validation for both front ends: gRPC and HTTP each turn what they
received into a `Request`, and everything a client sends is checked here, before it is queued: a request
that reaches the engine can only fail by an engine fault. A setting the
server could not honour exactly (a mode without its model, speculation
settings the mode ignores) is refused rather than silently changed. Errors
name the gRPC API's fields (`max_new_tokens`, `chat.messages[0].role`); the
HTTP front end maps them to the body's.

A field a request omits takes the server's configured default
(`serve_defaults`, ssd.config.RequestDefaults) or else OpenAI's (ssd.fields:
each field's rule and default, declared once), a fresh random seed per
request, and max_new_tokens up to the context (the model's length minus the
prompt, within --max-new-tokens). The same for gRPC and HTTP: one set of rules.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from ssd.config import (
    BACKUPS,
    FANOUT_KINDS,
    MODES,
    Config,
    ConfigError,
    GenerationConfig,
    SamplingConfig,
    SpeculationConfig,
)
from ssd.engine import grammar
from ssd.fields import PENALTIES, SAMPLING, FieldError
from ssd.engine.request import GenerationRequest, Processing
from ssd.serve.backend import Backend, BackendInfo, UnsupportedRequest
from ssd.serve.options import ServeOptions
from ssd.serve.request import ChatMessage, ChatOptions, Request, Speculation, Structured

MAX_REQUEST_ID_CHARS = 128
SSD_ONLY = ("fanout_budget", "fanout_kind", "saguaro_c", "backup")
RANDOM_SEED_BITS = 63  # a fresh seed per request that omits one: any stream of the generator
MAX_LOGIT_BIAS = 100.0  # OpenAI: -100..100
MAX_LOGPROBS = 20  # OpenAI's most alternatives per token
SEEDED_COUPLING = "gumbel"  # what a seeded request that names no coupling gets (default_coupling)


InvalidArgument = FieldError  # a request field is invalid; str() starts with the field's name


def validate(request: Request, backend: Backend, options: ServeOptions) -> GenerationRequest:
    """Check a request against the server's limits and the model; the
    engine's request (without callbacks) when it passes."""
    info = backend.info
    request_id = _request_id(request)
    mode = _mode(request, info)
    max_new = _max_new_tokens(request, info, options)
    stop = _stop(request, options)
    sampling = _sampling(request, info)
    speculation = _speculation(request, info, options, mode)
    processing = _processing(request, backend, options)
    prompt_ids = _truncated(request, _prompt(request, backend, options), info)
    if max_new is None:
        max_new = _context_default(request, len(prompt_ids), info, options)
    _check_context(request, len(prompt_ids), max_new, info)
    min_tokens = _min_tokens(request, max_new, processing)
    if not -2**31 <= request.priority < 2**31:  # gRPC's int32: both front ends take the same values
        raise InvalidArgument("priority", f"must be a 32-bit integer, got {request.priority}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidArgument(name, f"must be in 0..{MAX_LOGPROBS} (alternatives per token), got {value}")
    generation = GenerationConfig(
        max_new_tokens=max_new, stop=stop, ignore_eos=request.ignore_eos, min_tokens=min_tokens,
        stop_token_ids=token_ids_in_vocabulary("stop_token_ids", request.stop_token_ids, info.vocab_size),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
    )
    return GenerationRequest(prompt_ids, sampling, generation, speculation, request_id=request_id,
                             logprobs=request.logprobs, processing=processing,
                             prompt_logprobs=request.prompt_logprobs, prediction=_prediction(request, backend))


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded `seed` (n > 1, best_of): choice 0 runs
    with the seed itself (n = 1 is unchanged), choice i with seed + i * 0x9E3779B97F4A7C15
    mod 2**64 (the 64-bit golden-ratio increment of SplitMix64), so each choice is
    reproducible alone and the choices' generators are distinct."""
    return (seed + choice * 0x9E3779B97F4A7C15) % 2**64


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
    """The request's sampling fields, else the server's defaults, else OpenAI's (ssd.fields)."""
    server = info.defaults.serve_defaults
    values = {f.name: f.resolve(getattr(request, f.name), getattr(server, f.name)) for f in SAMPLING}
    if values["coupling"] is None:
        values["coupling"] = default_coupling(info.defaults, seeded=values["seed"] is not None)
    if values["seed"] is None:  # OpenAI's: unseeded requests (and their choices) are independent samples
        values["seed"] = secrets.randbits(RANDOM_SEED_BITS)
    values["seed"] = choice_seed(values["seed"], request.choice)
    return SamplingConfig(**values)


def default_coupling(config: Config, seeded: bool) -> str:
    """The coupling of a request that names none: serve_defaults.coupling; unset, gumbel for a
    seeded request (its output is then AR's in every mode, whatever the timing, batch or backup:
    the promise a seed makes) and sampling.coupling for an unseeded one."""
    if config.serve_defaults.coupling is not None:
        return config.serve_defaults.coupling
    return SEEDED_COUPLING if seeded else config.sampling.coupling


def _max_new_tokens(request: Request, info: BackendInfo, options: ServeOptions) -> int | None:
    """The given or configured max_new_tokens, checked; None: up to the context (known with the prompt)."""
    limit = max_new_tokens_limit(info, options)
    configured = info.defaults.serve_defaults.max_new_tokens
    max_new = _given(request.max_new_tokens, None if configured is None else min(configured, limit))
    if max_new is not None and not 1 <= max_new <= limit:
        raise InvalidArgument("max_new_tokens", f"must be in 1..{limit}, got {max_new}")
    return max_new


def _context_default(request: Request, prompt_tokens: int, info: BackendInfo, options: ServeOptions) -> int:
    """OpenAI's omitted max_tokens: whatever the context leaves after the prompt (within --max-new-tokens)."""
    room = info.max_context_tokens - prompt_tokens
    if room < 1:
        raise InvalidArgument(
            request.prompt_field(),
            f"prompt of {prompt_tokens} tokens leaves no room in the model's context of "
            f"{info.max_context_tokens} tokens",
        )
    return min(room, max_new_tokens_limit(info, options))


def _min_tokens(request: Request, max_new: int, processing: Processing | None) -> int:
    """vLLM's min_tokens: no EOS, stop token or stop string before that many tokens."""
    min_tokens = _given(request.min_tokens, 0)
    if not 0 <= min_tokens <= max_new:
        raise InvalidArgument("min_tokens", f"must be in 0..max_new_tokens ({max_new}), got {min_tokens}")
    if min_tokens and processing is not None and processing.grammar is not None:
        raise InvalidArgument("min_tokens", "cannot be combined with structured output (the grammar ends the text)")
    return min_tokens


def token_ids_in_vocabulary(name: str, ids: list[int] | None, vocab_size: int) -> list[int]:
    """`ids` (None: none), each checked to lie in the vocabulary; InvalidArgument(name) otherwise."""
    for position, token in enumerate(ids or ()):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                name, f"id {token} at position {position} is outside the vocabulary 0..{vocab_size - 1}")
    return list(ids or ())


def _stop(request: Request, options: ServeOptions) -> list[str]:
    stop = list(request.stop)
    if len(stop) > options.max_stop_strings:
        raise InvalidArgument("stop", f"at most {options.max_stop_strings} strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not 1 <= len(text) <= options.max_stop_chars:
            raise InvalidArgument(
                f"stop[{i}]", f"must be 1..{options.max_stop_chars} characters, got {len(text)}"
            )
    return stop


def _processing(request: Request, backend: Backend, options: ServeOptions) -> Processing | None:
    """logit_bias, penalties and structured output, checked; None when the request asks for none."""
    info = backend.info
    bias = tuple(sorted(_logit_bias(request.logit_bias or {}, info.vocab_size).items()))
    presence, frequency, repetition = (float(spec.resolve(getattr(request, spec.name))) for spec in PENALTIES)
    compiled = _grammar(request.structured, backend) if request.structured is not None else None
    if compiled is not None and request.ignore_eos:
        raise InvalidArgument("ignore_eos", "cannot be combined with structured output (the grammar ends the text)")
    if request.allowed_token_ids is not None and not request.allowed_token_ids:
        raise InvalidArgument("allowed_token_ids", "must list at least one token id")
    allowed = tuple(sorted(set(token_ids_in_vocabulary("allowed_token_ids", request.allowed_token_ids, info.vocab_size))))
    if allowed and compiled is not None:
        raise InvalidArgument("allowed_token_ids", "cannot be combined with structured output")
    bad_words = _bad_words(request.bad_words or [], backend, options)
    if bad_words and compiled is not None:
        raise InvalidArgument("bad_words", "cannot be combined with structured output")
    spec = Processing(bias, presence, frequency, compiled, repetition, allowed, bad_words)
    return spec if spec.active else None


def _bad_words(words: list[str], backend: Backend, options: ServeOptions) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token id sequences: each word as the tokenizer spells it, and with
    one leading space (a word inside a sentence), where the vocabulary spells that."""
    if len(words) > options.max_stop_strings:
        raise InvalidArgument("bad_words", f"at most {options.max_stop_strings} words, got {len(words)}")
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        if not 1 <= len(word) <= options.max_stop_chars:
            raise InvalidArgument(f"bad_words[{i}]", f"must be 1..{options.max_stop_chars} characters, got {len(word)}")
        spellings = []
        for text in dict.fromkeys((word, " " + word.lstrip())):
            try:
                spellings.append(tuple(backend.encode(text)))
            except ValueError:  # a character the vocabulary lacks (the tiny test models)
                continue
        if not any(spellings):
            raise InvalidArgument(f"bad_words[{i}]", "the vocabulary cannot spell it")
        out += [s for s in spellings if s and s not in out]
    return tuple(out)


def _logit_bias(bias: dict[int, float], vocab_size: int) -> dict[int, float]:
    for token, value in bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidArgument("logit_bias", f"token id {token} is outside the vocabulary 0..{vocab_size - 1}")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidArgument("logit_bias", f"bias of token {token} must be in -100..100, got {value}")
    return {token: float(value) for token, value in bias.items() if value != 0}


def _grammar(structured: Structured, backend: Backend) -> str:
    """llguidance's grammar for the request's structured output; its refusal, a limit of its
    met at the first token, or a first token the model's vocabulary cannot spell names the field."""
    build = {"json_object": lambda v: grammar.json_object(), "json_schema": grammar.json_schema,
             "regex": grammar.regex, "lark": grammar.lark}.get(structured.kind)
    if build is None:
        raise InvalidArgument(structured.field, f"unknown kind {structured.kind!r}")
    try:
        compiled = build(structured.value)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(structured.field, f"not a valid {structured.kind}: {exc}") from None
    message = grammar.error(compiled)
    if message is not None:
        raise InvalidArgument(structured.field, f"not a valid {structured.kind}: {message}")
    tokenizer = getattr(backend, "tokenizer", None)  # a remote backend's engine checks it at admission
    try:
        startable = tokenizer is None or grammar.can_start(compiled, tokenizer, backend.info.eos_token_ids,
                                                           backend.info.vocab_size)
    except ValueError as exc:  # over one of llguidance's limits (met only as it parses)
        raise InvalidArgument(structured.field, f"this {structured.kind} cannot be followed: "
                                                f"{str(exc).removeprefix('grammar: ')}") from None
    if not startable:
        raise InvalidArgument(structured.field, "no token of this model's vocabulary can start it")
    return compiled


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


def prompt_ids(request: Request, backend: Backend, options: ServeOptions) -> list[int]:
    """The request's prompt as the engine will see it (text encoded, chat rendered), checked."""
    return _prompt(request, backend, options)


def _prompt(request: Request, backend: Backend, options: ServeOptions) -> list[int]:
    which = request.prompt_field()
    if which is None:
        raise InvalidArgument("prompt", "set exactly one of text, token_ids, chat")
    if which == "chat":
        if request.suffix is not None:
            raise InvalidArgument("suffix", "applies to a text or token-id prompt, not a chat")
        return _chat_prompt(request, backend, options)
    if which == "text":
        infill_at_start = request.suffix is not None and request.text == ""  # the cursor at a file's start
        ids = [] if infill_at_start else _text_prompt(request.text, backend)
    else:
        ids = _id_prompt(list(request.token_ids), backend.info.vocab_size)
    return ids if request.suffix is None else _infill(ids, request.suffix, backend)


def _infill(prefix: list[int], suffix: str, backend: Backend) -> list[int]:
    """A fill-in-the-middle prompt: the text before (the prompt) and after (`suffix`) between the
    model's FIM tokens, in its training order (prefix, suffix, middle); the output is the middle."""
    fim = backend.info.fim_ids
    if fim is None:
        raise InvalidArgument("suffix", f"model {backend.info.target_model!r} has no fill-in-the-middle tokens")
    try:
        after = backend.encode(suffix) if suffix else []
    except ValueError as exc:
        raise InvalidArgument("suffix", str(exc)) from None
    prefix_token, suffix_token, middle_token = fim
    return [prefix_token, *prefix, suffix_token, *after, middle_token]


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
    return token_ids_in_vocabulary("token_ids", ids, vocab_size)


def _chat_prompt(request: Request, backend: Backend, options: ServeOptions) -> list[int]:
    messages = request.chat
    if not messages:
        raise InvalidArgument("chat", "must hold at least one message")
    if len(messages) > options.max_chat_messages:
        raise InvalidArgument("chat", f"at most {options.max_chat_messages} messages, got {len(messages)}")
    for i, message in enumerate(messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    _check_chat_options(request.chat_options, messages)
    # Only what a request sets is passed: a backend may take messages alone.
    extra = {name: value for name, value in (("tools", request.tools), ("options", request.chat_options)) if value}
    try:
        ids = backend.apply_chat([m.template_dict() for m in messages], **extra)
    except UnsupportedRequest as exc:
        raise InvalidArgument(exc.field or "chat", str(exc)) from None
    except ValueError as exc:
        raise InvalidArgument("chat", str(exc)) from None
    except Exception as exc:  # a template's own complaint (e.g. roles must alternate)
        raise InvalidArgument("chat", f"the chat template refused it: {exc}") from None
    if not ids:
        raise InvalidArgument("chat", "renders to no tokens")
    return ids


def _check_chat_options(given: ChatOptions | None, messages: list[ChatMessage]) -> None:
    if given is None or not given.continue_final_message:
        return
    if given.add_generation_prompt:
        raise InvalidArgument("chat.continue_final_message", "cannot be combined with add_generation_prompt "
                              "(the final message is continued, no new one started): set it false")
    if not messages[-1].content:
        raise InvalidArgument("chat.continue_final_message", "the final message has no content to continue")


def _prediction(request: Request, backend: Backend) -> list[int] | None:
    """OpenAI's predicted output as token ids (None: none), within the model's context."""
    if not request.prediction:
        return None
    try:
        ids = backend.encode(request.prediction)
    except ValueError as exc:
        raise InvalidArgument("prediction", str(exc)) from None
    limit = backend.info.max_context_tokens
    if len(ids) > limit:
        raise InvalidArgument("prediction", f"at most {limit} tokens (the model's context), got {len(ids)}")
    return ids


def _truncated(request: Request, ids: list[int], info: BackendInfo) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context holds)."""
    k = request.truncate_prompt_tokens
    if k is None:
        return ids
    if request.suffix is not None:  # cutting the left would cut the FIM prefix token
        raise InvalidArgument("truncate_prompt_tokens", "cannot be combined with suffix")
    if k == -1:
        k = info.max_context_tokens
    if not 1 <= k <= info.max_context_tokens:
        raise InvalidArgument("truncate_prompt_tokens", f"must be in 1..{info.max_context_tokens} (the model's "
                              f"context) or -1, got {request.truncate_prompt_tokens}")
    return ids[-k:]


def _check_context(request: Request, prompt_tokens: int, max_new: int, info: BackendInfo) -> None:
    if prompt_tokens + max_new > info.max_context_tokens:
        raise InvalidArgument(
            request.prompt_field(),
            f"prompt of {prompt_tokens} tokens plus max_new_tokens {max_new} exceeds the "
            f"model's context of {info.max_context_tokens} tokens",
        )


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
