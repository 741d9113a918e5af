"""int8 with per-row activation scales: rows independent bit for bit, close to
fp32, and every decoding path exact relative to the int8 target.

Each property is paired with the per-tensor scales of torch.ao's
quantize_dynamic, which must fail it: that is what the per-row design fixes.
"""

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from ssd.config import GenerationConfig, ModelConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import AREngine, SDEngine
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, build_tiny_model, load_model
from ssd.models.kv import KVSequence
from ssd.models.loading import resolve_precision
from ssd.models.quant import Int8Linear, int8_supported, precision_of, quantize_int8
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import build_cache
from ssd.engine.drafting import drafted_chain
from tests.conftest import TINY
from tests.stats import ALPHA, chi_square_pvalue
from tests.test_distribution import SMALL, exact_joint, sd_samples

# Only the tests that run int8 kernels skip without them: the precision choice
# (which must pick another precision there) is tested on every host.
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="needs torch's x86 int8 kernels")

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


def per_tensor(model: nn.Module) -> nn.Module:
    """torch.ao's dynamic int8: one activation scale per call (the design this module replaces)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def int8_tiny(tcfg: TinyModelConfig, quantize=quantize_int8) -> nn.Module:
    return quantize(build_tiny_model(tcfg, torch.float32))


def uneven_rows(n: int = 9, width: int = 64) -> torch.Tensor:
    """Rows whose magnitudes span four orders: what one shared scale handles worst."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=gen) * torch.logspace(-2, 2, n)[:, None]


def linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 48, bias=bias)


@needs_int8
@pytest.mark.parametrize("bias", [True, False])
def test_rows_are_independent_bit_for_bit(bias):
    layer, x = Int8Linear(linear(bias)), uneven_rows()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)
    assert torch.equal(layer(x[[3, 0, 7]]), alone[[3, 0, 7]])  # any subset, any order


@needs_int8
def test_per_tensor_scales_make_rows_depend_on_each_other():
    layer, x = per_tensor(nn.Sequential(linear()))[0], uneven_rows()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert not torch.equal(layer(x), alone)


@needs_int8
@torch.no_grad()
def test_every_row_is_close_to_fp32():
    fp32, x = linear(), uneven_rows()
    reference = fp32(x)

    def worst_row_error(out):
        return float(((out - reference).norm(dim=1) / reference.norm(dim=1)).max())

    assert worst_row_error(Int8Linear(fp32)(x)) < 0.03
    # One shared scale drowns the small rows (the power of the line above).
    assert worst_row_error(per_tensor(nn.Sequential(linear()))(x)) > 0.3


@needs_int8
def test_any_leading_shape():
    layer, x = Int8Linear(linear()), uneven_rows(6)
    assert torch.equal(layer(x.reshape(2, 3, 64)).reshape(6, 48), layer(x))


def scores_chunk_as_tokens(model: nn.Module, tokens: list[int]) -> float:
    """Largest logit gap between scoring `tokens` in one cached forward and one at a time."""
    chunk, single = KVSequence(model), KVSequence(model)
    together = chunk.forward(tokens)
    alone = torch.cat([single.forward([t]) for t in tokens])
    return float((together - alone).abs().max())


@needs_int8
def test_a_verification_scores_each_position_as_decoding_would():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    assert scores_chunk_as_tokens(int8_tiny(TINY), tokens) < 1e-4
    assert scores_chunk_as_tokens(int8_tiny(TINY, lambda m: per_tensor(m)), tokens) > 1e-2


@pytest.fixture(scope="module")
def int8_pair():
    return int8_tiny(TINY), int8_tiny(dataclasses.replace(TINY, noise=0.03))


@pytest.fixture(scope="module")
def int8_references(int8_pair):
    tokenizer = TinyTokenizer.from_config(TINY)
    engine = AREngine(int8_pair[0], tokenizer)
    return {tuple(p): engine.generate(GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=40))).token_ids for p in PROMPTS}


@needs_int8
@pytest.mark.parametrize("k", [1, 3, 4, 7])
def test_sd_greedy_equals_ar_on_the_int8_pair(int8_pair, int8_references, k):
    engine = SDEngine(*int8_pair, TinyTokenizer.from_config(TINY), SpeculationConfig(mode="sd", k=k))
    for prompt in PROMPTS:
        out = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
        assert out.token_ids == int8_references[tuple(prompt)]
        assert 0 < out.stats.accepted < out.stats.drafted
        assert out.stats.precision == "target int8, draft int8"


@needs_int8
@pytest.mark.parametrize("backup", ["neural", "ngram"])
def test_ssd_greedy_equals_ar_on_the_int8_pair(int8_pair, int8_references, backup):
    from ssd.config import FanoutConfig, SpeculationConfig

    spec = SpeculationConfig(mode="ssd", k=4, fanout=FanoutConfig(budget=8), backup=backup)
    with SSDEngine.in_process(*int8_pair, TinyTokenizer.from_config(TINY), spec) as ssd:
        for prompt in PROMPTS:
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == int8_references[tuple(prompt)]
            assert out.stats.spec.hits > 0 and set(out.stats.spec.backups) == {backup}
            assert "draft int8" in out.stats.summary()


def tree_vs_chain_mismatches(draft: nn.Module, committed: list[int], k: int = 4, budget: int = 12) -> int:
    """Greedy branches built together in one tree vs each drafted alone as a chain: tokens that differ."""
    kv = KVSequence(draft)
    drafted = drafted_chain(kv, committed, k, GREEDY, torch.Generator()).tokens
    fanout = [budget // (k + 1)] * (k + 1)
    entries = build_cache(kv, TreeBranchDecoder(), committed, drafted, fanout, GREEDY, torch.Generator())
    mismatches = 0
    for (kb, token), speculation in entries.items():
        chain = drafted_chain(KVSequence(draft), committed + drafted[:kb] + [token], k, GREEDY, torch.Generator()).tokens
        mismatches += sum(a != b for a, b in zip(chain, speculation.tokens))
    return mismatches


@needs_int8
def test_tree_branches_draft_what_a_chain_would():
    wide = dataclasses.replace(TINY, vocab_size=64, noise=0.03)
    prompts = [[1, 2, 3], [7, 7, 0, 1, 9, 12], [40, 2, 33, 5]]
    assert sum(tree_vs_chain_mismatches(int8_tiny(wide), p) for p in prompts) == 0
    assert sum(tree_vs_chain_mismatches(int8_tiny(wide, lambda m: per_tensor(m)), p) for p in prompts) > 0


@needs_int8
def test_sd_samples_the_int8_target_distribution():
    pair = (int8_tiny(SMALL), int8_tiny(dataclasses.replace(SMALL, noise=0.3)))
    sampling = SamplingConfig(temperature=1.0)
    pvalue = chi_square_pvalue(sd_samples(pair, sampling), exact_joint(pair[0], sampling))
    assert pvalue > ALPHA, f"SD on the int8 pair deviates from the int8 target: p = {pvalue:.2e}"


@needs_int8
def test_load_model_quantizes_and_names_the_precision():
    model = load_model(ModelConfig(name="tiny", quantization="int8"))
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert precision_of(model) == "int8"
    assert precision_of(load_model(ModelConfig(name="tiny", dtype="fp64"))) == "fp64"


@pytest.mark.parametrize(
    "int8, bf16, device, expected",
    [
        (True, True, "cpu", ("fp32", "int8")),
        (True, False, "cpu", ("fp32", "int8")),
        (False, True, "cpu", ("bf16", None)),
        (False, False, "cpu", ("fp32", None)),
        (True, False, "cuda", ("bf16", None)),
    ],
)
def test_auto_precision_follows_the_host(monkeypatch, int8, bf16, device, expected):
    monkeypatch.setattr("ssd.models.loading.int8_supported", lambda: int8)
    monkeypatch.setattr("ssd.hardware.native_bf16", lambda: bf16)
    resolved = resolve_precision(ModelConfig(dtype="auto", quantization="auto"), device)
    assert (resolved.dtype, resolved.quantization) == expected
    explicit = ModelConfig(dtype="bf16", quantization=None)
    assert resolve_precision(explicit, device) == explicit  # only "auto" is ever replaced


@needs_int8
def test_fused_projections_compute_exactly_what_the_separate_layers_do():
    from ssd.models.invariant import use_row_attention
    from ssd.models.quant import fuse_projections

    tcfg = dataclasses.replace(TINY, hidden_size=64)
    separate = use_row_attention(quantize_int8(build_tiny_model(tcfg)))
    fused = fuse_projections(use_row_attention(quantize_int8(build_tiny_model(tcfg))))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, separate(input_ids=ids).logits)
    attn, reference = fused.model.layers[0].self_attn, separate.model.layers[0].self_attn
    x, y = uneven_rows(3, 64), uneven_rows(2, 64)
    # Any call order, and inputs that change between calls, still give each layer's own output.
    assert torch.equal(attn.v_proj(x), reference.v_proj(x))
    assert torch.equal(attn.q_proj(y), reference.q_proj(y))
    assert torch.equal(attn.k_proj(x), reference.k_proj(x))
    assert precision_of(fused) == "int8"
    # The lean forward takes q, k, v from one matmul and the MLP's gate and up from another.
    from ssd.models.fast import FastForward
    from ssd.models.quant import FusedGateUpMLP, FusedInt8Linear

    assert isinstance(attn.qkv_proj, FusedInt8Linear) and isinstance(fused.model.layers[0].mlp, FusedGateUpMLP)
    lean, lean_reference = FastForward(fused), FastForward(separate)
    positions = torch.arange(6)
    assert torch.equal(
        lean(lean.new_cache(), ids[0], positions, 0), lean_reference(lean_reference.new_cache(), ids[0], positions, 0)
    )


@needs_int8
def test_fused_layers_call_four_int8_matmuls_instead_of_seven():
    """What the fusion is for: per decoder layer qkv, o, gate+up and down (the
    one-matmul saving, timed by launch/bench_fusion.py), with the same logits."""
    from ssd.tools.bench.fusion import unfused_and_fused
    from ssd.models.fast import FastForward
    from ssd.models.invariant import use_row_attention

    tcfg = dataclasses.replace(TINY, hidden_size=64)
    variants = unfused_and_fused(use_row_attention(quantize_int8(build_tiny_model(tcfg))))
    calls, logits = [], []
    for model in variants:
        count = [0]
        hooks = [m.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
                 for m in model.modules() if isinstance(m, Int8Linear)]
        lean = FastForward(model)
        logits.append(lean(lean.new_cache(), torch.tensor([3, 1, 4]), torch.arange(3), 0))
        calls.append(count[0])
        for hook in hooks:
            hook.remove()
    layers = tcfg.num_hidden_layers
    assert calls[0] - calls[1] == 3 * layers and calls[1] >= 4 * layers, calls
    assert torch.equal(logits[0], logits[1])


@needs_int8
@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_packed_in_blocks_computes_the_whole_layer_bit_for_bit(bias, monkeypatch):
    """Tall layers (the LM head) are packed in blocks of output channels: the same outputs."""
    import ssd.models.quant as quant

    x = uneven_rows()
    whole = Int8Linear(linear(bias))
    assert len(whole.pack()) == 1
    monkeypatch.setattr(quant, "PACK_ROWS", 20)
    blocks = Int8Linear(linear(bias))
    assert len(blocks.pack()) == 3  # 48 rows: 16 + 16 + 16
    assert torch.equal(blocks(x), whole(x))
    ints, scales = blocks.int8_weight()  # unpacked from the blocks: the same weights
    assert torch.equal(ints, whole.int8_weight()[0]) and torch.equal(scales, whole.int8_weight()[1])


@needs_int8
def test_layers_are_packed_once_by_load_model_and_fused_before_packing():
    from ssd.models.quant import FusedInt8Linear

    model = load_model(ModelConfig(name="tiny", quantization="int8"))
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m._packed is not None and m._int8 is None for m in layers)
    fused = next(m for m in model.modules() if isinstance(m, FusedInt8Linear))
    assert fused._split is None  # the parts were concatenated as plain int8, never packed
