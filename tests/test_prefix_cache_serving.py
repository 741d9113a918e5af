"""The prefix cache over the wire: a chat's next turn reports the prompt tokens an earlier
request's cache served (OpenAI's usage.prompt_tokens_details.cached_tokens, the Responses API's
input_tokens_details, gRPC's RequestStats.cached_prompt_tokens, the ssd:prefix_cache_hits
counter), and its output is the engine's for that prompt on a fresh engine without the cache
(ssd.engine.prefix; the bit-for-bit checks are tests/test_prefix_cache*.py)."""

from __future__ import annotations

import dataclasses

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
    turn = text + first.choices[0].text + "ca"
    second = client.completions.create(model="tiny", prompt=turn, max_tokens=6, temperature=0, extra_body=extra)
    prompt = len(backend.encode(text))
    assert second.usage.prompt_tokens_details.cached_tokens == prompt // CHUNK * CHUNK > 0
    assert second.choices[0].text == backend.decode(_fresh(backend, turn, 6))


def test_grpc_responses_and_metrics_report_them_too(cached):
    srv, backend = cached
    with GenerationClient(f"127.0.0.1:{srv.port}") as client:
        first = client.generate(text="mnomnomnomngh", max_new_tokens=5, temperature=0.0, mode="ar", timeout=60)
        turn = "mnomnomnomngh" + first.text + "b"
        second = client.generate(text=turn, max_new_tokens=5, temperature=0.0, mode="ar", timeout=60)
        assert first.finished.stats.cached_prompt_tokens == 0
        assert second.finished.stats.cached_prompt_tokens == len(backend.encode("mnomnomnomngh")) // CHUNK * CHUNK
        assert second.token_ids == _fresh(backend, turn, 5)
        assert "ssd:prefix_cache_hits_total" in client.stats().prometheus_text
    client = oai(srv)
    once = client.responses.create(model="tiny", input="jkljkljkljkij", max_output_tokens=4, temperature=0)
    again = client.responses.create(model="tiny", input="jkljkljkljkij" + once.output_text + "a",
                                    max_output_tokens=4, temperature=0)
    assert once.usage.input_tokens_details.cached_tokens == 0 < again.usage.input_tokens_details.cached_tokens
