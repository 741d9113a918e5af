"""OpenAI's chat and completions APIs (SSE with "stream": true).

    POST /v1/completions        POST /v1/chat/completions

Choices: each of a request's n (or best_of) samples of each prompt is its own
request to the service, hence its own row of the continuous batch, its own
seeded generator (choice i: ssd.serve.validation.choice_seed) and its own
stats; best_of keeps the n with the highest cumulative log-probability.
`submit_all` is that admission, which the Responses API shares.

What `seed` guarantees: in AR and SD the same request (prompt, settings,
seed) gives the same output, alone or batched. In SSD it gives the same
distribution, but the output may depend on timing and batch composition:
a cache hit and a miss consume different draws.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ssd.openai import schema
from ssd.openai.calls import Call, Choice, JobStream
from ssd.openai.common import Api, ApiError, batch_line, invalid, unavailable
from ssd.serve.service import DuplicateRequestId, Generation, InvalidArgument, NotServing, QueueFull, WorkerClosed


class CompletionsRoutes:
    """The two generation routes; no store of their own (a reply is the request's)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    async def completions(self, request: Request) -> Response:
        """OpenAI completions. `seed`: in AR and SD the same request gives the same output; in
        SSD the same distribution (the output may depend on timing and batch composition)."""
        return await self._generate(request, schema.CompletionBody, chat=False)

    async def chat(self, request: Request) -> Response:
        """OpenAI chat completions (the model's chat template). `seed`: as for /v1/completions."""
        return await self._generate(request, schema.ChatBody, chat=True)

    async def _generate(self, request: Request, body_cls: type, chat: bool) -> Response:
        api = self.api
        api.authorize(request)
        body = await api.body(request, body_cls)
        api.check_model(body.model)
        call = Call(api, body, submit_all(api, body, batch_line(request)), chat)
        if body.stream:
            return JobStream(call.events(), on_close=call.cancel)
        try:
            return await call.complete(request)
        finally:
            call.cancel()  # a no-op once they finished; frees the rows if the client left


def submit_all(api: Api, body: Any, background: bool = False) -> list[Choice]:
    """Every choice as its own request (a row of the batch): each prompt's n samples
    (best_of, when larger), sample i seeded choice_seed(seed, i) (ssd.serve.validation).
    If one is refused, those already queued are cancelled. `background`: a batch line's
    (queued after live requests)."""
    prompts = schema.prompts(body)
    batch = isinstance(body, schema.CompletionBody) and isinstance(body.prompt, list) \
        and bool(body.prompt) and not isinstance(body.prompt[0], int)  # a list of prompts
    samples = getattr(body, "best_of", None) or body.n or 1
    ranked = samples > (body.n or 1)  # best_of ranks by log-probability: every sample needs them
    choices: list[Choice] = []
    try:
        for p, prompt in enumerate(prompts):
            for i in range(samples):
                request = _request(body, prompt, i, p if batch else None)
                request.background = background
                if ranked and request.logprobs is None:
                    request.logprobs = 0
                gen = _submit(api, request, body, p if batch else None)
                choices.append(Choice(p, i, gen, echo=_echo(body, prompt, gen)))
    except BaseException:
        for choice in choices:
            choice.gen.cancel()
        raise
    return choices


def _request(body: Any, prompt: Any, choice: int, prompt_index: int | None) -> Any:
    try:
        return schema.to_request(body, prompt, choice=choice)
    except InvalidArgument as exc:
        raise invalid(exc, schema.body_param(exc.field, body, prompt_index)) from None


def _echo(body: Any, prompt: Any, gen: Generation) -> str:
    """What the reply starts with: completions' prompt, or chat's last message where it is the assistant's (vLLM's)."""
    if not body.echo:
        return ""
    if isinstance(body, schema.ChatBody):
        last = body.messages[-1]
        return schema.message_content(last, len(body.messages) - 1, True) if last.role == "assistant" else ""
    whole = isinstance(prompt, str) and body.truncate_prompt_tokens is None
    return prompt if whole else gen.decode(gen.request.prompt_ids)


def _submit(api: Api, request: Any, body: Any, prompt_index: int | None) -> Generation:
    """The shared validation and admission (the gRPC API's), through the service."""
    try:
        return api.service.submit(request, streams=bool(body.stream))
    except InvalidArgument as exc:
        raise invalid(exc, schema.body_param(exc.field, body, prompt_index)) from None
    except QueueFull as exc:
        raise ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") from None
    except (NotServing, WorkerClosed, DuplicateRequestId) as exc:
        raise unavailable(exc) from None
