"""ssd's k-quant kernels (ssd/models/kernels): exact against the file's own weights, a row's
output bit-identical whatever shares its call, and every decoding path exact on a model that
runs on them.

Each invariance property is paired with a broken variant that must fail it (a reduction
reordered by the number of rows); the chi-square test with a broken verifier on the same pair.
"""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from ssd.config import ConfigError, GenerationConfig, ModelConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.drafting import drafted_chain
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, load_model
from ssd.models.fast import _attend, _attend_kernels, _attend_one_call
from ssd.models.kernels import build
from ssd.models.kernels.kquants import quantize_q4_k, quantize_q6_k
from ssd.models.kernels.qlinear import QLinear
from ssd.models.kv import KVSequence
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import build_cache
from ssd.saguaro.target import SSDEngine
from tests.batches import run_together
from tests.conftest import torch_threads
from tests.stats import ALPHA, chi_square_pvalue
from tests.test_distribution import accept_all, exact_joint, sd_samples

# Skipped only without a compiler: a kernel that fails to build fails every test below.
pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler for the GGUF kernels")

QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k, T.Q5_0: lambda w: quantize(w, T.Q5_0),
              T.Q8_0: lambda w: quantize(w, T.Q8_0)}
# 3072 inputs (12 blocks): past 9 rows the VNNI path reads them a span at a time (qmatmul.c's L1_FIT).
KINDS = pytest.mark.parametrize("kind, cols", [(T.Q4_K, 768), (T.Q6_K, 768), (T.Q5_0, 896), (T.Q8_0, 896),
                                               (T.Q4_K, 3072), (T.Q6_K, 3072)],
                                ids=["q4_k", "q6_k", "q5_0-padded", "q8_0-padded", "q4_k-spans", "q6_k-spans"])
ISAS = list(range(build.load().ssd_best_isa() + 1)) if build.compiler() else []
# Rows in blocks of 256: the smallest shapes whose linears all run on the kernels.
KTINY = TinyModelConfig(vocab_size=16, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, initializer_range=0.1, seed=0)
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


@pytest.fixture(autouse=True)
def best_isa():
    yield
    build.load().ssd_set_isa(-1)


def random_layer(kind: T, out: int = 40, cols: int = 768, seed: int = 0) -> tuple[QLinear, np.ndarray]:
    weights = np.random.default_rng(seed).normal(size=(out, cols)).astype(np.float32)
    raw = QUANTIZERS[kind](weights)
    return QLinear.from_gguf(kind, raw), raw


def uneven_rows(n: int, cols: int = 768, seed: int = 1) -> torch.Tensor:
    """Rows whose magnitudes span four orders: what shared scales would handle worst."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cols, generator=gen) * torch.logspace(-2, 2, n)[:, None]


def rows_depend_on_each_other(layer, cols: int = 768) -> bool:
    """Whether any row's output at 1..16 rows differs from that row computed alone."""
    rows = uneven_rows(16, cols)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(16)])
    return any(not torch.equal(layer(rows[:n]), alone[:n]) for n in range(2, 17))


@KINDS
@pytest.mark.parametrize("isa", ISAS)
def test_products_are_the_files_weights_times_the_rows(kind, cols, isa):
    build.load().ssd_set_isa(isa)
    layer, raw = random_layer(kind, cols=cols)
    x = uneven_rows(9, cols)
    exact = x @ torch.from_numpy(dequantize(raw, kind)).T
    error = ((layer(x) - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max()
    assert error < 0.02  # 8-bit activations, one scale per 256 values


@KINDS
@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_output_is_the_same_whatever_shares_its_call(kind, cols, isa):
    build.load().ssd_set_isa(isa)
    layer, _ = random_layer(kind, cols=cols)
    assert not rows_depend_on_each_other(layer, cols)


def test_the_invariance_check_catches_a_reduction_reordered_by_row_count():
    """Power: the same 768 inputs as two kernel calls of 256 and 512 summed, for calls of more than one row."""
    weights = np.random.default_rng(0).normal(size=(40, 768)).astype(np.float32)
    whole = QLinear.from_gguf(T.Q4_K, quantize_q4_k(weights))
    first, rest = (QLinear.from_gguf(T.Q4_K, quantize_q4_k(w)) for w in (weights[:, :256], weights[:, 256:]))

    def reordered(x: torch.Tensor) -> torch.Tensor:
        return whole(x) if x.shape[0] == 1 else first(x[:, :256]) + rest(x[:, 256:])

    assert rows_depend_on_each_other(reordered)


@KINDS
def test_every_instruction_set_and_thread_count_gives_the_same_bits(kind, cols):
    layer, _ = random_layer(kind, out=200, cols=cols)
    x = uneven_rows(11, cols)
    lib = build.load()
    results = []
    for isa in ISAS:
        lib.ssd_set_isa(isa)
        for threads in (1, 2, 3):
            with torch_threads(threads):
                results.append(layer(x))
    assert all(torch.equal(results[0], r) for r in results[1:])


def attention_inputs(heads: int = 6, kv_heads: int = 2, dim: int = 48, length: int = 40, seed: int = 3):
    """Queries [1, heads, 9, dim] and a cache [1, kv heads, 64, dim] of uneven magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 9, dim, generator=gen) * torch.logspace(-1, 1, 9)[None, None, :, None]
    keys, values = (torch.randn(1, kv_heads, 64, dim, generator=gen) * 3 for _ in range(2))
    return q, keys, values


def rows_attend_as_alone(attend, q, keys, values, start: int = 30) -> bool:
    """Whether each of q's rows, attended in one call, is bit for bit the row attended alone."""
    m = q.shape[2]
    together = attend(q, keys, values, start, start + m, None, 0.125)
    alone = [attend(q[:, :, i : i + 1], keys, values, start + i, start + i + 1, None, 0.125) for i in range(m)]
    return torch.equal(together, torch.cat(alone, dim=2))


@pytest.mark.parametrize("isa", ISAS)
def test_c_attention_is_sdpa_row_by_row(isa):
    build.load().ssd_set_isa(isa)
    q, keys, values = attention_inputs()
    ours = _attend_kernels(q, keys, values, 30, 39, None, 0.125)
    torch.testing.assert_close(ours, _attend(q, keys, values, 30, 39, None, 0.125), rtol=1e-5, atol=1e-5)


def test_c_attention_rows_are_the_same_alone_and_together_on_every_instruction_set():
    q, keys, values = attention_inputs()
    lib, results = build.load(), []
    for isa in ISAS:
        lib.ssd_set_isa(isa)
        assert rows_attend_as_alone(_attend_kernels, q, keys, values)
        for threads in (1, 2, 3):
            with torch_threads(threads):
                results.append(_attend_kernels(q, keys, values, 30, 39, None, 0.125))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_c_rope_is_transformers_rope_bit_for_bit():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from ssd.models.kernels.attention import rope

    n, heads, kv_heads, dim = 5, 4, 2, 64
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * dim, generator=gen) * 10
    angles = torch.rand(1, n, dim // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    heads_first = [x.reshape(1, n, -1, dim).transpose(1, 2) for x in (q, k)]
    expected = apply_rotary_pos_emb(*heads_first, cos, sin)
    rope(q, k, cos, sin, dim)  # in place, on the strided views
    assert torch.equal(q.reshape(1, n, heads, dim).transpose(1, 2), expected[0])
    assert torch.equal(k.reshape(1, n, kv_heads, dim).transpose(1, 2), expected[1])


def test_the_attention_check_catches_rows_attended_in_one_masked_call():
    """Power: SDPA over all rows under a causal mask sums in another order than each row alone."""
    assert not rows_attend_as_alone(_attend_one_call, *attention_inputs())


def rms_norm(cols: int, seed: int = 5) -> torch.nn.Module:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(cols, eps=1e-6)
    norm.weight.data = torch.rand(cols, generator=torch.Generator().manual_seed(seed)) + 0.5
    return norm


@KINDS
def test_a_normalizing_layer_is_the_norm_then_the_layer_on_every_path(kind, cols):
    """QLinear.normalize: transformers' RMSNorm computed in C with the quantization (to rounding),
    and the same bits on every instruction set and thread count."""
    layer, _ = random_layer(kind, cols=cols)
    norm = rms_norm(cols)
    fused = QLinear(layer.parts(), cols).normalize(norm)
    x = uneven_rows(9, cols)
    lib, results = build.load(), []
    for isa in ISAS:
        lib.ssd_set_isa(isa)
        for threads in (1, 2):
            with torch_threads(threads):
                results.append(fused(x))
    assert all(torch.equal(results[0], r) for r in results[1:])
    expected = layer(norm(x))
    assert ((results[0] - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)).max() < 0.01


def test_fused_layers_compute_what_the_separate_layers_do():
    parts = [random_layer(kind, out=out, seed=seed)[0] for kind, out, seed in ((T.Q4_K, 48, 0), (T.Q6_K, 16, 1))]
    fused = QLinear.fuse(parts)
    x = uneven_rows(5)
    assert all(torch.equal(a, b) for a, b in zip(fused(x), (p(x) for p in parts)))


def test_bad_weights_are_refused_naming_the_shape():
    with pytest.raises(ValueError, match="in_features 300 is not a multiple of 32"):
        QLinear([(0, torch.zeros(4, 10, dtype=torch.uint8))], 300)  # not whole blocks of 32
    with pytest.raises(ValueError, match=r"part 0: weights must be uint8 \[out, 148\]"):
        QLinear([(0, torch.zeros(4, 10, dtype=torch.uint8))], 256)


# --- a model on the kernels: every decoding path exact ------------------------------------------------


def gguf_tiny(tcfg: TinyModelConfig = KTINY):
    return load_model(ModelConfig(name="tiny", quantization="gguf", tiny=tcfg))


@pytest.fixture(scope="module")
def gguf_pair():
    return gguf_tiny(), gguf_tiny(dataclasses.replace(KTINY, noise=0.03))


@pytest.fixture(scope="module")
def references(gguf_pair):
    engine = AREngine(gguf_pair[0], TinyTokenizer.from_config(KTINY))
    return {tuple(p): engine.generate(GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=40))).token_ids
            for p in PROMPTS}


def test_every_linear_runs_on_the_kernels_and_reports_say_gguf(gguf_pair):
    target = gguf_pair[0]
    assert not [n for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)]
    assert {fmt for m in target.modules() if isinstance(m, QLinear) for fmt in m.formats} == {0, 1}  # Q4_K, Q6_K


def test_whole_layers_in_c_compute_what_the_python_layers_do(gguf_pair):
    """layer.c (decode and verification) against the lean forward's Python layer on the same
    model, bit for bit: a prompt, then 1 and 5 rows; and the check sees the Python layer attend
    through SDPA instead of the C attention (values equal to ~1e-7)."""
    from ssd.models.fast import FastForward

    model = gguf_pair[0]
    in_c, in_python = FastForward(model), FastForward(model)
    assert in_c._layers is not None
    in_python._layers = None

    def logits(fast: FastForward) -> list[torch.Tensor]:
        cache, out = fast.new_cache(), []
        for start, ids in ((0, [3, 1, 4, 1, 5, 9, 2]), (7, [6]), (8, [5, 3, 5, 8, 9])):
            out.append(fast(cache, torch.tensor(ids), torch.arange(start, start + len(ids)), start))
        return out

    assert all(torch.equal(a, b) for a, b in zip(logits(in_c), logits(in_python)))
    in_python._attend = _attend
    assert not all(torch.equal(a, b) for a, b in zip(logits(in_c), logits(in_python)))


def test_a_verification_scores_each_position_as_decoding_would(gguf_pair):
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    together = KVSequence(gguf_pair[0]).forward(tokens)
    single = KVSequence(gguf_pair[0])
    assert torch.equal(together, torch.cat([single.forward([t]) for t in tokens]))


@pytest.mark.parametrize("k", [1, 4])
def test_sd_greedy_equals_ar_on_the_gguf_pair(gguf_pair, references, k):
    engine = SDEngine(*gguf_pair, TinyTokenizer.from_config(KTINY), SpeculationConfig(mode="sd", k=k))
    for prompt in PROMPTS:
        out = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
        assert out.token_ids == references[tuple(prompt)]
        assert 0 < out.stats.accepted < out.stats.drafted
        assert out.stats.precision == "target gguf, draft gguf"


def test_a_draft_vocabulary_subset_on_the_kernels_is_exact(gguf_pair, references):
    """FR-Spec's subset head (ssd.models.vocab) over a QLinear head: the full head's rows bit for
    bit, FILL elsewhere; greedy SD with a subset draft (most of the vocabulary cut) == AR."""
    from ssd.models.vocab import FILL, SubsetHead, restrict_head

    ids = torch.tensor([0, 2, 3, 5, 9, 12])
    head = gguf_pair[1].lm_head
    sub = SubsetHead(head, ids, KTINY.vocab_size)
    x = uneven_rows(5, KTINY.hidden_size)
    full, part = head(x), sub(x)
    outside = torch.ones(KTINY.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.equal(part[:, ids], full[:, ids]) and bool((part[:, outside] == FILL).all())
    draft = restrict_head(gguf_tiny(dataclasses.replace(KTINY, noise=0.03)), ids)
    engine = SDEngine(gguf_pair[0], draft, TinyTokenizer.from_config(KTINY), SpeculationConfig(mode="sd", k=3))
    for prompt in PROMPTS:
        out = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
        assert out.token_ids == references[tuple(prompt)]


def test_ssd_greedy_equals_ar_on_the_gguf_pair(gguf_pair, references):
    from ssd.config import FanoutConfig

    spec = SpeculationConfig(mode="ssd", k=4, fanout=FanoutConfig(budget=8), backup="neural")
    with SSDEngine.in_process(*gguf_pair, TinyTokenizer.from_config(KTINY), spec) as ssd:
        for prompt in PROMPTS:
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == references[tuple(prompt)]
            assert out.stats.spec.hits > 0


def test_batched_rows_equal_each_request_alone(gguf_pair, references):
    for engine in (AREngine(gguf_pair[0], TinyTokenizer.from_config(KTINY)),
                   SDEngine(*gguf_pair, TinyTokenizer.from_config(KTINY), SpeculationConfig(mode="sd", k=3))):
        requests = [GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=40)) for p in PROMPTS]
        outs = run_together(engine, requests, lambda result: result.token_ids)
        assert outs == [references[tuple(p)] for p in PROMPTS]


def test_tree_branches_draft_what_a_chain_would(gguf_pair):
    draft = gguf_pair[1]
    committed, k, budget = [1, 2, 3], 4, 12
    kv = KVSequence(draft)
    drafted = drafted_chain(kv, committed, k, GREEDY, torch.Generator()).tokens
    entries = build_cache(kv, TreeBranchDecoder(), committed, drafted, [budget // (k + 1)] * (k + 1), GREEDY,
                          torch.Generator())
    for (depth, token), speculation in entries.items():
        chain = drafted_chain(KVSequence(draft), committed + drafted[:depth] + [token], k, GREEDY, torch.Generator())
        assert chain.tokens == speculation.tokens


# SMALL's law test at a width the kernels take: 4 tokens, one layer.
KSMALL = TinyModelConfig(vocab_size=4, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, seed=4)


@pytest.fixture(scope="module")
def small_gguf_pair():
    return gguf_tiny(KSMALL), gguf_tiny(dataclasses.replace(KSMALL, noise=0.3))


def test_sd_samples_the_gguf_targets_law_and_the_test_has_power(small_gguf_pair):
    sampling = SamplingConfig(temperature=1.0)
    law = exact_joint(small_gguf_pair[0], sampling)
    assert max(law.values()) < 0.5, "a law with structure on several outcomes (else the test has no power)"
    pvalue = chi_square_pvalue(sd_samples(small_gguf_pair, sampling), law)
    assert pvalue > ALPHA, f"SD on the GGUF pair deviates from the GGUF target: p = {pvalue:.2e}"
    broken = chi_square_pvalue(sd_samples(small_gguf_pair, sampling, verifier=accept_all), law)
    assert broken < ALPHA, f"accepting every draft went undetected: p = {broken:.2e}"


def test_ssd_cache_hits_sample_the_gguf_targets_law_and_the_test_has_power(small_gguf_pair, monkeypatch):
    """SSD's cache-hit path (tests/test_ssd_distribution's T=1 case) on the kernels' pair, and the
    same test failing when the cache draws its tokens from reversed ranks."""
    from tests.test_ssd_distribution import HIT_CASES, LATE, cache_draws_reversed, hit_draws, pvalue

    case = HIT_CASES["t1.0"]
    p = pvalue(small_gguf_pair, hit_draws(small_gguf_pair, case), case.sampling, LATE, ("cache hit", "gguf t1.0", "exact"))
    assert p > ALPHA, f"SSD cache hits on the GGUF pair deviate from the GGUF target: p = {p:.2e}"
    cache_draws_reversed(monkeypatch)
    broken = pvalue(small_gguf_pair, hit_draws(small_gguf_pair, case, case.broken_samples), case.sampling, LATE,
                    ("cache hit", "gguf t1.0", "cache_draws_reversed"))
    assert broken < ALPHA, f"a cache drawing reversed ranks went undetected: p = {broken:.2e}"


def test_the_backend_probe_times_both_backends_on_a_gguf_file(monkeypatch, tmp_path):
    """model.backend auto's probe (ssd.models.gguf_choice) on a real q4_k_m file: a child process
    loads it on the kernels and on llama.cpp, times both, and the answer is kept."""
    pytest.importorskip("llama_cpp")
    from ssd.models import gguf_choice
    from ssd.models.loading import _tiny_gguf

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))  # nothing cached: the child runs
    path = str(_tiny_gguf(KTINY, "q4_k_m"))
    found = gguf_choice.probe(path)
    assert found["choice"] == gguf_choice.decide(found["ms"])
    assert all(found["ms"][b][n] > 0 for b in ("kernels", "llamacpp") for n in ("1", "8"))
    monkeypatch.setattr(gguf_choice.subprocess, "run", None)  # kept: no second child
    assert gguf_choice.probe(path) == found


def test_no_compiler_is_a_clear_config_error(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setenv("SSD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(ConfigError, match="model.quantization gguf: no C compiler found"):
        load_model(ModelConfig(name="tiny", quantization="gguf", tiny=dataclasses.replace(KTINY, seed=9)))
