"""The OpenAI API as clients use it, through the official `openai` package on a live loopback server.

OpenAI's defaults (temperature 1, top_p 1, a random seed, max_tokens up to
the context) where the config sets none; n > 1, best_of, lists of prompts
(text or token ids), echo and GET /v1/models/{id}; logit_bias and penalties
(through the wire == the engine with the same processing, so exactness
carries over from tests/test_processing.py); structured output
(response_format json_object / json_schema, structured_outputs and guided_*)
and tool calls in the Qwen2.5 format (tools, tool_choice none / auto /
required / named, streamed, and assistant + tool messages sent back).

Models: the tiny fp64 pair. JSON needs '"', '{' and digits, so the
structured-output and tool tests serve a tiny pair with an 85-token
vocabulary (ssd.models.tokenizer's alphabet up to '"'), greedy by the
config's serve_defaults, behind a stand-in chat template that also lays out
tools (the real Qwen2.5 template over HTTP: tests/test_real_pair_http.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from typing import Any

import grpc
import httpx
import openai
import pytest

from ssd.config import GenerationConfig, RequestDefaults, SamplingConfig, load_config
from ssd.engine import grammar
from ssd.engine.request import GenerationRequest, Processing
from ssd.factory import make_engine
from ssd.openai import tools as tooling
from ssd.openai.calls import _result
from ssd.openai.common import ApiError
from ssd.serve.backend import LocalBackend
from ssd.serve.client import GenerationClient
from ssd.serve.service import Final
from ssd.serve.validation import choice_seed
from tests.conftest import ROOT
from tests.test_http import PROMPT, ChatBackend, base_url, oai, serving

ROLE = {"system": "s", "user": "u", "assistant": "a", "tool": "t"}


class ToolTemplate(ChatBackend):
    """A stand-in chat template for the tiny tokenizer that takes tools and tool messages:
    each message is its role's letter and content (an assistant's calls as Qwen2.5 writes
    them), the tools' names after "T", and the generation prompt is "\\n"."""

    def apply_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        parts = ["T" + " ".join(t["function"]["name"] for t in tools)] if tools else []
        for m in messages:
            calls = "".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in m.get("tool_calls") or [])
            parts.append(ROLE[m["role"]] + m["content"] + calls)
        return self.inner.encode("\n".join(parts) + "\n")


def _config(vocab: int | None = None, openai_defaults: bool = False):
    config = load_config(ROOT / "configs" / "tiny.yaml")
    if vocab is not None:
        config.target.tiny = dataclasses.replace(config.target.tiny, vocab_size=vocab)
        config.draft.tiny = dataclasses.replace(config.draft.tiny, vocab_size=vocab)
    if openai_defaults:
        config.serve_defaults = RequestDefaults()
    return config


@pytest.fixture(scope="module")
def plain():
    """The tiny pair with OpenAI's defaults (no serve_defaults)."""
    backend = LocalBackend(_config(openai_defaults=True))
    with serving(lambda: ChatBackend(backend)) as srv:
        yield srv, backend
    backend.close()


@pytest.fixture(scope="module")
def wide():
    """An 85-token tiny pair (JSON's characters), greedy by default, with a tool-aware template."""
    backend = LocalBackend(_config(vocab=85))
    with serving(lambda: ToolTemplate(backend)) as srv:
        yield srv, backend
    backend.close()


def direct(backend, prompt_ids, mode="ar", temperature=0.0, seed=0, max_new=24, processing=None, **generation):
    """The same request through a fresh engine, no server (`generation`: GenerationConfig's other fields)."""
    speculation = dataclasses.replace(backend.config.speculation, mode=mode)
    engine = make_engine(mode, backend.pair, speculation)
    try:
        return engine.generate(GenerationRequest(prompt_ids, SamplingConfig(temperature=temperature, seed=seed),
                                                 GenerationConfig(max_new_tokens=max_new, **generation),
                                                 speculation, processing=processing))
    finally:
        engine.close()


def texts(reply) -> dict[int, str]:
    return {c.index: c.text for c in reply.choices}


# --- OpenAI's defaults and values ---------------------------------------------------------------


def test_models_card_and_retrieve_say_which_defaults_apply(plain):
    srv, _ = plain
    client = oai(srv)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    assert card.model_extra["defaults"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
                                            "coupling": "auto", "max_tokens": None}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc:
        defaults = grpc.model_info().defaults
        assert defaults.temperature == 1.0 and defaults.top_p == 1.0 and defaults.random_seed
        assert defaults.coupling == "auto"


def test_an_omitted_temperature_samples_at_one(plain):
    srv, _ = plain
    client = oai(srv)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    sampled = []
    for seed in (1, 2, 3):
        omitted = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed).choices[0].text
        given = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed, temperature=1.0,
                                          top_p=1.0).choices[0].text
        assert omitted == given
        sampled.append(omitted)
    assert any(text != greedy for text in sampled)


def test_an_omitted_seed_is_fresh_per_request_over_http_and_grpc(plain):
    srv, _ = plain
    client = oai(srv)
    outs = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24).choices[0].text for _ in range(4)}
    assert len(outs) > 1
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc:
        outs = {grpc.generate(text=PROMPT, max_new_tokens=24).text for _ in range(4)}
    assert len(outs) > 1


def test_an_omitted_max_tokens_runs_to_the_context(plain):
    srv, backend = plain
    reply = oai(srv).completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                        extra_body={"speculation": {"mode": "ar"}})
    context = backend.info.max_context_tokens
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == context - reply.usage.prompt_tokens


def test_an_aborted_or_failed_request_is_an_error_never_a_finish_reason():
    """The engine's "aborted" (shutdown) is a 503 error; OpenAI's finish reasons only otherwise."""
    with pytest.raises(ApiError) as info:
        _result(Final("aborted", "", result=object(), error=None, stats=None))
    assert info.value.status == 503 and info.value.code == "aborted"
    with pytest.raises(ApiError) as info:
        _result(Final("error", "", result=None, error=RuntimeError("boom"), stats=None))
    assert info.value.status == 500 and info.value.code == "generation_failed"


# --- n, best_of, prompt lists, echo -------------------------------------------------------------


def test_n_choices_are_rows_each_reproducible_by_its_derived_seed(plain):
    srv, _ = plain
    client = oai(srv)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0)
    reply = client.completions.create(n=3, seed=11, **kwargs)
    assert sorted(texts(reply)) == [0, 1, 2] and len(set(texts(reply).values())) > 1
    for i, text in texts(reply).items():
        alone = client.completions.create(seed=choice_seed(11, i), **kwargs).choices[0].text
        assert text == alone, i
    assert texts(reply)[0] == client.completions.create(seed=11, **kwargs).choices[0].text
    assert reply.usage.completion_tokens == 48 and reply.usage.prompt_tokens == len(PROMPT)


def test_chat_n_streams_each_choice_by_index(plain):
    srv, _ = plain
    client = oai(srv)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "cab"}], max_tokens=12, n=2, seed=4,
                  temperature=1.0)
    whole = {c.index: c.message.content for c in client.chat.completions.create(**kwargs).choices}
    streamed: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finished.add(c.index)
    assert streamed == whole and finished == {0, 1}


def test_best_of_returns_the_most_likely_sample(plain):
    srv, _ = plain
    client = oai(srv)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0)
    reply = client.completions.create(best_of=3, seed=5, **kwargs)
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    candidates = []
    for i in range(3):
        alone = client.completions.create(seed=choice_seed(5, i), logprobs=0, **kwargs).choices[0]
        candidates.append((sum(alone.logprobs.token_logprobs), alone.text))
    assert reply.choices[0].text == max(candidates)[1]
    assert reply.usage.completion_tokens == 30  # every sample counts


def test_a_list_of_prompts_text_or_ids(plain):
    srv, backend = plain
    client = oai(srv)
    prompts = ["abc", "bca"]
    reply = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=3)
    assert sorted(texts(reply)) == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0,
                                              seed=choice_seed(3, i)).choices[0].text
            assert texts(reply)[p * 2 + i] == alone
    ids = [backend.encode(p) for p in prompts]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    assert texts(by_ids) == texts(by_text) and reply.usage.prompt_tokens == 6


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_output(plain, stream):
    srv, _ = plain
    client = oai(srv)
    plain_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True, stream=True) if c.choices)
    else:
        text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                         echo=True).choices[0].text
    assert text == PROMPT + plain_text


# --- logit_bias and penalties ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_logit_bias_and_penalties_through_the_wire_equal_the_engine(plain, mode):
    srv, backend = plain
    client = oai(srv)
    body = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, frequency_penalty=1.5,
                presence_penalty=0.5, logit_bias={"2": 3.0, "0": -2.0}, extra_body={"speculation": {"mode": mode}})
    got = client.completions.create(**body).choices[0].text
    spec = Processing(((0, -2.0), (2, 3.0)), 0.5, 1.5)
    want = direct(backend, backend.encode(PROMPT), "ar", max_new=20, processing=spec)
    assert got == want.text
    assert got != direct(backend, backend.encode(PROMPT), "ar", max_new=20).text


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_vllms_repetition_penalty_and_min_tokens_through_the_wire_equal_the_engine(plain, mode):
    """Extra body fields over HTTP and GenerateRequest fields over gRPC: the engine's output with
    the same processing, which differs from the output without. min_tokens here holds back a
    stop string the output meets at its second token (the tiny model has no EOS)."""
    srv, backend = plain
    client, ids = oai(srv), backend.encode(PROMPT)
    extra = {"speculation": {"mode": mode}, "repetition_penalty": 1.8}
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra)
    want = direct(backend, ids, max_new=20, processing=Processing(repetition_penalty=1.8)).text
    assert got.choices[0].text == want != direct(backend, ids, max_new=20).text
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc:
        assert grpc.generate(text=PROMPT, mode=mode, temperature=0, max_new_tokens=20,
                             repetition_penalty=1.8).text == want
        stop = direct(backend, ids, max_new=20).text[1]
        held = direct(backend, ids, max_new=20, stop=[stop], min_tokens=6)
        assert len(held.token_ids) > 6 and len(direct(backend, ids, max_new=20, stop=[stop]).token_ids) <= 2
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                        extra_body={"speculation": {"mode": mode}, "min_tokens": 6})
        assert got.choices[0].text == held.text
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                           stream=True, extra_body={"speculation": {"mode": mode}, "min_tokens": 6})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == held.text
        assert grpc.generate(text=PROMPT, mode=mode, temperature=0, max_new_tokens=20, stop=[stop],
                             min_tokens=6).text == held.text


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_vllms_stop_token_ids_include_stop_str_allowed_ids_and_bad_words_through_the_wire(plain, mode):
    """The engine's output with the same settings, over HTTP (streamed too) and gRPC: a stop token
    ends the output at the same token and stays in it, a stop string can stay in the text,
    allowed_token_ids bound the output and bad_words keep a word out of it (each differs from
    the free output)."""
    srv, backend = plain
    client, ids = oai(srv), backend.encode(PROMPT)
    free = direct(backend, ids, max_new=20)
    cases = [  # (HTTP extra body, gRPC fields, the engine's request)
        ({"stop_token_ids": [free.token_ids[3]]}, {"stop_token_ids": [free.token_ids[3]]},
         {"stop_token_ids": [free.token_ids[3]]}),
        ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True, "stop": [free.text[2:4]]},
         {"include_stop_str_in_output": True, "stop": [free.text[2:4]]}),
        ({"allowed_token_ids": [1, 2, 5]}, {"allowed_token_ids": [1, 2, 5]},
         {"processing": Processing(allowed_token_ids=(1, 2, 5))}),
        ({"bad_words": [free.text[2:4]]}, {"bad_words": [free.text[2:4]]},  # " " is not in the tiny vocabulary
         {"processing": Processing(bad_words=(tuple(backend.encode(free.text[2:4])),))}),
    ]
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc:
        for extra, fields, engine_fields in cases:
            want = direct(backend, ids, max_new=20, **engine_fields)
            assert want.text != free.text and len(want.token_ids) > 1
            stop = engine_fields.get("stop")
            body = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                        extra_body={"speculation": {"mode": mode}, **extra})
            assert client.completions.create(**body).choices[0].text == want.text
            chunks = client.completions.create(**body, stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
            assert grpc.generate(text=PROMPT, mode=mode, temperature=0, max_new_tokens=20, **fields).text == want.text


# --- structured output ------------------------------------------------------------------------


def test_json_mode_and_json_schema(wide):
    srv, _ = wide
    client = oai(srv)
    messages = [{"role": "user", "content": "give json"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=40, temperature=temperature, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "digits", "schema": schema}})
        value = json.loads(reply.choices[0].message.content)
        assert isinstance(value, list) and len(value) <= 3 and all(0 <= v <= 9 for v in value)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_regex_through_the_wire_is_the_masked_ar_output(wide, mode):
    srv, backend = wide
    regex = "(ab|ba|c)+d"
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt="abc", max_tokens=30, temperature=0,
                      extra_body={"structured_outputs": {"regex": regex}, "speculation": {"mode": mode}})
        if stream:
            text = "".join(c.choices[0].text for c in oai(srv).completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = oai(srv).completions.create(**kwargs).choices[0].text
        want = direct(backend, backend.encode("abc"), max_new=30, processing=Processing(grammar=grammar.regex(regex)))
        assert text == want.text and (re.fullmatch(regex, text) or len(want.token_ids) == 30)


def test_guided_choice(wide):
    srv, _ = wide
    for seed in range(3):
        reply = oai(srv).completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=1.0, seed=seed,
                                            extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert reply.choices[0].text in ("yes", "no", "maybe") and reply.choices[0].finish_reason == "stop"


# --- grammars llguidance cannot follow ------------------------------------------------------------
# Each compiles (llguidance's own check passes it) and meets one of llguidance's limits only as
# it parses its first token: refused at admission, a 400 naming the field, before it takes a row.
MANY = 3001  # over llguidance's 2000 items in a parser row
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # 50000 items
SELF_TOOL = {"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}
UNFOLLOWABLE = [
    ("completions", {"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex",
     "too many expressions"),
    ("completions", {"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
    ("completions", {"structured_outputs": {"choice": [f"c{i}" for i in range(MANY)]}}, "structured_outputs.choice",
     "items"),
    ("completions", {"guided_choice": [f"c{i}" for i in range(MANY)]}, "guided_choice", "items"),
    ("completions", {"structured_outputs": {"grammar": "start: " + " | ".join(f'"a{i}"' for i in range(MANY))}},
     "structured_outputs.grammar", "items"),
    ("completions", {"guided_json": RECURSIVE}, "guided_json", "Too many items"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": RECURSIVE}}},
     "response_format.json_schema.schema", "Too many items"),
    ("chat", {"tools": [SELF_TOOL], "tool_choice": "required"}, "tool_choice", "Too many items"),
]


@pytest.mark.parametrize("route,extra,field,why", UNFOLLOWABLE, ids=[case[2] for case in UNFOLLOWABLE])
def test_a_grammar_llguidance_cannot_follow_is_refused_naming_its_field(wide, route, extra, field, why):
    srv, _ = wide
    body = {"model": "tiny", "max_tokens": 8, **extra}
    body |= {"prompt": "abcab"} if route == "completions" else {"messages": ASK}
    for stream in (False, True):
        reply = httpx.post(f"{base_url(srv)}/v1/{'chat/' if route == 'chat' else ''}completions",
                           json=body | {"stream": stream}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == field and error["message"].startswith(field) and why in error["message"], error
        assert error["type"] == "invalid_request_error" and "<state>" not in error["message"]
    assert httpx.get(base_url(srv) + "/health").status_code == 200


def test_a_grammar_llguidance_cannot_follow_is_invalid_argument_over_grpc(wide):
    srv, _ = wide
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc_client:
        with pytest.raises(grpc.RpcError) as info:
            grpc_client.generate(text="abc", max_new_tokens=8, structured={"regex": "a{1000000}"})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too many expressions" in info.value.details()


# After "ab" the lexeme /ab+/ may end, and the +100 bias on "c" ends it: "c" starts `rest`, whose
# 3001 alternatives llguidance refuses then, at the third token: admission (which takes a first
# token) passes it, and the row fails mid-run.
LATE_FAILURE = {"structured_outputs": {"grammar": 'start: /ab+/ rest\nrest: ' + " | ".join(f'"c{i}"' for i in range(MANY))}}


def test_a_grammar_that_fails_mid_run_ends_that_request_alone_with_a_400(wide):
    srv, backend = wide
    bias = {str(backend.encode("c")[0]): 100}
    client = oai(srv)
    for mode in ("ar", "sd", "ssd"):
        fine = {}
        reader = threading.Thread(target=lambda: fine.update(text=client.completions.create(
            model="tiny", prompt="abc", max_tokens=30, temperature=0).choices[0].text))
        reader.start()  # a row beside the failing one
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 30, "logit_bias": bias,
                "speculation": {"mode": mode}, **LATE_FAILURE}
        reply = httpx.post(base_url(srv) + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "structured_outputs.grammar" and "items" in error["message"], error
        streamed = httpx.post(base_url(srv) + "/v1/completions", json=body | {"stream": True}, timeout=60)
        events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["param"] == "structured_outputs.grammar", events
        reader.join(60)
        assert fine["text"] == direct(backend, backend.encode("abc"), max_new=30).text
    assert httpx.get(base_url(srv) + "/health").status_code == 200


# --- tool calls ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in paris"}]


def test_a_named_function_is_called_with_valid_arguments(wide):
    srv, _ = wide
    reply = oai(srv).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_required_calls_some_tool_and_streams_the_calls(wide):
    srv, _ = wide
    # One call: the tiny model has no EOS, so after a call it could only go on calling.
    kwargs = dict(model="tiny", messages=ASK, max_tokens=200, tools=[WEATHER, TIME], tool_choice="required",
                  temperature=1.0, seed=2, parallel_tool_calls=False)
    whole = oai(srv).chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    names = [c.function.name for c in whole.message.tool_calls]
    assert set(names) <= {"get_weather", "get_time"}
    streamed, finish = [], None
    for chunk in oai(srv).chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_results_go_back_and_none_calls_nothing(wide):
    srv, _ = wide
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = oai(srv).chat.completions.create(model="tiny", messages=history, max_tokens=8, tools=[WEATHER],
                                             tool_choice="none")
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None


def test_tool_call_parsing_whole_and_streamed():
    text = 'let me check<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = tooling.parse(text)
    assert content == "let me check" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert tooling.parse("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
    stream = tooling.ToolStream()
    sent = "".join(stream.feed(piece) for piece in ["let me ch", "eck<tool", "_call>\n{\"name\": \"f\", "])
    rest, streamed = stream.finish('"arguments": {"x": 1}}\n</tool_call>')
    assert sent + rest == "let me check" and [c["function"] for c in streamed] == [calls[0]["function"]]
    plain = tooling.ToolStream()
    assert plain.feed("a <tool") == "a " and plain.finish("s>") == ("<tools>", [])


# --- the same over gRPC ---------------------------------------------------------------------------


def test_grpc_takes_the_same_processing_and_structured_output(wide):
    srv, backend = wide
    regex = "(ab|ba|c)+d"
    with GenerationClient(f"127.0.0.1:{srv.port}") as grpc:
        out = grpc.generate(text="abc", mode="sd", max_new_tokens=30, structured={"regex": regex})
        biased = grpc.generate(text="abc", mode="sd", max_new_tokens=20, logit_bias={2: 3.0},
                               frequency_penalty=1.5)
    http = oai(srv).completions.create(model="tiny", prompt="abc", max_tokens=30,
                                       extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
    assert out.text == http
    want = direct(backend, backend.encode("abc"), max_new=20, processing=Processing(((2, 3.0),), 0.0, 1.5))
    assert biased.text == want.text


def test_logprobs_are_the_masked_law(wide):
    """Under a grammar the reported distribution is the masked one: the allowed tokens carry all
    of the mass, sampled (T = 1) and greedy (log-softmax of the masked logits)."""
    srv, _ = wide
    for temperature in (0.0, 1.0):
        choice = oai(srv).completions.create(
            model="tiny", prompt="abc", max_tokens=6, temperature=temperature, seed=3, logprobs=2,
            extra_body={"guided_regex": "[ab]+"}).choices[0]
        assert re.fullmatch("[ab]+", choice.text)
        for top in choice.logprobs.top_logprobs:
            assert set(top) == {"a", "b"} and abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-9
