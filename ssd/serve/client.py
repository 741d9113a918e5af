"""A small client for ssd.v1.GenerationService (used by launch/client.py and the tests).

    with GenerationClient("127.0.0.1:50051") as client:
        out = client.generate(text="def add(a, b):", max_new_tokens=32)
        print(out.text, out.finish_reason, out.stats.tokens_per_s)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssd.serve import protos

MODES = {"ar": 1, "sd": 2, "ssd": 3}
SPEC_FIELDS = ("k", "fanout_budget", "fanout_kind", "saguaro_c", "backup")


@dataclass
class Completion:
    """One request's stream, gathered."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)  # the round deltas joined
    text: str = ""  # the text deltas joined
    rounds: list[list[int]] = field(default_factory=list)
    finished: Any = None  # ssd.v1.Finished

    @property
    def finish_reason(self) -> str:
        """eos | length | stop | aborted | error ("" if the stream had no end)."""
        if self.finished is None:
            return ""
        name = self.finished.DESCRIPTOR.fields_by_name["reason"].enum_type.values_by_number[
            self.finished.reason
        ].name
        return name.removeprefix("FINISH_REASON_").lower()

    @property
    def stats(self) -> Any:
        return self.finished.stats if self.finished is not None else None

    @property
    def logprobs(self) -> list[Any]:
        """The output tokens' TokenLogprob messages (empty unless the request asked)."""
        return list(self.finished.output_logprobs) if self.finished is not None else []

    @property
    def prompt_logprobs(self) -> list[Any]:
        """The prompt tokens' after the first (empty unless the request asked)."""
        return list(self.finished.prompt_logprobs) if self.finished is not None else []

    def add(self, message: Any) -> None:
        self.request_id = self.request_id or message.request_id
        if message.token_ids:
            self.rounds.append(list(message.token_ids))
            self.token_ids.extend(message.token_ids)
        self.text += message.text
        if message.HasField("finished"):
            self.finished = message.finished


def build_request(
    pb: Any,
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Iterable[dict[str, str]] | None = None,
    chat_options: dict[str, Any] | None = None,
    request_id: str = "",
    mode: str | int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    logit_bias: dict[int, float] | None = None,
    structured: dict[str, Any] | None = None,
    stop_token_ids: Sequence[int] = (),
    include_stop_str_in_output: bool = False,
    allowed_token_ids: Sequence[int] = (),
    bad_words: Sequence[str] = (),
    **numbers: Any,
) -> Any:
    """A GenerateRequest; None leaves a field unset (the server's default).

    numbers: the request fields of ssd.fields by name, min_tokens, logprobs, prompt_logprobs, and the speculation settings k,
    fanout_budget, fanout_kind, saguaro_c, backup. structured: one StructuredOutput field, e.g. {"regex": "[ab]+"}.
    chat_options (with messages): add_generation_prompt, continue_final_message, template_kwargs (a dict).
    """
    request = pb.GenerateRequest(request_id=request_id, stop=list(stop), ignore_eos=ignore_eos,
                                 logit_bias=logit_bias or {}, stop_token_ids=list(stop_token_ids),
                                 include_stop_str_in_output=include_stop_str_in_output,
                                 allowed_token_ids=list(allowed_token_ids), bad_words=list(bad_words))
    if structured is not None:
        request.structured.CopyFrom(pb.StructuredOutput(**structured))
    if text is not None:
        request.text = text
    if token_ids is not None:
        request.token_ids.SetInParent()  # selects the oneof even for an empty list
        request.token_ids.ids.extend(token_ids)
    if messages is not None:
        request.chat.SetInParent()
        request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
        options = dict(chat_options or {})
        if isinstance(options.get("template_kwargs"), dict):
            options["template_kwargs"] = json.dumps(options["template_kwargs"])
        for name, value in options.items():
            setattr(request.chat, name, value)  # an unknown name raises AttributeError
    if mode is not None:
        request.mode = MODES[mode] if isinstance(mode, str) else mode
    for name, value in numbers.items():
        if value is None:
            continue
        target = request.speculation if name in SPEC_FIELDS else request
        setattr(target, name, value)  # an unknown name raises AttributeError
    return request


class GenerationClient:
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        max_message_bytes: int = 4 * 1024 * 1024,
        server_name: str | None = None,
    ) -> None:
        self.pb, pb_grpc = protos.load()
        options = [("grpc.max_receive_message_length", max_message_bytes)]
        if server_name:  # the name the server's certificate is for, when dialing an IP
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def request(self, **kwargs: Any) -> Any:
        return build_request(self.pb, **kwargs)

    def stream(self, timeout: float | None = None, **kwargs: Any) -> Any:
        """The raw call: iterate it for GenerateResponse messages; .cancel() ends it."""
        return self.stub.Generate(self.request(**kwargs), timeout=timeout, metadata=self.metadata)

    def generate(
        self,
        timeout: float | None = None,
        on_message: Callable[[Any], None] | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Run one request to its end; raises grpc.RpcError on a non-OK status."""
        out = Completion()
        for message in self.stream(timeout=timeout, **kwargs):
            out.add(message)
            if on_message is not None:
                on_message(message)
        return out

    def abort(self, request_id: str, timeout: float | None = 10.0) -> bool:
        reply = self.stub.Abort(self.pb.AbortRequest(request_id=request_id), timeout=timeout,
                                metadata=self.metadata)
        return reply.found

    def model_info(self, timeout: float | None = 10.0) -> Any:
        return self.stub.ModelInfo(self.pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def stats(self, timeout: float | None = 10.0) -> Any:
        return self.stub.Stats(self.pb.StatsRequest(), timeout=timeout, metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """SERVING | NOT_SERVING | ... (grpc.health.v1 needs no token)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def services(self) -> list[str]:
        """Service names the server lists by reflection (what grpcurl sees)."""
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        return sorted(ProtoReflectionDescriptorDatabase(self.channel).get_services())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
