"""ssd.v1 messages <-> the service's plain values (the generated module is passed in).

`from_proto` turns a GenerateRequest into the neutral Request the service
validates; the rest turn the service's answers into ssd.v1 messages.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ssd.fields import FIELDS
from ssd.serve.protos import enum_names, enum_values
from ssd.serve.request import ChatMessage, ChatOptions, Request, Speculation, Structured
from ssd.serve.service import ModelInfo, RequestStats, ServiceStats
from ssd.serve.validation import InvalidArgument

# The proto's optional fields: the request fields of ssd.fields (coupling, a plain string, apart) and these.
_OPTIONAL = (*(f.name for f in FIELDS if f.name != "coupling"), "min_tokens", "logprobs", "prompt_logprobs",
             "skip_special_tokens", "truncate_prompt_tokens", "suffix", "prediction")
_OPTIONAL_SPEC = ("k", "fanout_budget", "saguaro_c")


def from_proto(message: Any) -> Request:
    """A GenerateRequest as the neutral Request (unset optional fields: None).
    An unknown Mode value is InvalidArgument("mode")."""
    request = Request(
        request_id=message.request_id, stop=list(message.stop), ignore_eos=message.ignore_eos,
        mode=_mode(message.mode), coupling=message.coupling or None,
        stop_token_ids=list(message.stop_token_ids) or None, allowed_token_ids=list(message.allowed_token_ids) or None,
        include_stop_str_in_output=message.include_stop_str_in_output, bad_words=list(message.bad_words) or None,
        priority=message.priority,
        **{name: getattr(message, name) for name in _OPTIONAL if message.HasField(name)},
    )
    which = message.WhichOneof("prompt")
    if which == "text":
        request.text = message.text
    elif which == "token_ids":
        request.token_ids = list(message.token_ids.ids)
    elif which == "chat":
        request.chat = [ChatMessage(m.role, m.content) for m in message.chat.messages]
        request.chat_options = _chat_options(message.chat)
    if message.logit_bias:
        request.logit_bias = dict(message.logit_bias)
    if message.HasField("structured"):
        request.structured = _structured(message.structured)
    if message.HasField("speculation"):
        given = message.speculation
        request.speculation = Speculation(
            fanout_kind=given.fanout_kind, backup=given.backup,
            **{name: getattr(given, name) for name in _OPTIONAL_SPEC if given.HasField(name)},
        )
    return request


def _chat_options(chat: Any) -> ChatOptions | None:
    if not (chat.HasField("add_generation_prompt") or chat.continue_final_message or chat.template_kwargs):
        return None
    kwargs = None
    if chat.template_kwargs:
        try:
            kwargs = json.loads(chat.template_kwargs)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("chat.template_kwargs", f"not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument("chat.template_kwargs", "must be a JSON object")
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return ChatOptions(add, chat.continue_final_message, kwargs)


def _structured(given: Any) -> Structured | None:
    kind = given.WhichOneof("kind")
    if kind is None:
        return None
    field = f"structured.{kind}"
    if kind == "json_object":
        return Structured("json_object", None, field) if given.json_object else None
    value = getattr(given, kind)
    if kind == "json_schema":
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(field, f"not valid JSON: {exc}") from None
    return Structured(kind, value, field)


def _mode(value: int) -> str | None:
    if value == 0:
        return None
    names = enum_names("Mode")
    if value not in names:
        raise InvalidArgument("mode", f"unknown value {value}; known: {', '.join(n.upper() for n in names.values())}")
    return names[value]


def request_stats(pb: Any, stats: RequestStats) -> Any:
    fields = dataclasses.asdict(stats)
    fields["mode"] = enum_values("Mode").get(stats.mode, 0)
    fields["spec"] = pb.SpecStats(**fields["spec"])
    return pb.RequestStats(**fields)


def model_info(pb: Any, info: ModelInfo) -> Any:
    fields = dataclasses.asdict(info)
    fields["draft_model"] = info.draft_model or ""
    fields["modes"] = [enum_values("Mode")[m] for m in info.modes]
    fields["limits"] = pb.Limits(**fields["limits"])
    defaults = fields["defaults"] | fields["defaults"].pop("sampling") | {"mode": enum_values("Mode")[info.defaults.mode]}
    fields["defaults"] = pb.Defaults(**defaults)
    return pb.ModelInfoResponse(**fields)


def stats_response(pb: Any, stats: ServiceStats) -> Any:
    c = stats.counters
    g = c.generation
    return pb.StatsResponse(
        requests_total=c.requests_total, requests_running=stats.running, requests_waiting=stats.waiting,
        finished_by_reason=c.finished, requests_rejected=c.requests_rejected,
        prompt_tokens_total=g.prompt_tokens, generation_tokens_total=g.new_tokens,
        rounds_total=g.rounds, draft_tokens_total=g.drafted, accepted_tokens_total=g.accepted,
        spec_cache_lookups_total=g.spec.lookups, spec_cache_hits_total=g.spec.hits,
        spec_cache_hit_rate=g.spec.hit_rate, uptime_s=stats.uptime_s, prometheus_text=stats.prometheus_text,
    )


def token_logprobs(pb: Any, entries: list[Any] | None) -> list[Any]:
    """TokenLogprob messages from the engine's TokenLogprob entries (None: none)."""
    return [pb.TokenLogprob(token=e.token, logprob=e.logprob, rank=e.rank,
                            top=[pb.TokenAlternative(token=t, logprob=v) for t, v in e.top])
            for e in entries or ()]
