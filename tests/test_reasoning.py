"""Reasoning models' <think>...</think>, split from the answer (ssd.openai.reasoning) as vLLM's
reasoning parsers split it: chat's `reasoning_content`, the Responses API's reasoning item.

Only the text is split, so exactness is the chat path's: over the wire the parts are
the raw output's (the same request as a plain completion on the same prompt ids).
The parser's own tests run every chunking of the stream against the whole split.
The wire tests force a thinking with a regex (structured output) on
tests/test_openai_api.py's 85-token tiny pair, whose alphabet spells the markers.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ssd.openai.reasoning import ReasoningStream, opened_by, split
from tests.test_http import oai, serving
from tests.test_openai_api import ToolTemplate, wide  # noqa: F401 - the fixture

# --- the parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, thinking, parts", [
    ("<think>\nabc\n</think>\n\nanswer", False, ("\nabc\n", "answer")),
    ("abc</think>\n\nanswer", True, ("abc", "answer")),  # the prompt opened it (DeepSeek-R1)
    ("just text", False, (None, "just text")),
    ("\n<think>x</think>y<think>z", False, ("x", "y<think>z")),  # a later <think> is the answer's
    ("a<think>b</think>c", False, (None, "a<think>b</think>c")),  # not at the start: no thinking
    ("cut off in thought", True, ("cut off in thought", "")),
    ("<think></think>\n\nA", False, ("", "A")),
    ("<thi", False, (None, "<thi")),
    ("\n\n", False, (None, "\n\n")),
])
def test_split(text, thinking, parts):
    assert split(text, thinking) == parts


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="<>/thinkab \n", max_size=40), thinking=st.booleans(),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_a_stream_splits_as_the_whole_text_for_any_chunking(text, thinking, cuts):
    stream, reasoning, content = ReasoningStream(thinking), "", ""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    for start, end in zip(bounds, bounds[1:]):
        r, c = stream.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert ((reasoning + r) if stream.thought else None, content + c) == split(text, thinking)


def test_where_the_output_starts_is_read_from_the_prompt():
    assert opened_by("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1's template
    assert not opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not opened_by("<|im_start|>assistant\n")


# --- over the wire ------------------------------------------------------------------------------

THINK = {"structured_outputs": {"regex": "<think>[a-z]{3}</think>\n\n[a-z]{4}"}}


@pytest.fixture(scope="module")
def thinking(wide):
    _, backend = wide
    with serving(lambda: ToolTemplate(backend), reasoning_parser="think") as srv:
        yield srv, backend


def _raw(srv, backend, messages, extra) -> str:
    """The output as a plain completion on the chat's prompt ids: nothing split."""
    ids = ToolTemplate(backend).apply_chat(messages)
    return oai(srv).completions.create(model="tiny", prompt=ids, max_tokens=30, extra_body=extra).choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_splits_the_thinking_into_reasoning_content(thinking, stream):
    srv, backend = thinking
    messages = [{"role": "user", "content": "abc"}]
    raw = _raw(srv, backend, messages, THINK)
    thought, answer = split(raw, False)
    assert thought and answer and raw.startswith("<think>")
    kwargs = dict(model="tiny", messages=messages, max_tokens=30, extra_body=THINK)
    if not stream:
        message = oai(srv).chat.completions.create(**kwargs).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (thought, answer)
        assert message.model_extra["reasoning"] == thought  # vLLM's name and DeepSeek's
        return
    chunks = list(oai(srv).chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer


def test_a_prompt_that_opens_the_thinking_starts_the_output_in_it(thinking):
    srv, backend = thinking
    messages = [{"role": "user", "content": "abc<think>"}]  # the stand-in's prompt ends "abc<think>\n"
    extra = {"structured_outputs": {"regex": "[a-z]{3}</think>[a-z]{4}"}}
    raw = _raw(srv, backend, messages, extra)
    message = oai(srv).chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                                               extra_body=extra).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == tuple(raw.split("</think>"))


def test_responses_put_the_thinking_in_a_reasoning_item(thinking):
    srv, backend = thinking
    raw = _raw(srv, backend, [{"role": "user", "content": "abc"}], THINK)
    thought, answer = split(raw, False)
    kwargs = dict(model="tiny", input="abc", max_output_tokens=30, extra_body=THINK)
    whole = oai(srv).responses.create(**kwargs)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought
    assert message.type == "message" and whole.output_text == answer
    events = list(oai(srv).responses.create(stream=True, **kwargs))
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds[2] == ("response.output_item.added", 0)
    assert ("response.output_item.done", 0) in kinds and ("response.output_item.added", 1) in kinds
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1)), kinds
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert events[-1].response.output[0].content[0].text == thought


def test_without_the_parser_the_thinking_stays_in_the_content(wide):
    srv, backend = wide  # "auto": the tiny vocabulary has no <think> token
    message = oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                               max_tokens=30, extra_body=THINK).choices[0].message
    assert message.content.startswith("<think>") and "reasoning_content" not in (message.model_extra or {})


def test_the_parser_option_is_checked_and_auto_follows_the_vocabulary(real_tokenizer):
    from ssd.config import ConfigError
    from ssd.models.tokenizer import has_think_tokens
    from ssd.serve.options import ServeOptions

    with pytest.raises(ConfigError, match="reasoning_parser must be one of auto, think, none"):
        ServeOptions(reasoning_parser="qwen3")
    assert not has_think_tokens(real_tokenizer)  # Qwen2.5: "auto" leaves its text alone
    assert has_think_tokens(type("T", (), {"get_vocab": lambda self: {"<think>": 1, "</think>": 2}})())


def test_thinking_sent_back_reaches_the_template_as_reasoning_content(thinking):
    """Interleaved thinking: an assistant's earlier `reasoning` (or `reasoning_content`), or a Responses
    reasoning item before its message, goes to the template as the message's reasoning_content."""
    from ssd.openai import schema
    from ssd.openai.responses import ResponsesBody, to_chat
    from ssd.serve.validation import InvalidArgument

    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "r"},
            {"role": "user", "content": "c"}]
    request = schema.to_request(schema.ChatBody(model="tiny", messages=turn))
    assert [m.template_dict().get("reasoning_content") for m in request.chat] == [None, "r", None]
    both = [turn[0], turn[1] | {"reasoning_content": "r"}]
    with pytest.raises(InvalidArgument, match="reasoning or reasoning_content, not both") as info:
        schema.to_request(schema.ChatBody(model="tiny", messages=both))
    assert info.value.field == "messages[1].reasoning_content"
    srv, _ = thinking
    whole = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=30, extra_body=THINK)
    items = [{"role": "user", "content": "abc"}] + [o.model_dump(exclude_none=True) for o in whole.output] + [
        {"role": "user", "content": "more"}]
    chat, _ = to_chat(ResponsesBody.model_validate({"model": "tiny", "input": items}))
    assert [(m.role, m.reasoning_content) for m in chat.messages] == [
        ("user", None), ("assistant", whole.output[0].content[0].text), ("user", None)]
    assert oai(srv).responses.create(model="tiny", input=items, max_output_tokens=4).output_text is not None
    with pytest.raises(InvalidArgument, match="must come just before the assistant") as info:
        to_chat(ResponsesBody.model_validate({"model": "tiny", "input": items[:2]}))
    assert info.value.field == "input[1]"
