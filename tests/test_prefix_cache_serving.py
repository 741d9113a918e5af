"""The prefix cache over the wire: a chat's next turn reports the prompt tokens an earlier
request's cache served (OpenAI's usage.prompt_tokens_details.cached_tokens, the Responses API's
input_tokens_details, gRPC's RequestStats.cached_prompt_tokens, the ssd:prefix_cache_hits
counter), and its output is the engine's for that prompt on a fresh engine without the cache
(ssd.engine.prefix; the bit-for-bit checks are tests/test_prefix_cache*.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from ssd.config import GenerationConfig, SamplingConfig, load_config
from ssd.engine import AREngine
from ssd.engine.request import GenerationRequest
from ssd.serve.backend import LocalBackend
from ssd.serve.client import GenerationClient
from tests.conftest import ROOT
from tests.test_http import ChatBackend, oai, serving

CHUNK = 4
PROMPT = "abcabcabcab"


@pytest.fixture(scope="module")
def cached():
    config = load_config(ROOT / "configs" / "tiny.yaml")
    config.batching = dataclasses.replace(config.batching, prefill_chunk=CHUNK)
    backend = LocalBackend(config)
    with serving(lambda: ChatBackend(backend)) as srv:  # a stand-in chat template, for the Responses API
        yield srv, backend
    backend.close()


def _fresh(backend, text: str, n: int) -> list[int]:
    engine = AREngine(backend.pair.target, backend.pair.tokenizer,
                      dataclasses.replace(backend.config.batching, prefix_cache=False))
    request = GenerationRequest(backend.encode(text), SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=n))
    return engine.generate(request).token_ids


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_next_turn_over_http_reports_cached_tokens_and_equals_a_fresh_run(cached, mode):
    srv, backend = cached
    client = oai(srv)
    extra = {"speculation": {"mode": mode}, "return_tokens_as_token_ids": True}
    text = PROMPT + {"ar": "ab", "sd": "cd", "ssd": "ef"}[mode]  # a prompt of this test's own
    first = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0, extra_body=extra)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    _idle(srv, mode)  # the reply prefilled too (the next test): the count below is then fixed
    turn = text + first.choices[0].text + "ca"
    second = client.completions.create(model="tiny", prompt=turn, max_tokens=6, temperature=0, extra_body=extra)
    held = len(backend.encode(text + first.choices[0].text))
    assert second.usage.prompt_tokens_details.cached_tokens == held // CHUNK * CHUNK > 0
    assert second.choices[0].text == backend.decode(_fresh(backend, turn, 6))


def test_grpc_responses_and_metrics_report_them_too(cached):
    srv, backend = cached
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        first = client.generate(text="mnomnomnomngh", max_new_tokens=5, temperature=0.0, mode="ar", timeout=60)
        _idle(srv, "ar")
        turn = "mnomnomnomngh" + first.text + "b"
        second = client.generate(text=turn, max_new_tokens=5, temperature=0.0, mode="ar", timeout=60)
        assert first.finished.stats.cached_prompt_tokens == 0
        held = len(backend.encode("mnomnomnomngh" + first.text))
        assert second.finished.stats.cached_prompt_tokens == held // CHUNK * CHUNK
        assert second.token_ids == _fresh(backend, turn, 5)
        assert "ssd:prefix_cache_hits_total" in client.stats().prometheus_text
    client = oai(srv)
    once = client.responses.create(model="tiny", input="jkljkljkljkij", max_output_tokens=4, temperature=0)
    again = client.responses.create(model="tiny", input="jkljkljkljkij" + once.output_text + "a",
                                    max_output_tokens=4, temperature=0)
    assert once.usage.input_tokens_details.cached_tokens == 0 < again.usage.input_tokens_details.cached_tokens


def _idle(srv, mode: str, timeout_s: float = 30.0) -> None:
    """Wait until the server's `mode` engine has no idle work left (its replies prefilled)."""
    deadline = time.monotonic() + timeout_s
    engine = srv._worker._engines[mode]
    while engine.kv.prefix.warmable() is not None:
        assert time.monotonic() < deadline, "the idle work never ran out"
        time.sleep(0.01)


def test_the_server_prefills_a_reply_before_the_next_turn(cached):
    """Between requests the worker runs the engines' idle work: the next turn then takes the
    first turn's prompt and reply in whole chunks, and its output is a fresh run's."""
    srv, backend = cached
    client = oai(srv)
    text = "popopopopop"
    extra = {"speculation": {"mode": "ar"}}
    first = client.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, extra_body=extra)
    _idle(srv, "ar")
    turn = text + first.choices[0].text + "ab"
    second = client.completions.create(model="tiny", prompt=turn, max_tokens=6, temperature=0, extra_body=extra)
    held = len(backend.encode(text + first.choices[0].text))
    assert second.usage.prompt_tokens_details.cached_tokens == held // CHUNK * CHUNK > len(backend.encode(text))
    assert second.choices[0].text == backend.decode(_fresh(backend, turn, 6))


def _served(srv) -> float:
    """The ssd:prefix_cache_hits counter: prompt tokens an earlier request's cache, or another
    row's prefill, served."""
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        text = client.stats().prometheus_text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("ssd:prefix_cache_hits_total"))


def test_samples_of_one_completion_prefill_its_prompt_once(cached):
    """n = 3 greedy samples of a prompt no cache holds: the later samples take the first's whole
    chunks (copied while it runs, or from its entry once it finished: the worker's timing says
    which), and every sample equals a fresh run."""
    srv, backend = cached
    before = _served(srv)
    prompt = "hijhijhijhijhij"
    out = oai(srv).completions.create(model="tiny", prompt=prompt, n=3, max_tokens=5, temperature=0)
    want = backend.decode(_fresh(backend, prompt, 5))
    assert [c.text for c in out.choices] == [want] * 3
    assert _served(srv) - before >= (len(backend.encode(prompt)) - 1) // CHUNK * CHUNK
