"""One OpenAI HTTP request's answer (the routers in ssd.openai.routes hand it here): its
choices' events from the GenerationService turned into OpenAI objects, whole or as an SSE
stream, for completions, chat and the Responses API (ResponsesCall; stored and background
responses: ssd.openai.stored, kept by ssd.openai.routes.responses).

Errors are ApiError (ssd.openai.common), OpenAI's shape; a failure after a stream began ends
it with OpenAI's error event. No routing and no server here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from ssd.engine.request import TokenLogprob
from ssd.openai import responses, schema
from ssd.openai import tools as tooling
from ssd.openai.common import EVENT_POLL_S, Api, ApiError, invalid
from ssd.openai.reasoning import ReasoningStream, opened_by, split as split_reasoning
from ssd.openai.stored import Conversation, ResponseStore, StoredResponse, input_items
from ssd.serve.service import (
    Chunk,
    Final,
    Generation,
    RequestStats,
)

log = logging.getLogger(__name__)
REASONING_TAIL = 16  # prompt tokens read to tell whether the output starts inside <think>
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports masked tokens the same way
# The engine's ends -> OpenAI's finish_reason (with tool_calls, set where calls are parsed); an
# aborted or failed request is an error (status, or a stream's error event), never a finish reason.
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class Choice:
    """One choice of a response: a generation (a row of the continuous batch) and what was sent of it."""

    prompt_index: int  # which prompt (completions may send a list)
    sample: int  # which of the prompt's n (or best_of) samples
    gen: Generation
    echo: str = ""  # completions' echo: the prompt's text, sent before the output
    index: int = 0  # the choice's index in the response
    logprobs_sent: int = 0
    tokens_out: int = 0  # tokens generated so far (continuous_usage_stats)
    text_offset: int = 0  # completions' text_offset: where the next token's text starts
    tools: tooling.ToolStream | None = None  # chat with tools: content streams, calls come at the end
    thinks_first: bool | None = None  # reasoning parsed: whether the output starts thinking; None: not parsed
    reasoning: ReasoningStream | None = None  # a stream's thinking, routed apart from its answer
    final: Final | None = None


class Call:
    """One request's response: the OpenAI objects built from its choices' events."""

    terminator = format_sse_event(data_str="[DONE]")  # a stream's last event

    def __init__(self, api: Api, body: Any, choices: list[Choice], chat: bool) -> None:
        """`api`: the routers' gate (ssd.openai.common): its options and next_event."""
        self.api, self.body, self.choices, self.chat = api, body, choices, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.shown_logprobs = schema.top_logprobs(body) is not None  # best_of asks for them to rank by
        n = body.n or 1
        for choice in choices:
            choice.index = choice.prompt_index * n + choice.sample
            choice.text_offset = len(choice.echo)
            if chat and tooling.active(body):
                choice.tools = tooling.ToolStream()
            if chat and self._parses_reasoning(choice):
                tail = choice.gen.request.prompt_ids[-REASONING_TAIL:]
                choice.thinks_first = opened_by(choice.gen.backend.decode(tail, skip_special_tokens=False))
                choice.reasoning = ReasoningStream(choice.thinks_first)

    def _parses_reasoning(self, choice: Choice) -> bool:
        mode = self.api.options.reasoning_parser
        return mode == "think" or (mode == "auto" and choice.gen.backend.info.think_tokens)

    def cancel(self) -> None:
        """Stop every choice (a no-op for those that finished)."""
        for choice in self.choices:
            choice.gen.cancel()

    async def complete(self, request: Request) -> JSONResponse:
        """Wait for every choice's end (the rounds only feed the text); abort all if the client leaves."""
        checked = time.monotonic()
        for choice in self.choices:
            while choice.final is None:
                event = await self.api.next_event(choice.gen)
                if isinstance(event, Final):
                    choice.final = event
                elif time.monotonic() - checked >= EVENT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        log.info("client of %s disconnected; aborting", choice.gen.request_id)
                        self.cancel()
                        return ApiError(408, "the client disconnected; the request was aborted",
                                        type_="invalid_request_error", code="client_disconnected").response()
        return self._response()

    async def events(self) -> AsyncIterator[bytes]:
        """SSE events: a first chunk per choice (chat: the role; echo: the prompt), one per round
        of each choice as they land, each choice's finish, usage, [DONE]. An error ends the stream
        with OpenAI's error event, {"error": {...}}, and cancels the other choices."""
        for data in self._opening():
            yield self._sse(data)
        events: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(choice, events)) for choice in self.choices]
        try:
            running = len(pumps)
            while running:
                kind, data = await events.get()
                if kind == "done":
                    running -= 1
                    continue
                yield self._sse(data)
                if kind == "error":
                    self.cancel()
                    break
            else:
                for data in self._closing():
                    yield self._sse(data)
            yield self.terminator
        finally:
            for pump in pumps:
                pump.cancel()

    def _opening(self) -> list[dict[str, Any]]:
        """A stream's first chunks: per choice, chat's role (and echo) or completions' echo."""
        if self.chat:
            return [self._chunk(c, {"role": "assistant", "content": c.echo}) for c in self.choices]
        return [self._chunk(c, c.echo) for c in self.choices if c.echo]

    def _closing(self) -> list[dict[str, Any]]:
        """A stream's last chunks, after every choice's end: the usage chunk, if asked."""
        usage = self._usage_chunk()
        return [] if usage is None else [usage]

    async def _pump(self, choice: Choice, events: asyncio.Queue) -> None:
        """One choice's chunks into the stream's queue, then ("done", None); never silent
        on a fault, or the stream would wait for this choice forever."""
        try:
            while True:
                event = await self.api.next_event(choice.gen)
                if isinstance(event, Chunk):
                    for chunk in self._round_chunks(choice, event):
                        events.put_nowait(("chunk", chunk))
                elif isinstance(event, Final):
                    choice.final = event
                    for chunk in self._final_chunks(choice, event):
                        events.put_nowait(("chunk", chunk))
                    break
        except ApiError as exc:
            events.put_nowait(("error", exc.body()))
        except Exception as exc:  # noqa: BLE001 - reported to the client as OpenAI's error event
            log.exception("stream of %s failed", choice.gen.request_id)
            events.put_nowait(("error", ApiError(500, f"stream failed: {type(exc).__name__}: {exc}",
                                                 type_="server_error", code="internal_error").body()))
        events.put_nowait(("done", None))

    # --- building the objects ------------------------------------------------------

    def _response(self) -> JSONResponse:
        for choice in self.choices:
            _result(choice.final)  # any failed choice fails the response
        shown = self._selected()
        out = []
        for choice in shown:
            result = choice.final.result
            logprobs = self._logprobs(choice, result.logprobs)
            if not self.chat and self.body.echo and logprobs is not None:
                logprobs = _joined(self._prompt_logprobs(choice, result.prompt_logprobs), logprobs)
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": FINISH[choice.final.reason],
                                     "logprobs": logprobs}
            if self.chat:
                entry["message"] = self._message(choice, result.text, entry)
            else:
                entry["text"] = choice.echo + result.text
                if self.body.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = self._vllm_prompt_logprobs(choice, result.prompt_logprobs)
            if len(self.choices) > 1:
                entry["speculation_stats"] = _stats_json(choice.final.stats)
            out.append(entry)
        response = {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.body.model, "choices": out,
            "usage": self._usage(), "speculation_stats": _stats_json(self.choices[0].final.stats),
        }
        if self.chat and self.body.prompt_logprobs is not None:  # vLLM's chat has them once, beside the choices
            first = self.choices[0]
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(first, first.final.result.prompt_logprobs)
        return JSONResponse(response)

    def _selected(self) -> list[Choice]:
        """The choices to return: all, or with best_of, each prompt's n with the highest cumulative
        log-probability (vLLM's rule; under the law each token was sampled from), re-indexed."""
        n = self.body.n or 1
        best_of = getattr(self.body, "best_of", None) or n
        if best_of == n:
            return self.choices
        shown = []
        for prompt in sorted({c.prompt_index for c in self.choices}):
            group = [c for c in self.choices if c.prompt_index == prompt]
            group.sort(key=lambda c: (-sum(e.logprob for e in c.final.result.logprobs or []), c.sample))
            for rank, choice in enumerate(group[:n]):
                choice.index = prompt * n + rank
                shown.append(choice)
        return shown

    def _message(self, choice: Choice, text: str, entry: dict[str, Any]) -> dict[str, Any]:
        thought, text = _answer(choice, text)
        message: dict[str, Any] = {"role": "assistant", "content": choice.echo + text}
        if thought is not None:  # vLLM's name and DeepSeek's, which clients read
            message["reasoning"] = message["reasoning_content"] = thought
        if choice.tools is not None:
            content, calls = tooling.parse(text)
            message["content"] = choice.echo + (content or "") if choice.echo else content  # None: only calls
            if calls:
                message["tool_calls"] = calls
                entry["finish_reason"] = "tool_calls"
        return message

    def _round_chunks(self, choice: Choice, event: Chunk) -> list[dict[str, Any]]:
        """A round's chunk (none if it adds neither text nor logprobs)."""
        choice.tokens_out += len(event.token_ids)
        thought, text = choice.reasoning.feed(event.text) if choice.reasoning is not None else ("", event.text)
        delta = text if choice.tools is None else choice.tools.feed(text)
        logprobs = self._stream_logprobs(choice, event.logprobs)
        if not delta and not thought and logprobs is None:
            return []
        if not self.chat:
            return [self._chunk(choice, delta, logprobs=logprobs)]
        return [self._chunk(choice, _delta(thought, delta), logprobs=logprobs)]

    def _final_chunks(self, choice: Choice, final: Final) -> list[dict[str, Any]]:
        """The choice's last chunks: tool calls if any, then the finish with its stats (ApiError if it failed)."""
        result = _result(final)
        choice.tokens_out = len(result.token_ids)
        thought, delta = choice.reasoning.finish(final.text) if choice.reasoning is not None else ("", final.text)
        calls = []
        if choice.tools is not None:
            delta, calls = choice.tools.finish(delta)
        rest = (result.logprobs or [])[choice.logprobs_sent:]  # a remote engine sends them with the result
        chunks = []
        if calls:
            chunks.append(self._chunk(choice, {"tool_calls": [
                {"index": i, **call} for i, call in enumerate(calls)]}))
        finish = "tool_calls" if calls else FINISH[final.reason]
        last = self._chunk(choice, _delta(thought, delta) if self.chat else delta, finish,
                           self._stream_logprobs(choice, rest))
        last["speculation_stats"] = _stats_json(final.stats)
        return chunks + [last]

    def _usage_chunk(self) -> dict[str, Any] | None:
        options = self.body.stream_options
        if options is None or not options.include_usage:
            return None
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.body.model, "choices": [], "usage": self._usage()}

    def _chunk(self, choice: Choice, delta: Any, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": choice.index, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            entry["delta"] = delta
        else:
            entry["text"] = delta
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.body.model, "choices": [entry]}
        options = self.body.stream_options
        if options is not None and options.continuous_usage_stats:  # vLLM's: this choice's usage so far
            prompt = choice.gen.prompt_tokens
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": choice.tokens_out,
                              "total_tokens": prompt + choice.tokens_out}
        return chunk

    def _stream_logprobs(self, choice: Choice, entries: list[TokenLogprob]) -> Any:
        if not self.shown_logprobs or not entries:
            return None
        choice.logprobs_sent += len(entries)
        return self._logprobs(choice, entries)

    def _logprobs(self, choice: Choice, entries: list[TokenLogprob] | None) -> Any:
        """OpenAI's logprobs object: chat's `content` list, or the completions' parallel lists."""
        if entries is None or not self.shown_logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(choice, e) for e in entries]}
        ids = [e.token for e in entries]
        tokens = [self._token(choice, t) for t in ids]
        offsets = self._offsets(choice, ids, choice.text_offset)
        choice.text_offset = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self._token(choice, i): _finite(v) for i, v in e.top} for e in entries],
                "text_offset": offsets}

    def _prompt_logprobs(self, choice: Choice, entries: list[TokenLogprob]) -> dict[str, Any]:
        """Completions' echo with logprobs: the prompt's tokens, the first without a log-probability
        (nothing comes before it), as OpenAI's legacy completions lay them out."""
        n = self.body.logprobs
        ids = choice.gen.request.prompt_ids[:1] + [e.token for e in entries]
        return {"tokens": [self._token(choice, t) for t in ids],
                "token_logprobs": [None] + [_finite(e.logprob) for e in entries],
                "top_logprobs": [None] + [{self._token(choice, i): _finite(v) for i, v in e.top[:n]}
                                          for e in entries],
                "text_offset": self._offsets(choice, ids, 0)[:-1]}

    def _vllm_prompt_logprobs(self, choice: Choice, entries: list[TokenLogprob]) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank,
        decoded_token}} for the token itself and the prompt_logprobs most likely."""
        def one(token: int, value: float, rank: int) -> dict[str, Any]:
            return {"logprob": _finite(value), "rank": rank, "decoded_token": self._token(choice, token)}

        out: list[dict[str, Any] | None] = [None]
        for e in entries:
            view = {str(e.token): one(e.token, e.logprob, e.rank)}
            for rank, (token, value) in enumerate(e.top[: self.body.prompt_logprobs], start=1):
                view.setdefault(str(token), one(token, value, rank))
            out.append(view)
        return out

    def _chat_entry(self, choice: Choice, entry: TokenLogprob) -> dict[str, Any]:
        def one(token: int, value: float) -> dict[str, Any]:
            text = self._token(choice, token)
            return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

        return one(entry.token, entry.logprob) | {"top_logprobs": [one(i, v) for i, v in entry.top]}

    def _token(self, choice: Choice, token: int) -> str:
        """A token as logprobs show it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token}"
        return choice.gen.decode([token])

    @staticmethod
    def _offsets(choice: Choice, ids: list[int], at: int) -> list[int]:
        """Where each token's text starts in the choice's text (text_offset), from `at`; one more
        entry at the end: where the next token's starts."""
        out = [at]
        for token in ids:
            out.append(out[-1] + len(choice.gen.decode([token])))
        return out

    def _usage(self) -> dict[str, Any]:
        """Each prompt counted once; every sample's tokens (best_of's unreturned ones too, as OpenAI bills them);
        OpenAI's cached_tokens: the prompt tokens the prefix cache served (ssd.engine.prefix)."""
        firsts = [c for c in self.choices if c.sample == 0]
        prompt = sum(c.gen.prompt_tokens for c in firsts)
        cached = sum(c.final.stats.cached_prompt_tokens for c in firsts if c.final is not None and c.final.stats)
        completion = sum(len(c.final.result.token_ids) for c in self.choices
                         if c.final is not None and c.final.result is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _sse(self, data: dict[str, Any]) -> bytes:
        return format_sse_event(data_str=json.dumps(data, separators=(",", ":")))


class Keeper(Protocol):
    """Where a ResponsesCall keeps what it makes (ssd.openai.routes.responses)."""

    stored: ResponseStore

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation of that id, if it is kept."""

    def background_ended(self, call: ResponsesCall) -> None:
        """A background response's run ended."""


class ResponsesCall(Call):
    """One /v1/responses request: its one chat choice (ssd.openai.responses), laid out as Responses
    output items (a reasoning item first where the model thought, the message, the function
    calls); streamed as Responses events, each with its type and sequence_number."""

    terminator = b""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, api: Api, keeper: Keeper, chat: Any, choices: list[Choice], body: Any,
                 earlier: list[dict[str, Any]]) -> None:
        super().__init__(api, chat, choices, chat=True)
        self.keeper = keeper
        self.request_body = body
        self.earlier = earlier  # the stored conversation it continues
        self.store = body.store is not False and keeper.stored.capacity > 0
        given = body.input
        self.input_items = input_items(given if isinstance(given, str) else
                                       [item.model_dump(exclude_none=True) for item in given])
        self.cancelled = False  # a background response's cancel came
        self.deleted = False  # deleted while it ran: nothing it does later stores it again
        self.ended = False  # its finished response is built (and stored): too late to cancel
        self.failure: dict[str, Any] | None = None  # the error event its stream ended with
        self.task: asyncio.Task | None = None  # a background response's run
        self.log: list[bytes] = []  # a background response's events, for any stream that reads them
        self.log_done = False
        self._more = asyncio.Event()  # set (and replaced) when the log grows or ends
        self.id = responses.new_id("resp")
        self.created = responses.now()
        self.message_id, self.reasoning_id = responses.new_id("msg"), responses.new_id("rs")
        self.message_open = False
        self.thought = ""  # the reasoning streamed so far
        self.reasoning_state = ""  # "", "open", "done": the streamed reasoning item
        self.pending: list[TokenLogprob] = []  # logprobs waiting for the message's next text
        self.sequence = 0

    def _response(self) -> JSONResponse:
        choice = self.choices[0]
        _result(choice.final)
        return JSONResponse(self._kept(self._finished(choice)))

    def _finished(self, choice: Choice) -> dict[str, Any]:
        """The Response object at the end: the reasoning item, the message item (if any), the function calls."""
        result = choice.final.result
        thought, answer = _answer(choice, result.text)
        content, calls = tooling.parse(answer) if choice.tools is not None else (answer, [])
        status = "incomplete" if choice.final.reason == "length" else "completed"
        output = [responses.call_item(call) for call in calls]
        # A message unless the output is calls alone (or a stream already opened one).
        text = None if calls and not content and not self.message_open else content or ""
        if text is not None:
            output.insert(0, responses.message_item(self.message_id, text, self._item_logprobs(choice), status))
        if thought is not None:
            output.insert(0, responses.reasoning_item(self.reasoning_id, thought, status))
        cached = choice.final.stats.cached_prompt_tokens if choice.final.stats else 0
        usage = responses.usage(choice.gen.prompt_tokens, len(result.token_ids), cached)
        incomplete = "max_output_tokens" if status == "incomplete" else None
        return responses.response_object(self.request_body, self.id, self.created, status, output, usage,
                                         incomplete, stored=self.store)

    def snapshot(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object with no output yet: queued, in_progress, cancelled or failed."""
        return responses.response_object(self.request_body, self.id, self.created, status, [], error=error,
                                         stored=self.store)

    def save(self, response: dict[str, Any]) -> None:
        if self.deleted:
            return
        self.keeper.stored.put(StoredResponse(response, self.input_items, self.earlier))

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """The finished response, stored (OpenAI's default) with the items it continued; its
        input and output added to the conversation it names (unless that was deleted meanwhile)."""
        self.ended = True
        if self.store:
            self.save(response)
        named = responses.conversation_id(self.request_body)
        conversation = None if named is None else self.keeper.conversation(named)
        if conversation is not None:
            conversation.add(self.input_items + response["output"])
        return response

    # --- background: run on the event loop; polled through the store, or streamed from its log

    async def run_in_background(self) -> None:
        """Run the response's stream into its log (any number of readers: `replay`), storing the
        response as it goes: in_progress from its first tokens, then as it ended: completed or
        incomplete (stored by the stream's last chunks), cancelled, or failed with its error."""
        opening = len(self._opening())
        try:
            async for data in self.events():
                if data:
                    self._append(data)
                if len(self.log) == opening + 1 and not self.cancelled and not self.ended:
                    self.save(self.snapshot("in_progress"))
            if self.failure is not None and not self.cancelled:
                self.save(self.snapshot("failed", error={k: self.failure.get(k) for k in ("code", "message")}))
        except Exception as exc:  # noqa: BLE001 - the poller reads it as the response's error
            log.exception("background response %s failed", self.id)
            self.save(self.snapshot("failed", error={"code": "internal_error",
                                                     "message": f"{type(exc).__name__}: {exc}"}))
        finally:  # at once, with no await after the last save: a cancel now finds it ended
            self.log_done = True
            self._wake()
            self.keeper.background_ended(self)

    def _append(self, data: bytes) -> None:
        self.log.append(data)
        self._wake()

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()

    async def replay(self, after: int = -1) -> AsyncIterator[bytes]:
        """The logged events after sequence number `after`, then each as it comes, to the end."""
        index = after + 1
        while True:
            more = self._more
            while index < len(self.log):
                yield self.log[index]
                index += 1
            if self.log_done:
                return
            await more.wait()

    def delete_in_background(self) -> None:
        """DELETE while it runs: it stops (as a cancel does) and stays deleted; its stream ends
        with the cancel's error event."""
        self.deleted = True  # first: the cancel's own save stores nothing
        self.cancel_in_background()

    def cancel_in_background(self) -> dict[str, Any]:
        self.cancelled = True
        self.cancel()
        response = self.snapshot("cancelled")
        self.save(response)
        return response

    def _item_logprobs(self, choice: Choice) -> list[dict[str, Any]] | None:
        entries = choice.final.result.logprobs
        if not self.shown_logprobs or entries is None:
            return None
        return [self._chat_entry(choice, e) for e in entries]

    # --- the stream ----------------------------------------------------------------

    def _opening(self) -> list[dict[str, Any]]:
        created = responses.response_object(self.request_body, self.id, self.created, "in_progress", [],
                                            stored=self.store)
        return [{"type": "response.created", "response": created},
                {"type": "response.in_progress", "response": created}]

    def _closing(self) -> list[dict[str, Any]]:
        return []

    def _round_chunks(self, choice: Choice, event: Chunk) -> list[dict[str, Any]]:
        thought, text = choice.reasoning.feed(event.text) if choice.reasoning is not None else ("", event.text)
        delta = text if choice.tools is None else choice.tools.feed(text)
        self.pending += event.logprobs or []
        out = self._reasoning_delta(choice, thought)
        if delta or (self.message_open and self.pending):
            out += self._text_delta(choice, delta)
        return out

    def _final_chunks(self, choice: Choice, final: Final) -> list[dict[str, Any]]:
        if self.cancelled:  # a background response's cancel: the stream's error event says so
            raise ApiError(400, "the response was cancelled (POST /v1/responses/{id}/cancel)", code="cancelled")
        _result(final)  # a failed choice: ApiError, the stream's error event
        thought, delta = choice.reasoning.finish(final.text) if choice.reasoning is not None else ("", final.text)
        if choice.tools is not None:
            delta, _ = choice.tools.finish(delta)
        self.pending = (final.result.logprobs or [])[choice.logprobs_sent:]  # all not yet sent
        response = self._kept(self._finished(choice))
        out = self._reasoning_delta(choice, thought)
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":
                out += self._reasoning_end(item)
            elif item["type"] == "message":
                if delta or self.pending:
                    out += self._text_delta(choice, delta)
                out += self._reasoning_end() + self._message_end(item)
            else:
                out += self._reasoning_end() + self._call_events(index, item)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [{"type": kind, "response": response}]

    def _reasoning_delta(self, choice: Choice, thought: str) -> list[dict[str, Any]]:
        """The reasoning item's added event, once the stream saw a thinking (even an empty one),
        and a delta of its text."""
        out = []
        if not self.reasoning_state and choice.reasoning is not None and choice.reasoning.thought:
            self.reasoning_state = "open"
            out.append({"type": "response.output_item.added", "output_index": 0, "item": {
                "type": "reasoning", "id": self.reasoning_id, "status": "in_progress", "summary": [], "content": []}})
        if thought:
            self.thought += thought
            out.append({"type": "response.reasoning_text.delta", "item_id": self.reasoning_id, "output_index": 0,
                        "content_index": 0, "delta": thought})
        return out

    def _reasoning_end(self, item: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The reasoning item's done events, once, before the message or calls (none without one)."""
        if self.reasoning_state != "open":
            return []
        self.reasoning_state = "done"
        item = item or responses.reasoning_item(self.reasoning_id, self.thought, "completed")
        return [{"type": "response.reasoning_text.done", "item_id": self.reasoning_id, "output_index": 0,
                 "content_index": 0, "text": item["content"][0]["text"]},
                {"type": "response.output_item.done", "output_index": 0, "item": item}]

    def _text_delta(self, choice: Choice, delta: str) -> list[dict[str, Any]]:
        """A delta of the message's text (closing the reasoning and opening the message first),
        with the logprobs waiting."""
        logprobs = self._stream_logprobs(choice, self.pending)
        self.pending = []
        text = self._text_event("response.output_text.delta", delta=delta, logprobs=(logprobs or {}).get("content", []))
        return self._reasoning_end() + self._open_message() + [text]

    def _message_end(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The message's done events (opening it, if no text came before)."""
        part = message["content"][0]
        return self._open_message() + [
            self._text_event("response.output_text.done", text=part["text"], logprobs=part["logprobs"]),
            self._text_event("response.content_part.done", part=part),
            {"type": "response.output_item.done", "output_index": self._message_index(), "item": message}]

    def _call_events(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A function call item's events: added, its arguments in one piece, done."""
        where = {"item_id": item["id"], "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": item | {"arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **where, "name": item["name"],
                 "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _open_message(self) -> list[dict[str, Any]]:
        """The message item's and its text part's added events, once, before its first text."""
        if self.message_open:
            return []
        self.message_open = True
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                "content": []}
        return [{"type": "response.output_item.added", "output_index": self._message_index(), "item": item},
                self._text_event("response.content_part.added",
                                 part={"type": "output_text", "text": "", "annotations": []})]

    def _message_index(self) -> int:
        return 1 if self.reasoning_state else 0

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "item_id": self.message_id, "output_index": self._message_index(),
                "content_index": 0, **fields}

    def _sse(self, data: dict[str, Any]) -> bytes:
        if "type" not in data:  # an ApiError's body: the Responses error event
            data = self.failure = {**data["error"], "type": "error"}
        data = data | {"sequence_number": self.sequence}
        self.sequence += 1
        return format_sse_event(data_str=json.dumps(data, separators=(",", ":")), event=data["type"])


def _answer(choice: Choice, text: str) -> tuple[str | None, str]:
    """(the thinking, or None; the answer) of a chat choice's whole text."""
    return (None, text) if choice.thinks_first is None else split_reasoning(text, choice.thinks_first)


def _delta(thought: str, content: str) -> dict[str, Any]:
    """A chat chunk's delta: the answer's text, and the thinking's where some came (both names)."""
    return {"content": content} | ({"reasoning": thought, "reasoning_content": thought} if thought else {})


def _result(final: Final) -> Any:
    """A choice's result, or the ApiError its end means: the request's own failure (400: its
    grammar failed mid-run), an engine failure (500; 503 when the backend was lost) or an abort (503: the server is shutting down). OpenAI's finish reasons only."""
    if final.refused:
        raise invalid(final.error)
    if final.error is not None:
        status = 503 if final.unavailable else 500
        raise ApiError(status, f"generation failed: {type(final.error).__name__}: {final.error}",
                       type_="server_error", code="generation_failed")
    if final.result is None or final.reason not in FINISH:
        raise ApiError(503, "the request was aborted (the server is shutting down)",
                       type_="server_error", code="aborted")
    return final.result


class JobStream(EventSourceResponse):
    """An SSE response that cancels its job however it ends (finished, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _stats_json(stats: RequestStats) -> dict[str, Any]:
    """The request's stats as the gRPC API's RequestStats reads in JSON (proto field names; map
    keys as strings; a non-finite number as "NaN"/"Infinity"), the mode by name."""
    return _json_value(dataclasses.asdict(stats))


def _json_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _finite(value: float) -> float:
    return value if value > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _joined(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """Two completions logprobs objects as one: their parallel lists end to end."""
    return {key: first[key] + then[key] for key in first}
