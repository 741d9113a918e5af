"""The prompt's log-probabilities (completions' echo with logprobs, as lm-evaluation-harness
scores a continuation): the target's own log-softmax at every prompt position, in every mode.

The reference is one plain forward of the whole prompt through the fp64 model; the engines
prefill in chunks of 3 (so rows of one chunk predict the next chunk's first token), as rows of
one batch beside a row that asks for none. Asking changes nothing else: the same output tokens.
Over HTTP: `echo` with `logprobs` lays the prompt's tokens out first, the first one without a
value (nothing precedes it), as OpenAI's legacy completions do; with `stream` it is refused.
On llama.cpp: test_llamacpp (`..._prompt_logprobs_...`).
"""

from __future__ import annotations

import pytest
import torch

from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.saguaro.target import SSDEngine
from ssd.tools.bench.sampling_check import run_rows
from tests.test_processing import SMALL, V, pair  # noqa: F401 (pair: a fixture)

PROMPTS = [[0, 3, 1, 4, 2, 5, 5, 1], [2, 2, 4, 0, 1]]
TOP = 2
BATCHING = BatchingConfig(max_rows=4, prefill_chunk=3)


def engine(mode: str, pair):
    target, draft = pair
    tok = TinyTokenizer(V)
    if mode == "ar":
        return AREngine(target, tok, BATCHING)
    spec = SpeculationConfig(mode=mode, k=3)
    if mode == "sd":
        return SDEngine(target, draft, tok, spec, BATCHING)
    return SSDEngine.in_process(target, draft, tok, spec, BATCHING)


@torch.no_grad()
def reference(model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i + 1] | prompt[: i + 1]) rows [len(prompt) - 1, V] from one forward."""
    return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].double(), -1)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_prompt_logprobs_are_the_models_own_at_every_position(pair, mode):
    requests = [GenerationRequest(p, SamplingConfig(), GenerationConfig(max_new_tokens=6), prompt_logprobs=TOP)
                for p in PROMPTS]
    plain = GenerationRequest(PROMPTS[0], SamplingConfig(), GenerationConfig(max_new_tokens=6))
    eng = engine(mode, pair)
    try:
        *asked, alone = run_rows(eng, requests + [plain])
    finally:
        eng.close()
    assert alone.prompt_logprobs is None
    for prompt, got in zip(PROMPTS, asked):
        want = reference(pair[0], prompt)
        assert [e.token for e in got.prompt_logprobs] == prompt[1:]
        values = torch.tensor([e.logprob for e in got.prompt_logprobs], dtype=torch.float64)
        torch.testing.assert_close(values, want.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0])
        top_values, top_ids = torch.topk(want, TOP, dim=-1)
        assert [[i for i, _ in e.top] for e in got.prompt_logprobs] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in got.prompt_logprobs], dtype=torch.float64),
                                   top_values)
    assert asked[0].token_ids == alone.token_ids  # asking changes nothing else


def test_echo_with_logprobs_lays_out_the_prompts_then_the_outputs_tokens(pair):
    """Through the server: the continuation's log-likelihood a harness sums is the model's."""
    from ssd.config import load_config
    from ssd.serve.backend import LocalBackend
    from tests.conftest import ROOT
    from tests.test_http import ChatBackend, oai, serving

    backend = LocalBackend(load_config(ROOT / "configs" / "tiny.yaml"))
    try:
        with serving(lambda: ChatBackend(backend)) as srv:
            client = oai(srv)
            prompt = "abcab"
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                              echo=True, logprobs=1)
            with pytest.raises(Exception, match="echo"):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                          stream=True)
        choice = reply.choices[0]
        ids = backend.encode(prompt)
        logprobs = choice.logprobs
        assert choice.text.startswith(prompt) and "".join(logprobs.tokens) == choice.text
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids) + 1)]
        want = reference(backend.pair.target, ids)
        expected = want.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-9)
    finally:
        backend.close()

