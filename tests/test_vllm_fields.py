"""vLLM's request fields that shape the prompt or the text, not the law: the chat layout
(add_generation_prompt, continue_final_message for an assistant's prefill,
chat_template_kwargs such as Qwen3's enable_thinking, chat `echo`),
truncate_prompt_tokens, skip_special_tokens, completions' `suffix` (fill in the
middle, between the model's FIM tokens), and prompt_logprobs (vLLM's view of
the prompt's log-probabilities, with ranks: checked against the target's own
log-softmax; the prompt scoring itself is tests/test_prompt_logprobs.py's).

They change the prompt ids or how tokens become text, so exactness carries over:
each test checks that the prompt is Hugging Face's (apply_chat_template with the
same options) or the truncated one, and that the output over HTTP and gRPC is the
engine's for those prompt ids, its text decoded as asked.

Two templates: the real Qwen2.5 tokenizer's (offline, no model), and for the
live server a Jinja template over the tiny pair's 16 letters, rendered by
transformers' own chat-template code (so continue_final_message is cut where
transformers cuts it): each message is its role's letter, its content and "m";
the generation prompt is "n", then "k" when the template kwarg `think` is true.
The tiny pair's EOS there is "p" (id 15), the system letter, which no test's
chat uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from transformers.utils.chat_template_utils import render_jinja_template

from ssd.config import load_config
from ssd.models.tokenizer import TinyTokenizer, fim_ids, template_variables
from ssd.serve.backend import BackendInfo, TokenizerMixin
from ssd.serve.client import GenerationClient
from ssd.serve.options import ServeOptions
from ssd.serve.request import ChatMessage, ChatOptions, Request
from ssd.serve.validation import InvalidArgument, prompt_ids
from tests.conftest import ROOT
from tests.test_http import base_url, direct, oai, serving

TINY_TEMPLATE = ("{%- set letter = {'system': 'p', 'user': 'o', 'assistant': 'n'} -%}"
                 "{%- for m in messages -%}{{ letter[m.role] }}{{ m.content }}m{%- endfor -%}"
                 "{%- if add_generation_prompt -%}n{%- if think is defined and think -%}k{%- endif -%}{%- endif -%}")
# Qwen3's generation prompt (its chat template's last lines), on Qwen2.5's tokens.
QWEN3_TAIL = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}")
PREFILL = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cd"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
EOS = 15  # "p"


class TemplatedTiny(TinyTokenizer):
    """The tiny tokenizer with a Jinja chat template, rendered as transformers renders one."""

    chat_template = TINY_TEMPLATE

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False,
                            continue_final_message=False, **kwargs):
        assert not tokenize
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **kwargs)
        return rendered[0]


class TokenizerOnly(TokenizerMixin):
    """A backend's prompt handling over a tokenizer, no model."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.info = BackendInfo("qwen", None, len(tokenizer), 32768, ("ar",), True, (), None)


def rendered(backend, messages: list[dict[str, str]], options: ChatOptions | None = None) -> list[int]:
    request = Request(chat=[ChatMessage(m["role"], m["content"]) for m in messages], chat_options=options)
    return prompt_ids(request, backend, ServeOptions())


# --- the real Qwen2.5 template (offline tokenizer) ---------------------------------------------


@pytest.fixture(scope="module")
def qwen(real_tokenizer):
    return TokenizerOnly(real_tokenizer)


def test_each_layout_is_hugging_faces(qwen, real_tokenizer):
    def hf(messages, **options) -> list[int]:
        return real_tokenizer.encode(real_tokenizer.apply_chat_template(messages, tokenize=False, **options),
                                     add_special_tokens=False)

    user = PREFILL[:1]
    assert rendered(qwen, user) == hf(user, add_generation_prompt=True)
    assert rendered(qwen, user, ChatOptions(add_generation_prompt=False)) == hf(user)
    assert rendered(qwen, user, ChatOptions(add_generation_prompt=False)) != rendered(qwen, user)
    prefilled = rendered(qwen, PREFILL, ChatOptions(**CONTINUE))
    assert prefilled == hf(PREFILL, continue_final_message=True)
    assert real_tokenizer.decode(prefilled).endswith("<|im_start|>assistant\ncd")  # open: no <|im_end|>


def test_template_kwargs_reach_the_template_and_unread_ones_are_refused(real_tokenizer):
    tokenizer = real_tokenizer.__class__.from_pretrained(real_tokenizer.name_or_path)
    tokenizer.chat_template = QWEN3_TAIL
    qwen3 = TokenizerOnly(tokenizer)
    user = PREFILL[:1]
    thinking_off = tokenizer.decode(rendered(qwen3, user, ChatOptions(template_kwargs={"enable_thinking": False})))
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered(qwen3, user, ChatOptions(template_kwargs={"enable_thinking": True})) == rendered(qwen3, user)
    with pytest.raises(InvalidArgument) as info:
        rendered(qwen3, user, ChatOptions(template_kwargs={"enable_thinkin": False}))
    assert info.value.field == "chat.template_kwargs.enable_thinkin" and "reads: enable_thinking" in str(info.value)
    with pytest.raises(InvalidArgument) as info:  # the Qwen2.5 template has no such variable
        rendered(TokenizerOnly(real_tokenizer), user, ChatOptions(template_kwargs={"enable_thinking": False}))
    assert info.value.field == "chat.template_kwargs.enable_thinking"
    with pytest.raises(InvalidArgument) as info:  # apply_chat_template's own parameter
        rendered(qwen3, user, ChatOptions(template_kwargs={"tokenize": True}))
    assert info.value.field == "chat.template_kwargs.tokenize"


@pytest.mark.parametrize("options, message", [
    (ChatOptions(continue_final_message=True), "cannot be combined with add_generation_prompt"),
    (ChatOptions(add_generation_prompt=False, continue_final_message=True), "no content to continue"),
])
def test_a_final_message_is_continued_only_where_it_can_be(qwen, options, message):
    messages = PREFILL if options.add_generation_prompt else [PREFILL[0], {"role": "assistant", "content": ""}]
    with pytest.raises(InvalidArgument) as info:
        rendered(qwen, messages, options)
    assert info.value.field == "chat.continue_final_message" and message in str(info.value)


# --- over the wire: the tiny pair behind the Jinja template ------------------------------------


@pytest.fixture(scope="module")
def server():
    from ssd.serve.backend import LocalBackend

    config = load_config(ROOT / "configs" / "tiny.yaml")
    for model in (config.target, config.draft):
        model.tiny = dataclasses.replace(model.tiny, eos_token_id=EOS)
    backend = LocalBackend(config)
    backend.tokenizer = TemplatedTiny(len(backend.tokenizer), EOS)
    backend.info = dataclasses.replace(backend.info, chat_template=True)
    with serving(lambda: backend) as running:
        yield running, backend
    backend.close()


def tiny_ids(backend, text: str) -> list[int]:
    return backend.tokenizer.encode(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_prefill_is_continued_as_the_engine_continues_its_ids(server, mode, stream):
    srv, backend = server
    expected = backend.decode(direct(backend, tiny_ids(backend, "oabcmncd"), mode, max_new=12).token_ids)
    request = dict(model="tiny", messages=PREFILL, max_tokens=12, temperature=0,
                   extra_body={**CONTINUE, "speculation": {"mode": mode}})
    client = oai(srv)
    if not stream:
        reply = client.chat.completions.create(**request)
        assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens == len("oabcmncd")
        echoed = client.chat.completions.create(**request | {"extra_body": request["extra_body"] | {"echo": True}})
        assert echoed.choices[0].message.content == "cd" + expected
        return
    chunks = list(client.chat.completions.create(stream=True, **request | {"extra_body": request["extra_body"] | {
        "echo": True}}))
    assert chunks[0].choices[0].delta.content == "cd"  # the echo comes with the role
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "cd" + expected


def test_template_kwargs_and_add_generation_prompt_over_http_and_grpc(server):
    srv, backend = server
    client = oai(srv)
    user = [{"role": "user", "content": "abc"}]
    for extra, text in (({"chat_template_kwargs": {"think": True}}, "oabcmnk"),
                        ({"add_generation_prompt": False}, "oabcm")):
        expected = backend.decode(direct(backend, tiny_ids(backend, text), "sd", max_new=10).token_ids)
        reply = client.chat.completions.create(model="tiny", messages=user, max_tokens=10, temperature=0,
                                               extra_body=extra | {"speculation": {"mode": "sd"}})
        assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens == len(text)
        with GenerationClient(f"127.0.0.1:{srv.port}") as grpc_client:
            options = {"template_kwargs": extra["chat_template_kwargs"]} if "chat_template_kwargs" in extra else extra
            out = grpc_client.generate(messages=user, chat_options=options, max_new_tokens=10, temperature=0,
                                       mode="sd")
        assert out.text == expected
        tokenized = httpx.post(base_url(srv) + "/tokenize", json={"messages": user, **extra}).json()
        assert tokenized["tokens"] == tiny_ids(backend, text)  # /tokenize lays the chat out the same way


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": PREFILL, "chat_template_kwargs": {"nothink": 1}},
     "chat_template_kwargs.nothink"),
    ("/v1/chat/completions", {"messages": PREFILL, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs.messages"),
    ("/v1/chat/completions", {"messages": PREFILL, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": PREFILL, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("/v1/completions", {"prompt": "ab", "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "ab", "add_generation_prompt": False}, "add_generation_prompt"),
])
def test_bad_chat_options_name_their_field(server, path, body, param):
    reply = httpx.post(base_url(server[0]) + path, json={"model": "tiny", "max_tokens": 2} | body
                       if path != "/tokenize" else body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("chat, field", [
    ({"template_kwargs": "{"}, "chat.template_kwargs"),
    ({"template_kwargs": "[1]"}, "chat.template_kwargs"),
    ({"template_kwargs": json.dumps({"thin": True})}, "chat.template_kwargs.thin"),
    ({"continue_final_message": True}, "chat.continue_final_message"),
])
def test_bad_chat_options_over_grpc_name_their_field(server, chat, field):
    with GenerationClient(f"127.0.0.1:{server[0].port}") as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(messages=PREFILL, chat_options=chat, max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


# --- skip_special_tokens and truncate_prompt_tokens --------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_skip_special_tokens_false_keeps_the_eos_in_the_text(server, stream):
    srv, backend = server
    # EOS made likely, and ignored, so the output holds EOS tokens between others.
    request = dict(model="tiny", prompt="abcab", max_tokens=24, temperature=1.0, seed=3, logprobs=0,
                   extra_body={"ignore_eos": True, "logit_bias": {str(EOS): 4.0}, "speculation": {"mode": "sd"}})
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        ids = client.generate(text="abcab", max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                              logit_bias={EOS: 4.0}, mode="sd", skip_special_tokens=False)
    assert 0 < ids.token_ids.count(EOS) < len(ids.token_ids)
    assert ids.text == backend.decode(ids.token_ids, skip_special_tokens=False)
    texts = {}
    for skip in (True, False):
        body = request | {"extra_body": request["extra_body"] | {"skip_special_tokens": skip}}
        if stream:
            chunks = list(oai(srv).completions.create(stream=True, **body))
            texts[skip] = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        else:
            choice = oai(srv).completions.create(**body).choices[0]
            texts[skip], tokens = choice.text, choice.logprobs.tokens
        assert tokens.count("p" if not skip else "") == ids.token_ids.count(EOS)  # logprob tokens decode alike
    assert texts == {True: backend.decode(ids.token_ids), False: ids.text}
    assert "p" in texts[False] and "p" not in texts[True]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    srv, backend = server
    expected = backend.decode(direct(backend, tiny_ids(backend, "cab"), "sd", max_new=10).token_ids)
    reply = oai(srv).completions.create(model="tiny", prompt="abcabcab", max_tokens=10, temperature=0, echo=True,
                                        extra_body={"truncate_prompt_tokens": 3, "speculation": {"mode": "sd"}})
    assert reply.choices[0].text == "cab" + expected and reply.usage.prompt_tokens == 3
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        out = client.generate(text="abcabcab", truncate_prompt_tokens=3, max_new_tokens=10, temperature=0, mode="sd")
        assert out.text == expected
        whole = client.generate(text="abcabcab", truncate_prompt_tokens=-1, max_new_tokens=10, temperature=0)
        assert whole.text == backend.decode(direct(backend, tiny_ids(backend, "abcabcab"), "ar", max_new=10).token_ids)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(text="ab", truncate_prompt_tokens=0)
    assert info.value.details().startswith("truncate_prompt_tokens: must be in 1..")
    reply = httpx.post(base_url(srv) + "/v1/completions",
                       json={"model": "tiny", "prompt": "ab", "truncate_prompt_tokens": -2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncate_prompt_tokens"


# --- vLLM's prompt_logprobs ---------------------------------------------------------------------


def _prompt_log_softmax(backend, prompt: list[int]) -> torch.Tensor:
    """The target's log-softmax at each prompt position after the first, [len - 1, V]."""
    with torch.no_grad():
        out = backend.pair.target(torch.tensor([prompt]))
    logits = (out.logits if hasattr(out, "logits") else out)[0, :-1].to(torch.float64)
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_prompt_logprobs_are_vllms_with_ranks(server, mode):
    srv, backend = server
    prompt = tiny_ids(backend, "abcabca")
    logp = _prompt_log_softmax(backend, prompt)
    reply = oai(srv).completions.create(model="tiny", prompt="abcabca", max_tokens=3, temperature=0, echo=True,
                                        logprobs=1, extra_body={"prompt_logprobs": 3, "speculation": {"mode": mode}})
    choice = reply.choices[0]
    views = choice.model_extra["prompt_logprobs"]
    assert views[0] is None and len(views) == len(prompt)
    for i, view in enumerate(views[1:]):
        token, row = prompt[i + 1], logp[i]
        ranked = row.argsort(descending=True).tolist()
        assert set(view) == {str(token), *map(str, ranked[:3])}
        assert view[str(token)] == {"logprob": pytest.approx(row[token].item(), abs=1e-9),
                                    "rank": int((row > row[token]).sum()) + 1,
                                    "decoded_token": backend.decode([token])}
        for rank, top in enumerate(ranked[:3], start=1):
            assert view[str(top)]["rank"] == (rank if top != token else view[str(token)]["rank"])
    assert any(v[str(t)]["rank"] > 1 for v, t in zip(views[1:], prompt[1:]))  # ranks are not all 1
    # echo's legacy layout shows its own logprobs (1 alternative), the same values
    echo = choice.logprobs
    assert echo.token_logprobs[1:len(prompt)] == [v[str(t)]["logprob"] for v, t in zip(views[1:], prompt[1:])]
    assert all(len(top) == 1 for top in echo.top_logprobs[1:len(prompt)])
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        out = client.generate(text="abcabca", max_new_tokens=3, temperature=0, prompt_logprobs=3, mode=mode)
    assert [e.rank for e in out.prompt_logprobs] == [v[str(t)]["rank"] for v, t in zip(views[1:], prompt[1:])]


def test_chat_prompt_logprobs_come_once_beside_the_choices(server):
    srv, backend = server
    user = [{"role": "user", "content": "abc"}]
    reply = oai(srv).chat.completions.create(model="tiny", messages=user, max_tokens=2, temperature=0, n=2,
                                             extra_body={"prompt_logprobs": 0})
    views = reply.model_extra["prompt_logprobs"]
    prompt = tiny_ids(backend, "oabcmn")
    assert views[0] is None and [list(v) for v in views[1:]] == [[str(t)] for t in prompt[1:]]
    logp = _prompt_log_softmax(backend, prompt)
    assert [v[str(t)]["logprob"] for v, t in zip(views[1:], prompt[1:])] == pytest.approx(
        [logp[i, t].item() for i, t in enumerate(prompt[1:])], abs=1e-9)


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 1, "stream": True}, "is not streamed"),
    ({"prompt_logprobs": 21}, "must be in 0..20"),
    ({"prompt_logprobs": -1}, "must be in 0..20"),
])
def test_bad_prompt_logprobs_name_their_field(server, body, message):
    reply = httpx.post(base_url(server[0]) + "/v1/completions", json={"model": "tiny", "prompt": "ab"} | body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
    assert message in reply.json()["error"]["message"]


# --- return_tokens_as_token_ids and continuous_usage_stats --------------------------------------


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(server):
    srv, backend = server
    every_token = {"ignore_eos": True, "skip_special_tokens": False}  # the text spells every token
    request = dict(model="tiny", prompt="abcab", max_tokens=8, temperature=0, logprobs=2, echo=True)
    plain = oai(srv).completions.create(**request, extra_body=every_token).choices[0]
    by_id = oai(srv).completions.create(**request, extra_body=every_token | {"return_tokens_as_token_ids": True})
    by_id = by_id.choices[0]
    ids = tiny_ids(backend, plain.text)
    assert by_id.text == plain.text and by_id.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset  # offsets stay in the text
    assert by_id.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert [sorted(top) for top in by_id.logprobs.top_logprobs[1:]] == [
        sorted(f"token_id:{tiny_ids(backend, k)[0]}" for k in top) for top in plain.logprobs.top_logprobs[1:]]
    chat = oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                            max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                                            extra_body=every_token | {"return_tokens_as_token_ids": True})
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in tiny_ids(backend, chat.choices[0].message.content)]
    assert all(e.bytes == list(e.token.encode()) for e in entries)


def test_continuous_usage_stats_count_each_choices_tokens_so_far(server):
    srv, _ = server
    chunks = list(oai(srv).completions.create(
        model="tiny", prompt="abcab", max_tokens=12, temperature=0, n=2, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    seen: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk.usage.prompt_tokens == 5
        assert chunk.usage.total_tokens == 5 + chunk.usage.completion_tokens
        seen[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 12 and len(counts) > 1
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices  # include_usage's total
    plain = list(oai(srv).completions.create(model="tiny", prompt="abcab", max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)


# --- fill in the middle (completions' suffix) ---------------------------------------------------


def test_suffix_lays_the_prompt_out_between_the_fim_tokens(real_tokenizer):
    qwen = TokenizerOnly(real_tokenizer)
    qwen.info = dataclasses.replace(qwen.info, fim_ids=fim_ids(real_tokenizer))
    ids = prompt_ids(Request(text="def f(x):\n    return ", suffix="\nprint(f(2))"), qwen, ServeOptions())
    assert real_tokenizer.decode(ids) == "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\nprint(f(2))<|fim_middle|>"
    assert ids[1:-1].count(qwen.info.fim_ids[1]) == 1  # the texts encoded apart: no token spans the seam
    tiny = TokenizerOnly(TinyTokenizer(16))  # no FIM tokens
    with pytest.raises(InvalidArgument) as info:
        prompt_ids(Request(text="ab", suffix="cd"), tiny, ServeOptions())
    assert info.value.field == "suffix" and "no fill-in-the-middle tokens" in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        prompt_ids(Request(chat=[ChatMessage("user", "ab")], suffix="cd"), qwen, ServeOptions())
    assert info.value.field == "suffix"


def test_suffix_over_http_and_grpc_is_the_engines_middle(server):
    srv, backend = server
    fim = tuple(tiny_ids(backend, "hij"))  # the stand-in's FIM tokens
    backend.info = dataclasses.replace(backend.info, fim_ids=fim)
    try:
        ids = [fim[0], *tiny_ids(backend, "abc"), fim[1], *tiny_ids(backend, "cab"), fim[2]]
        expected = backend.decode(direct(backend, ids, "sd", max_new=10).token_ids)
        reply = oai(srv).completions.create(model="tiny", prompt="abc", suffix="cab", max_tokens=10, temperature=0,
                                            extra_body={"speculation": {"mode": "sd"}})
        assert reply.choices[0].text == expected and reply.usage.prompt_tokens == len(ids)
        with GenerationClient(f"127.0.0.1:{srv.port}") as client:
            assert client.generate(token_ids=tiny_ids(backend, "abc"), suffix="cab", max_new_tokens=10,
                                   temperature=0, mode="sd").text == expected
        for extra, param in (({"echo": True}, "echo"), ({"extra_body": {"truncate_prompt_tokens": 2}},
                                                          "truncate_prompt_tokens")):
            with pytest.raises(openai.BadRequestError) as info:
                oai(srv).completions.create(model="tiny", prompt="abc", suffix="cab", max_tokens=2, **extra)
            assert info.value.body["param"] == param
    finally:
        backend.info = dataclasses.replace(backend.info, fim_ids=None)


def test_template_variables_are_read_from_every_template_and_none_when_unparseable():
    tokenizer = TemplatedTiny(16)
    assert template_variables(tokenizer) >= {"messages", "add_generation_prompt", "think"}
    tokenizer.chat_template = {"default": "{{ messages }}", "tool_use": "{{ tools }}{{ x }}"}
    assert template_variables(tokenizer) == {"messages", "tools", "x"}
    tokenizer.chat_template = "{% for m in %}"  # not Jinja: no variable list, so kwargs pass on
    assert template_variables(tokenizer) is None


# --- --served-model-name ------------------------------------------------------------------------


def test_served_model_names_are_the_names_requests_give(server):
    from ssd.app.cli import add_serve_args, serve_options_from_args
    from ssd.config import ConfigError

    _, backend = server
    with serving(lambda: backend, served_model_names=("coder", "coder-latest")) as srv:
        client = oai(srv)
        assert [m.id for m in client.models.list().data] == ["coder", "coder-latest"]
        assert client.models.retrieve("coder-latest").model_extra["root"] == "tiny"
        reply = client.completions.create(model="coder-latest", prompt="abc", max_tokens=3, temperature=0)
        assert reply.model == "coder-latest" and reply.choices[0].text
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="tiny", prompt="abc", max_tokens=3)
        assert info.value.body["param"] == "model" and "'coder', 'coder-latest'" in info.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("tiny")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_options_from_args(parser.parse_args(["--served-model-name", "a", "b"])).served_model_names == ("a", "b")
    with pytest.raises(ConfigError, match="blank name"):
        ServeOptions(served_model_names=(" ",))


# --- prediction (OpenAI's Predicted Outputs) ----------------------------------------------------


def test_a_prediction_travels_to_prompt_lookup_and_changes_no_output(monkeypatch):
    """Rows held at K 0 (k_policy) look up in the prediction too: the same text, more tokens accepted."""
    from ssd.engine import proposers as proposers_module
    from ssd.serve.backend import LocalBackend

    monkeypatch.setattr(proposers_module, "best_length", lambda a, c, longest, rows=1: longest)  # verify every lookup
    config = load_config(ROOT / "configs" / "tiny.yaml")
    config.speculation = dataclasses.replace(config.speculation, mode="sd", k_policy={1: 0})
    backend = LocalBackend(config)
    with serving(lambda: backend) as srv:
        request = dict(model="tiny", prompt="abcd", max_tokens=20, temperature=0)
        plain = oai(srv).completions.create(**request)
        predicted = oai(srv).completions.create(**request, extra_body={
            "prediction": {"type": "content", "content": "abcd" + plain.choices[0].text}})
        assert predicted.choices[0].text == plain.choices[0].text
        stats = plain.model_extra["speculation_stats"], predicted.model_extra["speculation_stats"]
        assert stats[1]["lookup_accepted"] > stats[0]["lookup_accepted"] and stats[1]["rounds"] < stats[0]["rounds"]
        with GenerationClient(f"127.0.0.1:{srv.port}") as client:
            out = client.generate(text="abcd", max_new_tokens=20, temperature=0, prediction="abcd" + plain.choices[0].text)
        assert out.text == plain.choices[0].text and out.finished.stats.lookup_accepted == stats[1]["lookup_accepted"]
        reply = httpx.post(base_url(srv) + "/v1/completions", json=request | {"prediction": {"type": "content",
                                                                                           "content": "z"}})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prediction"  # not in the vocabulary
    backend.close()


def test_an_infill_at_the_start_of_a_file_has_an_empty_prompt(real_tokenizer):
    qwen = TokenizerOnly(real_tokenizer)
    qwen.info = dataclasses.replace(qwen.info, fim_ids=fim_ids(real_tokenizer))
    ids = prompt_ids(Request(text="", suffix="print(1)\n"), qwen, ServeOptions())
    assert real_tokenizer.decode(ids) == "<|fim_prefix|><|fim_suffix|>print(1)\n<|fim_middle|>"
    with pytest.raises(InvalidArgument, match="must not be empty"):
        prompt_ids(Request(text=""), qwen, ServeOptions())  # no suffix: an empty prompt is still refused


def test_the_client_script_sends_the_new_fields():
    """`ssd client` (launch/client.py): --chat --prefill / --template-kwargs lay the chat out; --suffix
    and --prediction travel as GenerateRequest fields; --prefill without --chat is refused."""
    from ssd.app import client as script
    from ssd.serve import protos
    from ssd.serve.client import build_request

    pb, _ = protos.load()
    chat = build_request(pb, **script.request_args(script.parse_args(
        ["hi", "--chat", "--prefill", "def f(", "--template-kwargs", '{"enable_thinking": false}'])))
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi"), ("assistant", "def f(")]
    assert chat.chat.HasField("add_generation_prompt") and not chat.chat.add_generation_prompt
    assert chat.chat.continue_final_message and json.loads(chat.chat.template_kwargs) == {"enable_thinking": False}
    text = build_request(pb, **script.request_args(script.parse_args(["a", "--suffix", "b", "--prediction", "c"])))
    assert (text.text, text.suffix, text.prediction) == ("a", "b", "c")
    with pytest.raises(SystemExit):
        script.parse_args(["hi", "--prefill", "x"])
