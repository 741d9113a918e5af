"""The real pair on the llama.cpp backend (the shipped q4_k_m GGUF files, the
options its invariance probe picks): greedy SD, SSD and batched rows == AR.

The quantized kernels are where batch invariance can break (the tiny F32
models of tests/test_llamacpp.py take other kernels), so this is the test
that the probed options hold on the models users run.
"""


import pytest
import torch
import yaml

pytest.importorskip("llama_cpp")

from ssd.config import FanoutConfig, GenerationConfig, ModelConfig, SamplingConfig, SpeculationConfig  # noqa: E402
from ssd.engine import AREngine, SDEngine  # noqa: E402
from ssd.engine.request import GenerationRequest  # noqa: E402
from ssd.models import load_model, load_tokenizer  # noqa: E402
from ssd.models.offline import DRAFT_NAME, TARGET_NAME  # noqa: E402
from ssd.models.tokenizer import encode_prompt  # noqa: E402
from ssd.saguaro.target import SSDEngine  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.test_llamacpp import _run_batch, torch_threads  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = yaml.safe_load((ROOT / "configs" / "prompts" / "code.yaml").read_text())[:3]
GREEDY = SamplingConfig(temperature=0.0)
TOKENS = GenerationConfig(max_new_tokens=24)


@pytest.fixture(scope="module")
def pair():
    target, draft = (load_model(ModelConfig(name=n, backend="llamacpp", max_model_len=512))
                     for n in (TARGET_NAME, DRAFT_NAME))
    tokenizer = load_tokenizer(ModelConfig(name=TARGET_NAME, backend="llamacpp"))
    ids = [encode_prompt(tokenizer, p) for p in PROMPTS]
    ar = AREngine(target, tokenizer)
    return target, draft, tokenizer, ids, [ar.generate(GenerationRequest(i, GREEDY, TOKENS)).token_ids for i in ids]


def _request(ids, speculation=None):
    return GenerationRequest(ids, GREEDY, TOKENS, speculation)


def test_the_probe_picked_fast_invariant_options(pair):
    target, draft, *_ = pair
    for model in (target, draft):
        # Repacked (where they run), the 4-row kernel starts at 4 tokens (AMD EPYC: 3); plain: 7.
        assert model.precision == "gguf q4_k_m" and model.invariant_options()["n_ubatch"] >= (3 if model.repacked else 5)


def test_sd_greedy_equals_ar(pair):
    target, draft, tokenizer, ids, want = pair
    spec = SpeculationConfig(mode="sd", k=4)
    engine = SDEngine(target, draft, tokenizer)
    assert [engine.generate(_request(i, spec)).token_ids for i in ids] == want


def test_ssd_greedy_equals_ar_and_hits(pair):
    target, draft, tokenizer, ids, want = pair
    spec = SpeculationConfig(mode="ssd", k=2, fanout=FanoutConfig(budget=4))
    engine = SSDEngine.in_process(target, draft, tokenizer, spec)
    try:
        outs = [engine.generate(_request(i, spec)) for i in ids]
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.spec.hits for o in outs) > 0


def test_batched_ar_rows_equal_each_alone(pair):
    target, _, tokenizer, ids, want = pair
    assert _run_batch(AREngine(target, tokenizer), [_request(i) for i in ids]) == want


def test_logits_do_not_depend_on_the_thread_count(pair):
    """The cluster's target takes the draft's core while SSD idles and gives it back
    (ssd.cluster.workers), so a request's forwards run on 1 or 2 threads: a prompt
    chunk, a verification and a decode step give the same logits, bit for bit."""
    from ssd.models.llamacpp import LlamaCppContext, LlamaCppSequence

    target, *_ = pair
    ids = [(7 * i + 3) % 1000 + 100 for i in range(60)]
    runs = []
    for threads in (1, 2):
        seq = LlamaCppSequence(LlamaCppContext(target, n_threads=threads, n_ctx_seq=128))
        runs.append((seq.forward(ids, last_only=True), seq.forward([7, 8, 9]), seq.forward([4])))
        seq.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


LONG_PROMPTS = [ids for ids in ([(a * i + b) % 5000 + 100 for i in range(300)] for a, b in ((7, 3), (11, 5), (13, 1)))]


def _long_outcomes(target, tokenizer):
    """Three 300-token prompts, greedy with logprobs: batched on one engine, and each alone."""
    requests = [GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=12), logprobs=0) for p in LONG_PROMPTS]
    outcome = lambda r: (r.token_ids, [e.logprob for e in r.logprobs])  # noqa: E731
    together = _run_batch(AREngine(target, tokenizer), requests, outcome)
    return together, [outcome(AREngine(target, tokenizer).generate(r)) for r in requests]


def test_rows_past_256_positions_equal_each_alone_and_an_f16_cache_parts_them(pair):
    """Past 256 positions llama.cpp's KV view holds 512 cells, where ggml's flash attention
    over an F16 cache takes a split-KV path for a lone query row (docs/llamacpp.md): with the
    probe's cache, batched rows equal each alone, tokens and logprobs bit for bit; with
    llama.cpp's F16 cache (`model.llamacpp_kv: f16`) their logprobs part."""
    target, _, tokenizer, *_ = pair
    with torch_threads(2):  # with one, the split path has one chunk and agrees with the rest
        together, alone = _long_outcomes(target, tokenizer)
        assert target.kv_type == "bf16/f16" and together == alone
        f16 = load_model(ModelConfig(name=TARGET_NAME, backend="llamacpp", max_model_len=512, llamacpp_kv="f16"))
        together, alone = _long_outcomes(f16, tokenizer)
    assert max(abs(a - b) for (_, x), (_, y) in zip(together, alone) for a, b in zip(x, y)) > 0


def test_logits_past_256_positions_do_not_depend_on_the_thread_count(pair):
    """As above, after 300 positions, where an F16 cache's split-KV path would cut the cells by thread."""
    from ssd.models.llamacpp import LlamaCppContext, LlamaCppSequence

    target, *_ = pair

    def runs(kv_type):
        out = []
        for threads in (1, 2):
            seq = LlamaCppSequence(LlamaCppContext(target, n_threads=threads, n_ctx_seq=512, kv_type=kv_type))
            seq.forward(LONG_PROMPTS[0][:128], last_only=True)
            seq.forward(LONG_PROMPTS[0][128:256], last_only=True)
            out.append((seq.forward(LONG_PROMPTS[0][256:], last_only=True), seq.forward([7, 8, 9]), seq.forward([4])))
            seq.close()
        return [torch.equal(a, b) for a, b in zip(*out)]

    assert all(runs(None))
    assert runs("f16") == [True, True, False]  # the premise: the lone step parts
