"""The real pair's chat template over HTTP, through the `openai` client (slow).

Qwen2.5-Coder 1.5B + 0.5B (llama.cpp, the shipped GGUF files), served with
the OpenAI API on loopback, SD by default:
- a chat's greedy output equals AR on the ids the real template renders
  (prompt_tokens equal to the template's count);
- tool_choice named: the template lays out the tools, the grammar forces a
  well-formed `<tool_call>` for the function, parsed into message.tool_calls
  with finish_reason tool_calls; the call and its result sent back render
  and run;
- response_format json_schema: the text parses and satisfies the schema;
- fill in the middle (`suffix`): the FIM prompt's greedy middle is AR's.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")

from ssd.config import GenerationConfig, SamplingConfig, load_config  # noqa: E402
from ssd.engine import AREngine  # noqa: E402
from ssd.engine.request import GenerationRequest  # noqa: E402
from ssd.serve.backend import LocalBackend  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.test_http import oai, serving  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-1.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def real():
    overrides = {"target": {"backend": "llamacpp", "max_model_len": 1024},
                 "draft": {"backend": "llamacpp", "max_model_len": 1024},
                 "runtime": {"plan": False, "threads": None}, "speculation": {"mode": "sd"}}
    backend = LocalBackend(load_config(ROOT / "configs" / "qwen2.5-coder-cpu.yaml", overrides))
    with serving(lambda: backend) as srv:
        yield srv, backend


def test_chat_template_over_http_is_ar_on_the_rendered_ids(real):
    srv, backend = real
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    reply = oai(srv).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    ids = backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = backend.tokenizer.encode(ids, add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(ids)
    want = AREngine(backend.pair.target, backend.tokenizer).generate(GenerationRequest(
        ids, SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=16)))
    assert reply.choices[0].message.content == want.text


def test_a_named_tool_call_with_the_real_template(real):
    srv, _ = real
    client = oai(srv)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=12, temperature=0,
                                            tools=[WEATHER])
    assert answer.choices[0].message.content


def test_json_schema_with_the_real_model(real):
    srv, _ = real
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = oai(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 150
    assert reply.choices[0].finish_reason == "stop"


def test_fill_in_the_middle_is_ar_on_the_fim_prompt(real):
    """`suffix` lays the prompt out with Qwen2.5-Coder's FIM tokens; SD's greedy middle is AR's on those ids."""
    srv, backend = real
    before, after = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    reply = oai(srv).completions.create(model=MODEL, prompt=before, suffix=after, max_tokens=16, temperature=0)
    prefix, suffix, middle = (backend.tokenizer.convert_tokens_to_ids(t)
                              for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    encode = lambda text: backend.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [prefix, *encode(before), suffix, *encode(after), middle]
    assert reply.usage.prompt_tokens == len(ids)
    want = AREngine(backend.pair.target, backend.tokenizer).generate(GenerationRequest(
        ids, SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=16)))
    assert reply.choices[0].text == want.text
    assert reply.choices[0].text.strip() == "a + b" and reply.choices[0].finish_reason == "stop"
