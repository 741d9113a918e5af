"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client.

A Responses request is the chat completion it means (ssd.openai.responses), so
exactness is the chat path's: each test checks that the prompt is the chat
prompt the input describes (instructions, messages, function calls and their
outputs) and that the output is the engine's for those ids, laid out as
Responses items; streamed events add up to the whole response. Errors name the
Responses field. The server is tests/test_openai_api.py's 85-token tiny pair
behind its tool-aware stand-in template (greedy by the config's serve_defaults).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.test_http import base_url, oai, serving
from tests.test_serve import ControlledBackend
from tests.test_openai_api import TIME, WEATHER, ToolTemplate, direct, wide  # noqa: F401 - the fixture

ASK = "weather in paris"
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]


def expected(backend, messages: list[dict], mode: str = "ar", max_new: int = 12, tools=None) -> str:
    """The engine's greedy text for the chat prompt `messages` render to."""
    ids = ToolTemplate(backend).apply_chat(messages, tools)
    return backend.decode(direct(backend, ids, mode, max_new=max_new).token_ids)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_text_is_the_engines_for_the_chat_prompt(wide, mode):
    srv, backend = wide
    reply = oai(srv).responses.create(model="tiny", input="abc", instructions="be brief", max_output_tokens=12,
                                      extra_body={"speculation": {"mode": mode}})
    want = expected(backend, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}], mode)
    assert reply.output_text == want and reply.object == "response" and reply.id.startswith("resp_")
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].text == want
    assert reply.status == message.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    prompt = len(ToolTemplate(backend).apply_chat([{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "abc"}]))
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (prompt, 12, prompt + 12)


def test_streamed_events_add_up_to_the_response(wide):
    srv, _ = wide
    kwargs = dict(model="tiny", input=[{"role": "developer", "content": "x"}, {"role": "user", "content": "abc"}],
                  max_output_tokens=10, include=["message.output_text.logprobs"], top_logprobs=2)
    whole = oai(srv).responses.create(**kwargs)
    events = list(oai(srv).responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-4].text
    streamed = [lp.model_dump() for e in deltas for lp in e.logprobs]
    assert streamed == [lp.model_dump() for lp in whole.output[0].content[0].logprobs] and len(streamed) == 10
    assert all(len(lp["top_logprobs"]) == 2 for lp in streamed)
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage


def test_logprobs_are_the_chat_ones(wide):
    srv, _ = wide
    reply = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=6, top_logprobs=1,
                                      include=["message.output_text.logprobs"])
    chat = oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                            max_tokens=6, logprobs=True, top_logprobs=1)
    assert [lp.model_dump() for lp in reply.output[0].content[0].logprobs] == [
        e.model_dump() for e in chat.choices[0].logprobs.content]


def test_a_named_function_call_and_its_output_go_back_as_chat_tool_messages(wide):
    srv, backend = wide
    reply = oai(srv).responses.create(model="tiny", input=ASK, tools=FUNCTIONS, max_output_tokens=200,
                                      tool_choice={"type": "function", "name": "get_weather"},
                                      parallel_tool_calls=False)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str) and reply.status == "completed"
    events = list(oai(srv).responses.create(stream=True, model="tiny", input=ASK, tools=FUNCTIONS,
                                            max_output_tokens=200, parallel_tool_calls=False,
                                            tool_choice={"type": "function", "name": "get_weather"}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments] and events[-1].type == "response.completed"
    assert not any(e.type.startswith("response.output_text") for e in events)  # calls alone: no message
    # The agent loop: the call and its output sent back, as the chat's assistant and tool messages.
    turn = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    back = oai(srv).responses.create(model="tiny", input=turn, tools=FUNCTIONS, tool_choice="none",
                                     max_output_tokens=12)
    assert back.output_text == expected(backend, answered_chat(call))


def answered_chat(call, output: str = "sunny") -> list[dict]:
    """The chat an ASK, the model's function call and the call's output make."""
    return [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
            {"role": "tool", "content": output, "tool_call_id": call.call_id}]


def test_text_format_json_schema_is_structured_output(wide):
    srv, _ = wide
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert isinstance(json.loads(reply.output_text)["n"], int) and reply.status == "completed"
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "conversation": {"id": 1}}, "conversation.id"),
    ({"input": "a", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "a", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"input": "a", "include": ["file_search_call.results"]}, "include"),
    ({"input": "a", "top_logprobs": 2}, "top_logprobs"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "a", "temperature": -1.0}, "temperature"),
    ({"input": "a", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "a", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "a", "tools": FUNCTIONS + FUNCTIONS[:1]}, "tools[2].name"),
    ({"input": "a", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ({"input": "a", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "a", "instructions": "", "min_p": 2.0}, "min_p"),
])
def test_errors_name_the_responses_field(wide, body, param):
    reply = httpx.post(base_url(wide[0]) + "/v1/responses", json={"model": "tiny"} | body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": ")


def test_an_engine_fault_is_a_500_or_the_streams_error_event(wide):
    _, backend = wide
    with serving(lambda: ControlledBackend(ToolTemplate(backend), fail_after_rounds=2)) as srv:
        with pytest.raises(openai.InternalServerError) as info:
            oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=20)
        assert "injected engine fault" in info.value.body["message"]
        reply = httpx.post(base_url(srv) + "/v1/responses", timeout=30,
                           json={"model": "tiny", "input": "abc", "max_output_tokens": 20, "stream": True})
        events = [json.loads(line.removeprefix("data: ")) for line in reply.text.splitlines()
                  if line.startswith("data: ")]
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"
        assert events[-1]["code"] == "generation_failed" and "injected engine fault" in events[-1]["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_openais_hints_are_taken_and_change_nothing(wide):
    """prompt_cache_key and safety_identifier (OpenAI's hints) are accepted on chat, completions
    and Responses, echoed where OpenAI echoes them, and the output is the one without them."""
    srv, _ = wide
    client, hints = oai(srv), {"prompt_cache_key": "chat-7", "safety_identifier": "user-hash"}
    reply = client.responses.create(model="tiny", input="abc", max_output_tokens=6, **hints)
    assert (reply.prompt_cache_key, reply.safety_identifier) == ("chat-7", "user-hash")
    assert reply.output_text == client.responses.create(model="tiny", input="abc", max_output_tokens=6).output_text
    chat = [{"role": "user", "content": "abc"}]
    with_hints = client.chat.completions.create(model="tiny", messages=chat, max_tokens=6, **hints)
    assert with_hints.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=6).choices[0].message.content
    assert client.completions.create(model="tiny", prompt="abc", max_tokens=4, extra_body=hints).choices[0].text == \
        client.completions.create(model="tiny", prompt="abc", max_tokens=4).choices[0].text
