"""The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft): SD and SSD greedy == AR greedy.

Slow (the first run also converts the models). The target runs in fp32 and in
int8 (the default on x86): bf16 rounds one-token and multi-token forwards
differently (tests/test_real_pair_bf16.py allows near-ties), fp32 only by
~1e-7, and int8 with per-row scales and row attention not at all
(ssd.models.quant, ssd.models.invariant), so token-for-token equality is a
fair demand of both. The draft is int8: its precision only changes
acceptance, never the output. The int8 target, the default on x86, runs all
three prompts as rows of one batch (its forwards do not depend on the row
count), the fp32 one (hosts without int8 kernels) the first prompt alone,
which keeps this file's share of the suite near a minute and a half.
"""

import pytest
import yaml

from ssd.config import (
    FanoutConfig,
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpeculationConfig,
)
from ssd.engine import AREngine, SDEngine
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import load_model
from ssd.models.offline import TARGET_NAME
from ssd.models.quant import int8_supported
from ssd.models.tokenizer import encode_prompt
from tests.conftest import ROOT
from tests.test_batch import ok, run_batch

pytestmark = pytest.mark.slow

PROMPTS = yaml.safe_load((ROOT / "configs" / "prompts" / "code.yaml").read_text())[:3]
GREEDY = SamplingConfig(temperature=0.0)
TOKENS = GenerationConfig(max_new_tokens=24)


@pytest.fixture(scope="module", params=["fp32", "int8"])
def real_pair(request, real_draft, real_tokenizer):
    quantization = "int8" if request.param == "int8" else None
    if quantization and not int8_supported():
        pytest.skip("needs torch's x86 int8 kernels")
    target = load_model(ModelConfig(name=TARGET_NAME, dtype="fp32", quantization=quantization))
    prompts = PROMPTS if quantization else PROMPTS[:1]
    return target, real_draft, real_tokenizer, prompts  # the draft and tokenizer: tests/conftest.py, loaded once


@pytest.fixture(scope="module")
def ar_outputs(real_pair):
    target, _, tokenizer, prompts = real_pair
    return [out.token_ids for out in generate_rows(AREngine(target, tokenizer), tokenizer, prompts)]


def generate_rows(engine, tokenizer, prompts: list[str]) -> list:
    """Every prompt's greedy generation, the prompts as rows of one batch."""
    requests = [GenerationRequest(encode_prompt(tokenizer, p), GREEDY, TOKENS) for p in prompts]
    return [ok(finished) for finished in run_batch(engine, requests)]


def test_sd_greedy_equals_ar_on_code(real_pair, ar_outputs):
    target, draft, tokenizer, prompts = real_pair
    engine = SDEngine(target, draft, tokenizer, SpeculationConfig(mode="sd", k=4))
    for sd, expected in zip(generate_rows(engine, tokenizer, prompts), ar_outputs, strict=True):
        assert sd.token_ids == expected, sd.text
        assert sd.stats.acceptance_rate > 0.3, sd.stats.summary()  # the pair really speculates


def test_ssd_greedy_equals_ar_on_code(real_pair, ar_outputs):
    target, draft, tokenizer, prompts = real_pair
    spec = SpeculationConfig(mode="ssd", k=4, fanout=FanoutConfig(budget=8))
    with SSDEngine.in_process(target, draft, tokenizer, spec) as ssd:
        for out, expected in zip(generate_rows(ssd, tokenizer, prompts), ar_outputs, strict=True):
            assert out.token_ids == expected, out.text
            assert out.stats.spec.hits > 0, out.stats.summary()
