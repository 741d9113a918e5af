"""The OpenAI-compatible HTTP API: a live server on loopback over the tiny fp64
pair, driven by the official `openai` client (and httpx for what it cannot send).

Exactness through the wire (greedy == AR == the gRPC endpoint, every mode and
endpoint, streamed or not), logprobs == the target's own log-softmax, seeds,
stop strings, usage, both front ends in one batch, disconnects, auth, the
error shapes for bad input, 429 and 503.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import grpc
import httpx
import openai
import pytest
import torch

import ssd

from ssd.config import GenerationConfig, SamplingConfig, load_config
from ssd.factory import make_engine
from ssd.engine.request import GenerationRequest
from ssd.openai.server import OpenAIServer
from ssd.serve.backend import LocalBackend, UnsupportedRequest
from ssd.serve.client import GenerationClient
from ssd.serve.options import ServeOptions
from ssd.serve.validation import SEEDED_COUPLING
from tests.conftest import ROOT, static_ssd
from tests.test_serve import ControlledBackend

PROMPT = "abcab"
MODES = ("ar", "sd", "ssd")
ROLES = {"system": "a", "user": "b", "assistant": "c"}


class ChatBackend:
    """The real backend (batching included) with a chat template: the tiny
    tokenizer has none, so each message renders as its role's letter and its
    content, and the generation prompt is "d"."""

    def __init__(self, inner: Any, round_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.info = dataclasses.replace(inner.info, chat_template=True)
        self.round_delay_s = round_delay_s

    def apply_chat(self, messages: list[dict[str, str]]) -> list[int]:
        unknown = [m["role"] for m in messages if m["role"] not in ROLES]
        if unknown:
            raise UnsupportedRequest(f"the template knows no role {unknown[0]!r}")
        return self.inner.encode("".join(ROLES[m["role"]] + m["content"] for m in messages) + "d")

    def batch_engine(self, mode: str):
        engine = self.inner.batch_engine(mode)
        return SlowEngine(engine, self.round_delay_s) if self.round_delay_s else engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        """The module's LocalBackend outlives each server."""


class SlowEngine:
    """A batch engine whose every step takes round_delay_s longer: a long request lasts seconds."""

    def __init__(self, inner: Any, round_delay_s: float) -> None:
        self.inner, self.round_delay_s = inner, round_delay_s

    def step(self):
        time.sleep(self.round_delay_s)
        return self.inner.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def serving(load: Callable[[], Any], wait: bool = True, **options: Any) -> Iterator[OpenAIServer]:
    server = OpenAIServer(ServeOptions(port=0, http_port=0, grace_s=2.0, **options), load)
    server.start()
    try:
        if wait:
            assert server.wait_ready(30)
        yield server
    finally:
        server.stop(grace_s=0.5)


def base_url(server: OpenAIServer) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def oai(server: OpenAIServer, token: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server) + "/v1", api_key=token, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def backend():
    local = LocalBackend(static_ssd(load_config(ROOT / "configs" / "tiny.yaml")))  # SSD stats compared with runs alone
    yield local
    local.close()


@pytest.fixture(scope="module")
def server(backend):
    with serving(lambda: ChatBackend(backend)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return oai(server)


@pytest.fixture(scope="module")
def grpc_client(server):
    with GenerationClient(f"127.0.0.1:{server.port}") as c:
        yield c


def chat_ids(backend, messages) -> list[int]:
    return ChatBackend(backend).apply_chat(messages)


def direct(backend, prompt_ids: list[int], mode: str, temperature: float = 0.0, seed: int = 0,
           max_new: int = 24, stop=(), coupling: str = SEEDED_COUPLING):
    """The same request through a fresh engine, no server (a seeded request that names no
    coupling is served coupled: validation.default_coupling)."""
    speculation = dataclasses.replace(backend.config.speculation, mode=mode)
    engine = make_engine(mode, backend.pair, speculation)
    try:
        return engine.generate(GenerationRequest(
            prompt_ids, SamplingConfig(temperature=temperature, seed=seed, coupling=coupling),
            GenerationConfig(max_new_tokens=max_new, stop=list(stop)), speculation,
        ))
    finally:
        engine.close()


def complete(client, chat: bool, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """text, finish_reason, logprobs (token, logprob, top) and the extras, streamed or not."""
    prompt = kwargs.pop("prompt", PROMPT)
    if chat:
        call = client.chat.completions.create
        kwargs["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        call = client.completions.create
        kwargs["prompt"] = prompt
    out = {"text": "", "logprobs": [], "chunks": 0}
    if not stream:
        reply = call(model="tiny", **kwargs)
        choice = reply.choices[0]
        out["text"] = choice.message.content if chat else choice.text
        out["logprobs"] = _logprobs(choice.logprobs, chat)
        out.update(finish=choice.finish_reason, usage=reply.usage, stats=reply.model_extra["speculation_stats"])
        return out
    for chunk in call(model="tiny", stream=True, **kwargs):
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        out["text"] += (choice.delta.content or "") if chat else choice.text
        out["logprobs"] += _logprobs(choice.logprobs, chat)
        if choice.finish_reason is not None:
            out.update(finish=choice.finish_reason, stats=chunk.model_extra["speculation_stats"])
    return out


def _logprobs(logprobs: Any, chat: bool) -> list[tuple[str, float, dict[str, float]]]:
    if logprobs is None:
        return []
    if chat:
        return [(e.token, e.logprob, {t.token: t.logprob for t in e.top_logprobs}) for e in logprobs.content]
    return list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))


# --- exactness through the wire ---------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_ar_and_the_grpc_endpoint(client, grpc_client, backend, mode, chat, stream):
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cab"}]
    prompt_ids = chat_ids(backend, messages) if chat else backend.encode(PROMPT)
    out = complete(client, chat, stream, prompt=messages if chat else PROMPT, max_tokens=24, temperature=0,
                   extra_body={"speculation": {"mode": mode}})
    want = direct(backend, prompt_ids, "ar")
    grpc_out = grpc_client.generate(token_ids=prompt_ids, mode=mode, temperature=0.0, max_new_tokens=24)
    assert out["text"] == want.text == grpc_out.text == backend.decode(grpc_out.token_ids)
    assert out["finish"] == "length" and out["stats"]["mode"] == mode
    if stream:
        assert out["chunks"] > 3 and "usage" not in out  # round by round; usage only when asked for
    else:
        assert out["usage"].completion_tokens == 24


def test_logprobs_are_the_targets_log_softmax(client, backend):
    """Greedy: log-softmax of the target's logits; sampled (T = 0.5): of logits / T;
    every mode, streamed (concatenated) == whole; top alternatives sorted, chosen among them when greedy."""
    prompt = backend.encode(PROMPT)
    for mode in MODES:
        for temperature in (0.0, 0.5):
            whole = complete(client, False, False, max_tokens=20, temperature=temperature, seed=3, logprobs=3,
                             extra_body={"speculation": {"mode": mode}})
            ids = backend.encode(whole["text"])
            reference = _target_logprobs(backend, prompt, ids, temperature or 1.0)
            got = [lp for _, lp, _ in whole["logprobs"]]
            assert [t for t, _, _ in whole["logprobs"]] == list(whole["text"])
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), reference, atol=1e-6), (mode, temperature)
            for token, value, top in whole["logprobs"]:
                assert len(top) == 3 and max(top.values()) >= value
                if temperature == 0:
                    assert top[token] == value == max(top.values())
            if mode != "ssd":  # SSD's sampled output may depend on timing (see the README)
                streamed = complete(client, True, True, prompt=PROMPT, max_tokens=20, temperature=temperature,
                                    seed=3, logprobs=True, top_logprobs=2, extra_body={"speculation": {"mode": mode}})
                chat = complete(client, True, False, prompt=PROMPT, max_tokens=20, temperature=temperature,
                                seed=3, logprobs=True, top_logprobs=2, extra_body={"speculation": {"mode": mode}})
                assert streamed["logprobs"] == chat["logprobs"] and len(chat["logprobs"]) == 20


def _target_logprobs(backend, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        out = backend.pair.target(torch.tensor([prompt + ids]))
    logits = (out.logits if hasattr(out, "logits") else out)[0, len(prompt) - 1 : -1].to(torch.float64)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_seed_fixes_the_output_in_ar_and_sd(client, grpc_client, backend, mode):
    kwargs = dict(max_tokens=24, temperature=0.9, extra_body={"speculation": {"mode": mode}})
    first = complete(client, False, False, seed=7, **kwargs)["text"]
    again = complete(client, False, True, seed=7, **kwargs)["text"]
    grpc_out = grpc_client.generate(text=PROMPT, mode=mode, temperature=0.9, seed=7, max_new_tokens=24)
    assert first == again == grpc_out.text == direct(backend, backend.encode(PROMPT), mode, 0.9, 7).text
    others = {complete(client, False, False, seed=s, **kwargs)["text"] for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # the seed matters


def test_coupling_travels_as_an_extra_field_and_gives_ar_s_text_in_every_mode(client, grpc_client):
    """coupling "gumbel" over HTTP and gRPC: one seed, one text, whatever the mode;
    standard sampling in SD does not give AR's text for some seed (the power)."""
    def text(mode: str, coupling: str, seed: int) -> str:
        return complete(client, False, False, max_tokens=24, temperature=1.0, seed=seed,
                        extra_body={"coupling": coupling, "speculation": {"mode": mode}})["text"]

    for seed in (1, 2):
        coupled = {text(mode, "gumbel", seed) for mode in MODES}
        coupled.add(grpc_client.generate(text=PROMPT, mode="ssd", temperature=1.0, seed=seed, max_new_tokens=24,
                                         coupling="gumbel").text)
        assert len(coupled) == 1, coupled
    assert any(text("sd", "standard", s) != text("ar", "standard", s) for s in (1, 2, 3))


def test_top_k_travels_as_an_extra_field(client):
    """top_k 1 keeps only the argmax: sampling at temperature 1 then is greedy decoding."""
    greedy = complete(client, False, False, max_tokens=24, temperature=0)["text"]
    for mode in MODES:
        top1 = complete(client, False, False, max_tokens=24, temperature=1.0, seed=5,
                        extra_body={"top_k": 1, "speculation": {"mode": mode}})["text"]
        assert top1 == greedy, mode


def test_min_p_travels_as_an_extra_field_and_over_grpc(client, grpc_client):
    """min_p 1 keeps only the likeliest token (the tiny model has no exact ties): sampling at
    temperature 1 then is greedy decoding, in every mode, over HTTP and gRPC; without min_p
    the same seeds sample other text."""
    greedy = complete(client, False, False, max_tokens=24, temperature=0)["text"]
    for mode in MODES:
        sampled = {seed: complete(client, False, False, max_tokens=24, temperature=1.0, seed=seed,
                                  extra_body={"min_p": 1.0, "speculation": {"mode": mode}})["text"]
                   for seed in (5, 6)}
        assert set(sampled.values()) == {greedy}, mode
        assert grpc_client.generate(text=PROMPT, mode=mode, temperature=1.0, seed=5, max_new_tokens=24,
                                    min_p=1.0).text == greedy, mode
    plain = {complete(client, False, False, max_tokens=24, temperature=1.0, seed=seed)["text"] for seed in (5, 6)}
    assert plain != {greedy}


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_grpc_serves_the_logprobs_http_does_and_the_prompts(client, grpc_client, backend, mode):
    """logprobs over gRPC: per round and whole in Finished, the values the HTTP API gives for the
    same request; prompt_logprobs: the model's own log-softmax at each prompt position."""
    want = complete(client, False, False, max_tokens=12, temperature=0, logprobs=2,
                    extra_body={"speculation": {"mode": mode}})["logprobs"]
    messages = []
    got = grpc_client.generate(text=PROMPT, mode=mode, temperature=0, max_new_tokens=12, logprobs=2,
                               prompt_logprobs=1, on_message=messages.append)
    whole = [(backend.decode([e.token]), e.logprob, {backend.decode([t.token]): t.logprob for t in e.top})
             for e in got.logprobs]
    assert whole == [(t, pytest.approx(v, abs=1e-12), top) for t, v, top in want]
    assert [e for m in messages for e in m.logprobs] == got.logprobs
    ids = backend.encode(PROMPT)
    logits = backend.pair.target(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert [e.token for e in got.prompt_logprobs] == ids[1:]
    assert [e.logprob for e in got.prompt_logprobs] == pytest.approx(reference, abs=1e-9)
    with pytest.raises(grpc.RpcError) as info:
        grpc_client.generate(text=PROMPT, logprobs=21)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("logprobs")


def test_the_client_script_reports_logprobs_and_the_prompts_sum(server, grpc_client, caplog, capsys):
    """`ssd client` (launch/client.py) --logprobs / --prompt-logprobs: a line a token, then the sum,
    as gRPC gives them."""
    from ssd.app import client as script
    want = grpc_client.generate(text=PROMPT, temperature=0, max_new_tokens=4, logprobs=1, prompt_logprobs=0)
    with caplog.at_level("INFO", logger="ssd.client"):
        code = script.main([PROMPT, "--target", f"127.0.0.1:{server.port}", "--temperature", "0",
                            "--max-new-tokens", "4", "--logprobs", "1", "--prompt-logprobs", "0"])
    assert code == 0 and capsys.readouterr().out == want.text + "\n"
    lines = [r.getMessage() for r in caplog.records]
    total = sum(e.logprob for e in want.prompt_logprobs)
    assert f"prompt log-probability: {total:.6f} over {len(PROMPT) - 1} tokens" in lines
    assert sum(line.startswith("output token ") for line in lines) == 4


def test_tokenize_and_detokenize_as_vllm_has_them(server, backend):
    """/tokenize gives the ids a generation takes (a completion's text; a chat rendered by the
    template), /detokenize their text; bad input names its field."""
    url = base_url(server)
    got = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
    assert got == {"count": len(PROMPT), "max_model_len": 512, "tokens": backend.encode(PROMPT)}
    messages = [{"role": "user", "content": "ab"}]
    got = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert got["tokens"] == chat_ids(backend, messages)
    assert httpx.post(url + "/detokenize", json={"tokens": backend.encode(PROMPT)}).json() == {"prompt": PROMPT}
    for path, body, status, param in [
        ("/tokenize", {"prompt": "xyz"}, 400, "prompt"),  # outside the tiny alphabet
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "ab", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"prompt": "ab", "model": "gpt-4o"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 16]}, 400, "tokens"),
        ("/detokenize", {"tokens": "ab"}, 400, "tokens"),
    ]:
        reply = httpx.post(url + path, json=body)
        assert reply.status_code == status and reply.json()["error"]["param"] == param, (path, body, reply.text)


def test_tls_on_the_http_port(backend, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with serving(lambda: ChatBackend(backend), tls_cert=cert, tls_key=key) as srv:
        url = f"https://localhost:{srv.http_port}"
        assert httpx.get(url + "/health", verify=str(cert)).status_code == 200
        reply = httpx.post(url + "/v1/completions", verify=str(cert),
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{srv.http_port}/health", timeout=2)


@pytest.mark.parametrize("stop", ["lla", ["zz", "lla"]], ids=["string", "list"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings(client, grpc_client, stop, stream):
    out = complete(client, False, stream, max_tokens=60, temperature=0, stop=stop)
    grpc_out = grpc_client.generate(text=PROMPT, max_new_tokens=60, temperature=0.0, stop=["lla"])
    assert out["finish"] == "stop" == grpc_out.finish_reason
    assert out["text"] == grpc_out.text and "lla" not in out["text"]


def greedy_speculation(pair, prompt: list[int], n: int, k: int) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of greedy speculative decoding worked out from the two
    models alone (whole-sequence forwards, no cache): the prefill gives the first token; each
    round drafts min(K, tokens left - 1) and keeps the drafts the target agrees with, plus one."""
    def argmax(model, ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        return (out.logits if hasattr(out, "logits") else out)[0].argmax(-1).tolist()

    seq = [*prompt, argmax(pair.target, prompt)[-1]]
    rounds = drafted = accepted = 0
    while len(seq) - len(prompt) < n:
        d = min(k, n - (len(seq) - len(prompt)) - 1)
        guess = list(seq)
        for _ in range(d):
            guess.append(argmax(pair.draft, guess)[-1])
        target = argmax(pair.target, guess)[len(seq) - 1:]
        a = next((i for i in range(d) if guess[len(seq) + i] != target[i]), d)
        seq = guess[: len(seq) + a] + [target[a]]
        rounds, drafted, accepted = rounds + 1, drafted + d, accepted + a
    return rounds, drafted, accepted


def test_usage_counts_and_speculation_stats(client, backend):
    """Each request's usage and speculation stats are its own: greedy SD's rounds, drafted and
    accepted tokens as worked out from the models; SSD's, and its cache lookups and hits, as
    an engine of its own counts them for the same request; every ratio, of those counts."""
    prompt_ids = backend.encode(PROMPT)
    chat_prompt = chat_ids(backend, [{"role": "user", "content": "abc"}])
    whole = complete(client, False, False, max_tokens=9, temperature=0, extra_body={"speculation": {"mode": "ssd"}})
    streamed = complete(client, False, True, max_tokens=9, temperature=0, stream_options={"include_usage": True},
                        extra_body={"speculation": {"mode": "ssd", "k": 2, "fanout_budget": 4}})
    chat = complete(client, True, True, prompt=[{"role": "user", "content": "abc"}], max_completion_tokens=5,
                    temperature=0, stream_options={"include_usage": True})
    for out, prompt_tokens, n in ((whole, len(prompt_ids), 9), (streamed, len(prompt_ids), 9),
                                  (chat, len(chat_prompt), 5)):
        usage, stats = out["usage"], out["stats"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            prompt_tokens, n, prompt_tokens + n)
        assert stats["new_tokens"] == n == 1 + stats["rounds"] + stats["accepted"]  # a round: its accepted drafts + 1
        assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]
        assert stats["mean_accepted_length"] == stats["accepted"] / stats["rounds"]
    assert (whole["stats"]["mode"], streamed["stats"]["k"], chat["stats"]["mode"]) == ("ssd", 2, "sd")  # SD: the default
    assert (chat["stats"]["rounds"], chat["stats"]["drafted"], chat["stats"]["accepted"]) == greedy_speculation(
        backend.pair, chat_prompt, 5, backend.config.speculation.k)
    for out, settings in ((whole, {}), (streamed, {"k": 2, "budget": 4})):
        own = alone(backend, prompt_ids, 9, **settings).stats
        stats, spec = out["stats"], out["stats"]["spec"]
        assert (stats["rounds"], stats["drafted"], stats["accepted"]) == (own.rounds, own.drafted, own.accepted)
        assert (spec["lookups"], spec["hits"]) == (own.spec.lookups, own.spec.hits)
        assert spec["lookups"] == stats["rounds"] - 1  # every round but the first looks its outcome up
        assert spec["hit_rate"] == spec["hits"] / spec["lookups"]


def alone(backend, prompt_ids: list[int], n: int, k: int | None = None, budget: int | None = None):
    """A greedy SSD request on an engine of its own, no server."""
    speculation = dataclasses.replace(backend.config.speculation, mode="ssd")
    if k is not None:
        speculation = dataclasses.replace(speculation, k=k, fanout=dataclasses.replace(speculation.fanout, budget=budget))
    engine = make_engine("ssd", backend.pair, speculation)
    try:
        return engine.generate(GenerationRequest(prompt_ids, SamplingConfig(temperature=0.0),
                                                 GenerationConfig(max_new_tokens=n), speculation))
    finally:
        engine.close()


def test_models_health_and_metrics_on_the_http_port(server, client, grpc_client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(base_url(server) + "/health")
    assert health.status_code == 200 and health.json()["status"] == grpc_client.health() == "SERVING"
    metrics = httpx.get(base_url(server) + "/metrics")
    assert metrics.status_code == 200 and "ssd:num_requests_running" in metrics.text
    for method in ("GET", "POST"):  # vLLM's /ping: /health by another name
        assert httpx.request(method, base_url(server) + "/ping").json() == health.json()
    assert httpx.get(base_url(server) + "/version").json() == {"version": ssd.__version__}
    assert httpx.get(base_url(server) + "/load").json() == {"server_load": sum(server._worker.counts)}


# --- one batch, disconnects, admission -----------------------------------------


def test_only_streamed_requests_reach_the_engines_as_streams(client, grpc_client, monkeypatch):
    """GenerationRequest.streams: True where the client sees tokens as they come (an HTTP
    stream, gRPC), False where it sees only the result (stream: false), which a cluster runs
    again from its prompt after a lost target (tests/test_faults.py)."""
    from ssd.serve.worker import GenerationWorker

    seen: list[bool] = []
    submit = GenerationWorker.submit
    monkeypatch.setattr(GenerationWorker, "submit", lambda worker, job: seen.append(job.request.streams)
                        or submit(worker, job))
    for stream in (False, True):
        complete(client, False, stream, max_tokens=2)
        complete(client, True, stream, max_tokens=2)
    grpc_client.generate(text="abcab", max_new_tokens=2)
    assert seen == [False, False, True, True, True]


def test_http_and_grpc_streams_share_one_batch(backend):
    """Two HTTP and two gRPC streams at once run as rows of one batch, each exact."""
    with serving(lambda: ChatBackend(backend)) as srv:
        client = oai(srv)
        outs: dict[str, Any] = {}
        started = threading.Barrier(4)

        def http(key: str, prompt: str) -> None:
            started.wait()
            outs[key] = complete(client, False, True, prompt=prompt, max_tokens=120, temperature=0,
                                 extra_body={"speculation": {"mode": "sd"}})["text"]

        def grpc(key: str, prompt: str) -> None:
            with GenerationClient(f"127.0.0.1:{srv.port}") as own:
                started.wait()
                outs[key] = own.generate(text=prompt, mode="sd", temperature=0.0, max_new_tokens=120).text

        jobs = {"h1": (http, "abcab"), "h2": (http, "ponm"), "g1": (grpc, "aaaabbbb"), "g2": (grpc, "mnop")}
        threads = [threading.Thread(target=fn, args=(key, prompt)) for key, (fn, prompt) in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        batch = srv.metrics.snapshot().batch
    for key, (_, prompt) in jobs.items():
        assert outs[key] == direct(backend, backend.encode(prompt), "ar", max_new=120).text, key
    assert batch.n > 0 and max(i for i, c in enumerate(batch.counts) if c) >= 2, batch  # steps of 3-4 rows ran


@pytest.fixture(params=["alone", "batched"])
def slow(request, backend):
    """~20 ms per round, queue of 1: a long request holds the only slot for seconds; it
    runs alone (a backend without batch engines) or as a row of the mode's batch."""
    if request.param == "alone":
        load = lambda: ControlledBackend(backend, round_delay_s=0.02)  # noqa: E731
    else:
        load = lambda: ChatBackend(backend, round_delay_s=0.02)  # noqa: E731
    with serving(load, max_queue=1) as srv:
        yield srv


def _next_request_starts_at_once(srv: OpenAIServer, limit_s: float = 2.0) -> None:
    """The freed slot takes the next request: the abort lands when the server next writes to the
    closed connection and the row leaves at the worker's next step, both within limit_s."""
    assert _wait(lambda: srv._counts() == (0, 0), timeout=limit_s), srv._counts()
    started = time.monotonic()
    out = complete(oai(srv), False, False, max_tokens=2, temperature=0, extra_body={"speculation": {"mode": "ar"}})
    assert out["finish"] == "length" and out["stats"]["queue_s"] < limit_s
    assert time.monotonic() - started < limit_s


def _aborted(srv: OpenAIServer) -> int:
    return srv.metrics.snapshot().finished["aborted"]


def test_disconnect_mid_stream_frees_the_row(slow):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "speculation": {"mode": "ar"}}
    with httpx.stream("POST", base_url(slow) + "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data:")) >= 3
    _next_request_starts_at_once(slow)  # the queue holds 1: a leftover row would make this a 429
    assert _aborted(slow) == 1


def test_disconnect_while_waiting_for_a_whole_response_frees_the_row(slow):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "speculation": {"mode": "ar"}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url(slow) + "/v1/completions", json=body, timeout=0.5)
    assert _wait(lambda: _aborted(slow) == 1)
    _next_request_starts_at_once(slow)


def test_queue_full_is_429(slow):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True, "speculation": {"mode": "ar"}}
    with httpx.stream("POST", base_url(slow) + "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()  # kept: dropping it would close the connection (and free the slot)
        next(lines)
        with pytest.raises(openai.RateLimitError) as info:
            oai(slow).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"


def test_503_while_loading_then_serving(backend):
    gate = threading.Event()

    def load():
        assert gate.wait(30)
        return ChatBackend(backend)

    with serving(load, wait=False) as srv, GenerationClient(f"127.0.0.1:{srv.port}") as grpc_client:
        url = base_url(srv)
        assert httpx.get(url + "/health").status_code == 503 and grpc_client.health() == "NOT_SERVING"
        assert httpx.get(url + "/ping").status_code == 503
        with pytest.raises(openai.InternalServerError) as info:
            oai(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 503 and "loading" in info.value.body["message"]
        assert httpx.get(url + "/v1/models").status_code == 503
        gate.set()
        assert srv.wait_ready(30)
        assert httpx.get(url + "/health").status_code == 200 and grpc_client.health() == "SERVING"
        assert oai(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text


def test_shutdown_finishes_running_streams_and_refuses_new_requests(backend):
    with serving(lambda: ChatBackend(backend, round_delay_s=0.02)) as srv:
        client, out = oai(srv), {}
        first = threading.Event()

        def stream() -> None:
            text = ""
            for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                                   stream=True):
                text += chunk.choices[0].text
                first.set()
                out["finish"] = chunk.choices[0].finish_reason
            out["text"] = text

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        stopper = threading.Thread(target=srv.stop, kwargs={"grace_s": 30})
        stopper.start()
        assert _wait(lambda: srv.servicer.unavailable is not None)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 503 and "shutting down" in info.value.body["message"]
        reader.join(30)
        stopper.join(30)
    assert out["finish"] == "length" and out["text"] == direct(backend, backend.encode(PROMPT), "ar", max_new=60).text


def test_an_engine_fault_is_an_error_not_a_dead_server(backend):
    """A whole response gets a 500 in the error shape; a stream gets an error event, then [DONE]."""
    with serving(lambda: ControlledBackend(backend, fail_after_rounds=2)) as srv:
        with pytest.raises(openai.InternalServerError) as info:
            oai(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=20)
        assert info.value.status_code == 500 and "injected engine fault" in info.value.body["message"]
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stream": True}
        reply = httpx.post(base_url(srv) + "/v1/completions", json=body, timeout=30)
        events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "generation_failed"
        assert httpx.get(base_url(srv) + "/health").status_code == 200


def test_token_guards_v1_but_not_health(backend):
    with serving(lambda: ChatBackend(backend), token="s3cret") as srv:
        url = base_url(srv)
        for token in ("wrong", None):
            headers = {"authorization": f"Bearer {token}"} if token else {}
            reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            oai(srv, "wrong").models.list()
        assert oai(srv, "s3cret").completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices[0].text
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        for path in ("/openapi.json", "/docs", "/redoc"):  # no schema of every route to anyone without the key
            for headers in ({}, {"authorization": "Bearer s3cret"}):
                assert httpx.get(url + path, headers=headers).status_code == 404, path


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- bad input ------------------------------------------------------------------


def _ok(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "ab"}], **fields}


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (path, body: a dict sent as JSON or raw bytes, expected status, expected param)
BAD = [
    (C, _ok(temperature="hot"), 400, "temperature"),
    (C, _ok(temperature=-0.5), 400, "temperature"),
    (C, _ok(top_p=0), 400, "top_p"),
    (C, _ok(top_p=1.5), 400, "top_p"),
    (C, _ok(top_k=-1), 400, "top_k"),
    (C, _ok(min_p=1.5), 400, "min_p"),
    (C, _ok(min_p=-0.1), 400, "min_p"),
    (C, _ok(min_p="low"), 400, "min_p"),
    (C, _ok(repetition_penalty=0), 400, "repetition_penalty"),
    (C, _ok(repetition_penalty=-1.5), 400, "repetition_penalty"),
    (C, _ok(min_tokens=-1), 400, "min_tokens"),
    (C, _ok(min_tokens=9, max_tokens=8), 400, "min_tokens"),
    (C, _ok(min_tokens=2, structured_outputs={"regex": "[ab]+"}), 400, "min_tokens"),
    (C, _ok(stop_token_ids=[16]), 400, "stop_token_ids"),
    (C, _ok(stop_token_ids="1"), 400, "stop_token_ids"),
    (C, _ok(allowed_token_ids=[]), 400, "allowed_token_ids"),
    (C, _ok(allowed_token_ids=[-1]), 400, "allowed_token_ids"),
    (C, _ok(allowed_token_ids=[1], structured_outputs={"regex": "[ab]+"}), 400, "allowed_token_ids"),
    (C, _ok(bad_words=[""]), 400, "bad_words[0]"),
    (C, _ok(bad_words=["ab", "xyz"]), 400, "bad_words[1]"),
    (C, _ok(bad_words=["ab"] * 9), 400, "bad_words"),
    (C, _ok(bad_words=["ab"], structured_outputs={"regex": "[ab]+"}), 400, "bad_words"),
    (C, _ok(coupling="philox"), 400, "coupling"),
    (C, _ok(coupling=1), 400, "coupling"),
    (C, _ok(coupling=""), 400, "coupling"),  # "" is gRPC's unset, not HTTP's
    (C, _ok(max_tokens=0), 400, "max_tokens"),
    (C, _ok(max_tokens=10**6), 400, "max_tokens"),
    (C, _ok(max_tokens=2**40), 400, "max_tokens"),
    (C, _ok(max_tokens=True), 400, "max_tokens"),
    (C, _ok(max_tokens=3.5), 400, "max_tokens"),
    (C, _ok(seed=-1), 400, "seed"),
    (C, _ok(seed="7"), 400, "seed"),
    (C, _ok(n=0), 400, "n"),
    (C, _ok(n=2, best_of=1), 400, "best_of"),
    (C, _ok(best_of=3, stream=True), 400, "best_of"),
    (C, _ok(stop=["a", 3]), 400, "stop[1]"),
    (C, _ok(stop=[""]), 400, "stop[0]"),
    (C, _ok(stop=""), 400, "stop"),
    (C, _ok(stop=["a"] * 9), 400, "stop"),
    (C, _ok(logprobs=21), 400, "logprobs"),
    (C, _ok(presence_penalty=2.5), 400, "presence_penalty"),
    (C, _ok(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, _ok(logit_bias={"99": 5}), 400, "logit_bias"),
    (C, _ok(logit_bias={"x": 5}), 400, "logit_bias"),
    (C, _ok(logit_bias={"1": 101}), 400, "logit_bias"),
    (C, _ok(echo=True, logprobs=1, stream=True), 400, "echo"),
    (C, _ok(suffix="ab"), 400, "suffix"),
    (C, _ok(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema.schema"),
    (C, _ok(response_format={"type": "json_object"}), 400, "response_format"),  # no "{" in 16 tokens
    (C, _ok(response_format={"type": "yaml"}), 400, "response_format.type"),
    (C, _ok(structured_outputs={"regex": "(ab"}), 400, "structured_outputs.regex"),
    (C, _ok(structured_outputs={"regex": "ab", "choice": ["a"]}), 400, "structured_outputs"),
    (C, _ok(guided_regex="ab", structured_outputs={"regex": "ab"}), 400, "guided_regex"),
    (C, _ok(guided_choice=[]), 400, "guided_choice"),
    (C, _ok(guided_json="{not json"), 400, "guided_json"),
    (C, _ok(guided_regex="ab", ignore_eos=True), 400, "ignore_eos"),
    (CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                 tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice.function.name"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "tools[1].function.name"),
    (CHAT, _chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments"),
    (C, _ok(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, _ok(prompt=""), 400, "prompt"),
    (C, _ok(prompt="xyz"), 400, "prompt"),
    (C, _ok(prompt=[]), 400, "prompt"),
    (C, _ok(prompt=[1, 16]), 400, "prompt"),
    (C, _ok(prompt=[1, -1]), 400, "prompt"),
    (C, _ok(prompt=[1, 2**40]), 400, "prompt"),
    (C, _ok(prompt=["ab", "xyz"]), 400, "prompt[1]"),
    (C, _ok(prompt=[[1, 2], [3, 99]]), 400, "prompt[1]"),
    (C, _ok(prompt="a" * 600), 400, "prompt"),
    (C, {"prompt": PROMPT}, 400, "model"),
    (C, _ok(model="gpt-4o"), 404, "model"),
    (C, _ok(speculation={"mode": "xl"}), 400, "speculation.mode"),
    (C, _ok(speculation={"mode": "sd", "k": 0}), 400, "speculation.k"),
    (C, _ok(speculation={"mode": "sd", "k": 17}), 400, "speculation.k"),
    (C, _ok(speculation={"mode": "ar", "k": 2}), 400, "speculation.k"),
    (C, _ok(speculation={"mode": "ssd", "fanout_budget": 0}), 400, "speculation.fanout_budget"),
    (C, _ok(speculation={"mode": "ssd", "fanout_kind": "zipf"}), 400, "speculation.fanout_kind"),
    (C, _ok(speculation={"mode": "ssd", "saguaro_c": 1.5}), 400, "speculation.saguaro_c"),
    (C, _ok(speculation={"mode": "ssd", "backup": "oracle"}), 400, "speculation.backup"),
    (C, _ok(speculation={"mode": "ssd", "backup": ""}), 400, "speculation.backup"),
    (C, _ok(speculation={"mode": "sd", "tree": 3}), 400, "speculation.tree"),
    (CHAT, _chat(messages=[]), 400, "messages"),
    (CHAT, _chat(messages=[{"role": "", "content": "ab"}]), 400, "messages[0].role"),
    (CHAT, _chat(messages=[{"role": "robot", "content": "ab"}]), 400, "messages"),
    (CHAT, _chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (CHAT, _chat(messages="ab"), 400, "messages"),
    (CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, _chat(max_completion_tokens=3, max_tokens=3), 400, "max_tokens"),  # both given
    (C, b'{"model": "tiny", "prompt": "ab", "temperature": NaN}', 400, "temperature"),
    (C, b'{"model": "tiny", "prompt": "ab", "top_p": Infinity}', 400, "top_p"),
    (C, _ok(seed=2**64), 400, "seed"),
    (C, b"[" * 4000, 400, "body"),
    (C, b'{"model": "tiny", "prompt": ', 400, "body"),
    (C, b"[1, 2]", 400, "body"),
    (C, b"", 400, "body"),
    (C, b'{"model": "tiny", "prompt": "ab\xff"}', 400, "prompt"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3("}]}', 400, "messages[0].content"),
    (C, b'{"model": "tiny", "prompt": "' + b"a" * 5000 + b'"}', 413, "body"),
]


@pytest.fixture(scope="module")
def strict_server(backend):
    """A small body limit, so an oversize body is cheap to send."""
    with serving(lambda: ChatBackend(backend), max_message_bytes=4096) as srv:
        yield srv


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_status_and_names_the_field(strict_server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(base_url(strict_server) + path, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"].startswith(param), error
    assert httpx.get(base_url(strict_server) + "/health").status_code == 200  # nothing took the server down


def test_unknown_path_and_method_keep_the_error_shape(server):
    for reply in (httpx.get(base_url(server) + "/v1/nothing"), httpx.get(base_url(server) + "/v1/completions")):
        assert reply.status_code in (404, 405) and set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_http_port_flag():
    import argparse

    from ssd.app.cli import add_serve_args, serve_options_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_options_from_args(parser.parse_args(["--http-port", "8000"])).http_port == 8000
    assert serve_options_from_args(parser.parse_args([])).http_port is None


def test_a_taken_http_port_fails_the_start_and_leaves_nothing_running(tmp_path):
    """The gRPC port is let go, and the front end's store writer ends with it."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        server = OpenAIServer(ServeOptions(port=0, http_port=port, store_dir=str(tmp_path)), lambda: None)
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            server.start()
    assert not [t for t in threading.enumerate() if t.name == "ssd-store" and t.is_alive()]
    assert server.http is None


# --- one service under both front ends -----------------------------------------------


def test_the_http_front_end_imports_no_protobuf_and_no_grpc_front_end():
    """ssd.openai sits on the neutral GenerationService, not on the gRPC servicer."""
    import sys

    code = ("import sys; import ssd.openai.http, ssd.openai.app, ssd.openai.schema; "
            "loaded = [m for m in ('google.protobuf', 'grpc', 'ssd.serve.server', 'ssd.serve._proto', "
            "'ssd.serve.convert') if m in sys.modules]; print(loaded); sys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_both_front_ends_make_the_same_neutral_request():
    from ssd.openai import schema
    from ssd.serve import protos
    from ssd.serve.client import build_request
    from ssd.serve.convert import from_proto

    pb, _ = protos.load()
    grpc_side = from_proto(build_request(
        pb, messages=[{"role": "user", "content": "ab"}], mode="ssd", stop=["x"], max_new_tokens=8,
        temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=7, coupling="gumbel", k=2, fanout_budget=4,
        saguaro_c=0.5))
    http_side = schema.to_request(schema.parse(schema.ChatBody, {
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}],
        "stop": "x", "max_completion_tokens": 8, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "seed": 7,
        "coupling": "gumbel", "speculation": {"mode": "ssd", "k": 2, "fanout_budget": 4, "saguaro_c": 0.5}}))
    assert grpc_side == http_side


def test_connections_send_small_writes_at_once(server):
    """Nagle's algorithm off (TCP_NODELAY) on the HTTP connections: with it on, a kept-alive
    connection's every response after the first (headers, then body) and a stream's chunks
    waited ~40 ms for the client's delayed ACK."""
    import socket

    with httpx.Client(base_url=base_url(server)) as client:
        assert client.get("/health").status_code == 200  # the connection stays open
        connections = server.http._server.server_state.connections
        sockets = [c.transport.get_extra_info("socket") for c in list(connections)]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
