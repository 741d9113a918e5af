"""Random OpenAI bodies through the live HTTP server:
- each drawn body, streamed, equals the same body whole (every choice's text, finish
  reason and logprobs, and the usage);
- where the seed fixes the output (greedy, or coupled sampling), every mode's reply
  equals AR's, alone or sent together with others (batched by the server);
- every choice equals the gRPC endpoint's reply to the same fields;
- bodies with one field made bad get a 400 naming it, never a 500 (and gRPC requests
  INVALID_ARGUMENT naming it);
- random Responses bodies (tools, JSON output, logprobs, history, modes) stream the
  events of the response they get whole.

The drawn bodies combine what the feature tests pin one at a time: chat and
completions, n and best_of, stop strings and stop tokens, penalties, logit bias,
allowed tokens, min_tokens, top-k/top-p/min-p, logprobs and top alternatives, echo,
and a mode, K and budget per request. SSD's sampled output without coupling depends
on timing (docs/exactness.md), so those bodies run in AR and SD only.
"""

from __future__ import annotations

import dataclasses
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ssd.engine import processing
from ssd.openai import calls as http_calls
from ssd.serve import convert, streaming, validation
from ssd.serve.client import GenerationClient
from ssd.serve.validation import choice_seed
from tests.test_http import ChatBackend, base_url, serving
from tests.test_http import backend  # noqa: F401  (a module fixture: this module's own)
from tests.test_mixed_batches import first_rows_only
from tests.test_openai_api import wide  # noqa: F401  (a module fixture: the 85-token pair, tool template)

LETTERS = "abcdefghijklmnop"  # the tiny tokenizer's 16 tokens
SEEDS = range(40)


@pytest.fixture(scope="module")
def server(backend):  # noqa: F811
    with serving(lambda: ChatBackend(backend)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=base_url(server), timeout=60) as client:
        yield client


def draw_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A random request: its path and body (mode left to the caller)."""
    chat = rng.random() < 0.5
    text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 12)))
    body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(1, 24), "seed": rng.randrange(1000)}
    if chat:
        body["messages"] = [{"role": "system", "content": text[:2]}, {"role": "user", "content": text[2:] or "a"}]
    else:
        body["prompt"] = text
    body["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.3])
    body["n"] = rng.choice([1, 1, 2, 3]) if body["temperature"] > 0 else 1
    # Named either way: a seeded body naming none is served coupled (ssd.serve.validation), and
    # standard sampling, whose SSD output may part from AR's, is to be drawn too.
    body["coupling"] = "gumbel" if rng.random() < 0.5 else "standard"
    if rng.random() < 0.4:
        body["stop"] = [rng.choice(LETTERS) + rng.choice(LETTERS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        body["stop_token_ids"] = [rng.randrange(16)]
    if rng.random() < 0.3:
        body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-1, 1), rng.uniform(0, 1)
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.uniform(1.0, 1.5)
    if rng.random() < 0.3:
        body["logit_bias"] = {str(rng.randrange(16)): rng.uniform(-5, 5) for _ in range(2)}
    if rng.random() < 0.2:
        body["allowed_token_ids"] = rng.sample(range(16), 6)
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if body["temperature"] > 0 and rng.random() < 0.5:
        body.update(top_k=rng.randint(2, 8), top_p=rng.uniform(0.5, 1.0), min_p=rng.uniform(0, 0.2))
    if rng.random() < 0.5:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    if not chat and rng.random() < 0.2 and "logprobs" not in body:
        body["echo"] = True
    if not chat and body["temperature"] > 0 and rng.random() < 0.4:
        body["best_of"] = body["n"] + 1  # the likeliest n of n + 1 samples
    body["speculation"] = {"k": rng.randint(1, 5), "fanout_budget": rng.randint(2, 8)}
    if rng.random() < 0.3:
        body["priority"] = rng.randint(-3, 3)  # admission order only: the output stays the same
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def whole(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choices = {c["index"]: _choice(c, path) for c in data["choices"]}
    return {"choices": choices, "usage": data["usage"]}


def streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                part = _choice(c, path)
                into = choices.setdefault(c["index"], {"text": "", "finish": None, "logprobs": []})
                into["text"] += part["text"]
                into["logprobs"] += part["logprobs"]
                into["finish"] = part["finish"] or into["finish"]
    return {"choices": choices, "usage": usage}


def _choice(choice: dict[str, Any], path: str) -> dict[str, Any]:
    """text, finish reason and logprobs of a choice (or a streamed chunk's piece of one)."""
    if "chat" in path:
        text = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
        entries = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                    for e in entries]
    else:
        text = choice["text"]
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens", [])
        tops = [list(top.items()) for top in lp.get("top_logprobs") or [{} for _ in tokens]]
        logprobs = list(zip(tokens, lp.get("token_logprobs", []), tops, lp.get("text_offset", [])))
    return {"text": text, "finish": choice.get("finish_reason"), "logprobs": logprobs}


def assert_same_output(got: dict[str, Any], want: dict[str, Any], context: Any) -> None:
    """Equal replies, log-probabilities to 1e-9: the fp64 pair's logits move in the last
    bits with the number of rows a forward computes (a verification's K + 1)."""
    assert got["usage"] == want["usage"] and got["choices"].keys() == want["choices"].keys(), context
    for index, choice in got["choices"].items():
        other = want["choices"][index]
        assert (choice["text"], choice["finish"]) == (other["text"], other["finish"]), context
        assert _shape(choice["logprobs"]) == _shape(other["logprobs"]), context
        assert _values(choice["logprobs"]) == pytest.approx(_values(other["logprobs"]), abs=1e-9), context


def _shape(logprobs: list) -> list:
    return [(token, [alt for alt, _ in top], *offset) for token, _, top, *offset in logprobs]


def _values(logprobs: list) -> list[float]:
    return [v for _, value, top, *_ in logprobs for v in [value, *(lp for _, lp in top)]]


SETTINGS = {  # what each mode takes of the drawn speculation settings (others are refused)
    "ar": lambda drawn: {},
    "sd": lambda drawn: {"k": drawn["k"]},
    "ssd": lambda drawn: drawn,
}


def check_body(http: httpx.Client, seed: int) -> None:
    """Seed's body, in each mode it runs in: streamed == whole; seeded output == AR's."""
    path, body = draw_body(random.Random(seed))
    seeded = body["temperature"] == 0 or body.get("coupling") == "gumbel"
    modes = ("ar", "sd", "ssd") if seeded else ("ar", "sd")
    replies = {}
    for mode in modes:
        mode_body = {**body, "speculation": {**SETTINGS[mode](body["speculation"]), "mode": mode}}
        replies[mode] = whole(http, path, mode_body)
        if not body.get("echo") and body.get("best_of", 1) == body["n"]:  # not streamed
            assert streamed(http, path, mode_body) == replies[mode], ("streamed", seed, mode, body)
    if seeded:
        for mode in modes[1:]:
            assert_same_output(replies[mode], replies["ar"], ("against AR", seed, mode, body))
    assert len(replies["ar"]["choices"]) == body["n"]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_body_streamed_equals_it_whole_and_ar_in_every_mode(http, seed):
    check_body(http, seed)


@pytest.mark.parametrize("wave", range(3))
def test_random_bodies_sent_together_equal_each_alone(http, wave):
    """Seeded bodies sent at once (batched by the server, some streamed) give what each gives alone."""
    rng = random.Random(1000 + wave)
    calls = []
    while len(calls) < 6:
        path, body = draw_body(rng)
        if body["temperature"] == 0 or body.get("coupling") == "gumbel":
            mode = rng.choice(list(SETTINGS))
            body = {**body, "speculation": {**SETTINGS[mode](body["speculation"]), "mode": mode}}
            stream = not body.get("echo") and body.get("best_of", 1) == body["n"] and rng.random() < 0.5
            calls.append((path, body, stream))
    alone = [whole(http, path, body) for path, body, _ in calls]
    before = batched_steps(http)
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(lambda call: (streamed if call[2] else whole)(http, call[0], call[1]), calls))
    for call, got, want in zip(calls, together, alone):
        assert_same_output(got, want, ("together", call))
    assert batched_steps(http) > before  # some steps ran several of them as one batch


def batched_steps(http: httpx.Client) -> float:
    """Engine steps so far that ran more than one row (the server's /metrics)."""
    samples = {s.name + str(s.labels): s.value for family in text_string_to_metric_families(http.get("/metrics").text)
               for s in family.samples if s.name.startswith("ssd:batch_size")}
    return samples["ssd:batch_size_count{}"] - samples["ssd:batch_size_bucket{'le': '1.0'}"]


BAD_VALUES = (None, -1, 0, 10**12, -(10**12), 1.5, -0.5, 1e308, "x", "", [], {}, [None], True, False, [1, "a"],
              {"a": 1})
MUTABLE = ("speculation.k", "speculation.mode", "speculation.fanout_budget", "speculation.saguaro_c",
           "speculation.backup", "messages.0.role", "messages.0.content", "messages.1", "messages", "prompt", "stream",
           "stream_options", "stream_options.include_usage", "response_format", "response_format.type", "tools",
           "tools.0", "tool_choice", "suffix", "top_logprobs", "n", "logprobs", "stop.0", "logit_bias.3",
           "allowed_token_ids.0", "stop_token_ids.0", "min_p", "top_p", "echo", "ignore_eos", "prediction",
           "prompt_logprobs", "truncate_prompt_tokens", "bad_words", "priority")


def mutate(rng: random.Random, body: dict[str, Any]) -> str | None:
    """Set one field (or an item in one) to a value of a wrong type or out of range; its
    dotted path, or None where the drawn path does not fit the body."""
    path = rng.choice([*body, *MUTABLE])
    *parents, last = path.split(".")
    into: Any = body
    try:
        for part in parents:
            into = into[int(part)] if part.isdigit() else into.setdefault(part, {})
        into[int(last) if isinstance(into, list) else last] = rng.choice(BAD_VALUES)
    except (IndexError, KeyError, TypeError, AttributeError):
        return None
    return path


def test_a_random_bad_field_gets_a_400_that_names_it_and_the_server_stays_up(http):
    """Never a 500, a hang or a crash: each mutated body is served (the value was a valid
    one) or refused with OpenAI's error shape naming the mutated field."""
    codes = send_bad_fields(http)
    assert codes.get(400, 0) > 100 and codes.get(200, 0) > 10, codes
    assert http.get("/health").status_code == 200


def without_min_p_check(monkeypatch) -> None:
    """min_p's range check left out: a bad min_p reaches the sampler's config, which raises."""
    real = validation._sampling

    def unchecked(request, info):
        return dataclasses.replace(real(dataclasses.replace(request, min_p=None), info), min_p=request.min_p or 0.0)

    monkeypatch.setattr(validation, "_sampling", unchecked)


def test_the_bad_fields_catch_a_check_left_out(http, monkeypatch):
    """Power: min_p's range check gone, a bad min_p is a 500."""
    without_min_p_check(monkeypatch)
    # A client of its own: uvicorn closes a connection after a 500, which the shared client's
    # next request (in the next test) could meet.
    with httpx.Client(base_url=str(http.base_url), timeout=60) as own:
        with pytest.raises(AssertionError, match="Internal Server Error"):
            send_bad_fields(own)


def send_bad_fields(http: httpx.Client) -> dict[int, int]:
    """200 bodies, each with one bad field: the count of each status code."""
    rng, codes = random.Random(7), {}
    for _ in range(200):
        path, body = draw_body(rng)
        mode = rng.choice(list(SETTINGS))
        body["speculation"] = {**SETTINGS[mode](body["speculation"]), "mode": mode}
        body["max_tokens"] = min(body["max_tokens"], 4)  # what is served matters here, not its length
        body["min_tokens"] = min(body.get("min_tokens", 0), 4)
        field = mutate(rng, body)
        if field is None:
            continue
        with http.stream("POST", path, json=body) as reply:  # a streamed 200 is read to its end
            reply.read()
        codes[reply.status_code] = codes.get(reply.status_code, 0) + 1
        assert reply.status_code in (200, 400, 404), (field, body, reply.text)
        if reply.status_code != 200:
            param = reply.json()["error"]["param"]
            assert param.split(".")[0].split("[")[0] == field.split(".")[0], (field, body, reply.text)
    return codes


GRPC_FIELDS = ("temperature", "coupling", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "min_tokens", "stop_token_ids", "allowed_token_ids", "priority")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # gRPC's reason -> OpenAI's


def grpc_request(path: str, body: dict[str, Any], choice: int) -> dict[str, Any]:
    """The gRPC request (GenerationClient's keywords) that HTTP body's choice `choice` is."""
    request = {"max_new_tokens": body["max_tokens"], "seed": choice_seed(body["seed"], choice),
               "stop": body.get("stop", []), "mode": body["speculation"]["mode"],
               **{name: body[name] for name in GRPC_FIELDS if name in body},
               **{name: body["speculation"][name] for name in ("k", "fanout_budget") if name in body["speculation"]}}
    request.update({"messages": body["messages"]} if "chat" in path else {"text": body["prompt"]})
    if "logit_bias" in body:
        request["logit_bias"] = {int(token): bias for token, bias in body["logit_bias"].items()}
    if body.get("logprobs") is not None and body["logprobs"] is not False:  # 0 asks for them (with no alternatives)
        request["logprobs"] = body.get("top_logprobs", 0) if "chat" in path else body["logprobs"]
    return request


def test_a_random_body_s_choices_are_the_grpc_endpoint_s_replies(server, http):
    """Every choice of a drawn body (sampled ones too: choice i runs with choice_seed(seed, i))
    equals the gRPC request with the same fields: text, finish reason, logprobs (to 1e-9: the
    fp64 pair's last bits move with the rows a forward computes)."""
    rng, compared = random.Random(99), 0
    with GenerationClient(f"127.0.0.1:{server.port}") as grpc_client:
        while compared < 30:
            path, body = draw_body(rng)
            if body.get("echo") or body.get("best_of", body["n"]) > body["n"]:
                continue  # HTTP's own: no gRPC field
            mode = rng.choice(["ar", "sd"])  # sampled SSD depends on timing; SSD == AR is checked above
            body["speculation"] = {**SETTINGS[mode](body["speculation"]), "mode": mode}
            for index, choice in whole(http, path, body)["choices"].items():
                out = grpc_client.generate(**grpc_request(path, body, index))
                assert (out.text, FINISH[out.finish_reason]) == (choice["text"], choice["finish"]), body
                assert [lp.logprob for lp in out.logprobs] == pytest.approx(
                    [value for _, value, *_ in choice["logprobs"]], abs=1e-9), body
                compared += 1


def test_the_grpc_comparison_sees_a_field_the_grpc_side_drops(server, http, monkeypatch):
    dropped = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
    monkeypatch.setattr(convert, "_OPTIONAL", tuple(f for f in convert._OPTIONAL if f not in dropped))
    with pytest.raises(AssertionError):
        test_a_random_body_s_choices_are_the_grpc_endpoint_s_replies(server, http)


GRPC_INTS = (-1, 0, 1, 2, 7, 2**31 - 1, 2**40)
GRPC_FLOATS = (-1.0, 0.0, 0.5, 1.5, 1e30, float("nan"), float("inf"))
GRPC_BAD = {"max_new_tokens": GRPC_INTS, "top_k": GRPC_INTS, "min_tokens": GRPC_INTS, "logprobs": GRPC_INTS,
            "prompt_logprobs": GRPC_INTS, "k": GRPC_INTS, "fanout_budget": GRPC_INTS, "temperature": GRPC_FLOATS,
            "top_p": GRPC_FLOATS, "min_p": GRPC_FLOATS, "presence_penalty": GRPC_FLOATS,
            "frequency_penalty": GRPC_FLOATS, "repetition_penalty": GRPC_FLOATS, "saguaro_c": GRPC_FLOATS,
            "seed": (0, 2**64 - 1), "mode": (0, 3, 7), "coupling": ("", "philox"), "backup": ("", "oracle"),
            "stop_token_ids": ([-1], [16]), "allowed_token_ids": ([99], []), "logit_bias": ({99: 1.0}, {1: 1e30}),
            "token_ids": ([], [16], [0] * 5000), "stop": ([""], ["a" * 10000]), "priority": GRPC_INTS}


def test_a_random_bad_grpc_field_is_invalid_argument_naming_it(server):
    """The gRPC endpoint's side of the bad-field check: one field of a valid request set to a
    value of the wrong range; served, or INVALID_ARGUMENT whose message starts with the field."""
    rng, codes = random.Random(5), {}
    with GenerationClient(f"127.0.0.1:{server.port}") as client:
        for _ in range(200):
            field, value = rng.choice(list(GRPC_BAD.items()))
            request = {"token_ids": [1, 2, 3], "max_new_tokens": 3, "mode": rng.choice(["ar", "sd", "ssd"]),
                       field: rng.choice(value)}
            try:
                client.generate(timeout=60, **request)
                code = "OK"
            except ValueError:
                code = "refused by protobuf"  # out of the field's wire range: never sent
            except grpc.RpcError as exc:
                code = exc.code().name
                named = exc.details().split(":")[0].split(".")[-1].split("[")[0]
                assert code == "INVALID_ARGUMENT" and named in (field, "prompt"), (request, exc.details())
            codes[code] = codes.get(code, 0) + 1
        assert client.health() == "SERVING"
    assert codes.get("INVALID_ARGUMENT", 0) > 80 and codes.get("OK", 0) > 30, codes


def test_the_bad_grpc_fields_catch_a_check_left_out(server, monkeypatch):
    without_min_p_check(monkeypatch)
    with pytest.raises(AssertionError, match="min_p"):
        test_a_random_bad_grpc_field_is_invalid_argument_naming_it(server)


def test_the_bodies_cover_what_they_combine():
    drawn = [draw_body(random.Random(seed)) for seed in SEEDS]
    bodies = [body for _, body in drawn]
    seeded = [b for b in bodies if b["temperature"] == 0 or b.get("coupling") == "gumbel"]
    assert {path for path, _ in drawn} == {"/v1/chat/completions", "/v1/completions"}
    assert len(seeded) >= 10 and any(b["temperature"] > 0 for b in seeded)
    assert any(b["n"] > 1 for b in seeded) and any(b["n"] > 1 and b not in seeded for b in bodies)
    for key in ("stop", "stop_token_ids", "logprobs", "logit_bias", "min_tokens", "allowed_token_ids",
                "repetition_penalty", "presence_penalty", "top_k", "echo", "best_of"):
        assert any(key in b for b in seeded), key
    assert any(b.get("best_of", 0) > b["n"] > 1 for b in seeded)


def test_the_check_sees_streamed_text_shown_before_a_stop_string_is_ruled_out(http, monkeypatch):
    """Power: a stream that holds nothing back shows a stop string's first letters,
    which the whole reply cuts."""
    real = streaming.TextStream.push

    def push(self, ids):
        self.holdback = 0
        return real(self, ids)

    monkeypatch.setattr(streaming.TextStream, "push", push)
    with pytest.raises(AssertionError, match="streamed"):
        for seed in SEEDS:
            check_body(http, seed)


def test_the_check_sees_drafted_positions_scored_with_the_first_positions_penalties(http, monkeypatch):
    """Power: a verification that applies the first position's penalties to every drafted
    position parts SD and SSD from AR."""
    real = processing.LogitsProcessor.rows
    monkeypatch.setattr(processing.LogitsProcessor, "rows", first_rows_only(real))
    with pytest.raises(AssertionError, match="against AR"):
        for seed in SEEDS:
            check_body(http, seed)


# --- the Responses API: a random body's events against the body whole ------------------------------

RESPONSES_SEEDS = range(30)


def draw_responses_body(rng: random.Random) -> dict[str, Any]:
    from tests.test_responses_api import FUNCTIONS

    text = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 10)))
    body: dict[str, Any] = {"model": "tiny", "input": text, "max_output_tokens": rng.randint(1, 40),
                            "speculation": {"mode": rng.choice(["ar", "sd", "ssd"])}}
    if rng.random() < 0.3:
        body["instructions"] = "be brief"
    if rng.random() < 0.3:
        body["input"] = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "more"}]
    if rng.random() < 0.3:
        body["tools"] = FUNCTIONS
        body["tool_choice"] = rng.choice(["auto", "required", "none", {"type": "function", "name": "get_weather"}])
    elif rng.random() < 0.2:
        body["text"] = {"format": {"type": "json_object"}}
    if rng.random() < 0.4:
        body["include"], body["top_logprobs"] = ["message.output_text.logprobs"], rng.randint(0, 3)
    if rng.random() < 0.5:
        body.update(temperature=0.8, seed=rng.randrange(100), coupling="gumbel")
    return body


def _comparable(response: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    """The response without its ids and times, and its log-probabilities apart (fp64: the last
    bits move with the rows a forward computes, which SSD's timing decides)."""
    values: list[float] = []

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            if "logprob" in value:
                values.append(value["logprob"])
            return {k: strip(v) for k, v in value.items() if k not in ("id", "created_at", "call_id", "logprob")}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return strip(response), values


@pytest.mark.parametrize("seed", RESPONSES_SEEDS)
def test_a_random_responses_body_streams_the_events_of_its_whole_response(wide, seed):  # noqa: F811
    """The stream's last event holds the response the body gets whole, its text deltas make the
    message's text and logprobs, and its sequence numbers count from 0."""
    check_responses_body(wide[0], seed)


def test_the_responses_check_sees_a_delta_that_loses_its_logprobs(wide, monkeypatch):  # noqa: F811
    real = http_calls.ResponsesCall._text_delta

    def text_delta(self, choice, delta):
        events = real(self, choice, delta)
        events[-1]["logprobs"] = events[-1]["logprobs"][1:]
        return events

    monkeypatch.setattr(http_calls.ResponsesCall, "_text_delta", text_delta)
    with pytest.raises(AssertionError, match="deltas' logprobs"):
        for seed in RESPONSES_SEEDS:
            check_responses_body(wide[0], seed)


def check_responses_body(srv, seed: int) -> None:
    """Seed's Responses body, whole and streamed."""
    body = draw_responses_body(random.Random(seed))
    reply = httpx.post(base_url(srv) + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    whole = reply.json()
    with httpx.stream("POST", base_url(srv) + "/v1/responses", json={**body, "stream": True}, timeout=60) as stream:
        events = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    (final, final_values), (want, want_values) = _comparable(events[-1]["response"]), _comparable(whole)
    assert final == want and final_values == pytest.approx(want_values, abs=1e-9), body
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    messages = [item for item in whole["output"] if item["type"] == "message"]
    part = messages[0]["content"][0] if messages else {"text": "", "logprobs": []}
    assert "".join(e["delta"] for e in deltas) == part["text"], ("deltas' text", body)
    streamed = [lp["token"] for e in deltas for lp in e["logprobs"]]
    assert streamed == [lp["token"] for lp in part["logprobs"]], ("deltas' logprobs", body)
