"""The draft's LM head over a vocabulary subset (FR-Spec, ssd.models.vocab) keeps SD and SSD exact.

Greedy: SD and SSD == AR token for token on the 16-token tiny pair with a
10-token subset, where AR's output has tokens outside the subset (asserted),
so the draft proposes a wrong token there and rejection paths run.

Sampled: the chi-square test of test_distribution (SD, tokens 1-4 of 5)
with the 4-token draft's head restricted to {0, 2, 3}: the target's
favourite token 1 (asserted to carry mass in the tested joint) can only
come from a correction or a bonus. SSD's with the subset runs in
test_adaptive_k, together with K cycling, anytime builds and n-gram
entries. Power, same seeds: a draft that draws from the subset but ships
its full-vocabulary q (SD: `sd_draws_subset_ships_full_q`; SSD's cache,
tokens 5-7 of 8 from hit rounds: `cache_draws_subset_ships_full_q`) must fail.
"""

from __future__ import annotations

import json

import pytest
import torch

import ssd.engine.drafting as drafting_module
from ssd.config import ConfigError, DraftVocabConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import build_tiny_model
from ssd.models.kv import KVSequence
from ssd.models.quant import int8_supported, pack_int8, quantize_int8
from ssd.models.vocab import FILL, apply_draft_vocab, read_ranking, restrict_head, subset_ids, subset_of, write_ranking
from ssd.saguaro.target import SSDEngine
from ssd.sampling import Q_DTYPE
from ssd.verify import verify
from tests.conftest import TINY, tiny_pair
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests import test_distribution as sd_dist
from tests import test_ssd_distribution as ssd_dist

GREEDY = SamplingConfig(temperature=0.0)
SUBSET16 = [0, 1, 2, 3, 5, 7, 8, 10, 12, 14]  # 10 of 16
SUBSET4 = [0, 2, 3]  # of the 4-token SMALL pair: its favourite token 1 only from the target
PROMPTS = [[1, 2, 3], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


# --- the head ---------------------------------------------------------------------------


@pytest.mark.parametrize("int8", [False, True])
def test_subset_logits_are_the_full_heads_rows(int8):
    """int8: bit for bit (per-channel weights, per-row activations). fp32: up to the GEMM's
    summation order, which the kernel torch picks for 10 rows may change (1.2e-6 here on an
    AMD EPYC AVX512 host; bit for bit on an Intel Xeon one); a wrong row is off by ~1."""
    if int8 and not int8_supported():
        pytest.skip("no fbgemm")
    model = build_tiny_model(TINY, torch.float32)
    if int8:
        model = pack_int8(quantize_int8(model))
    full = KVSequence(model).forward([1, 2, 3, 4])
    restrict_head(model, SUBSET16)
    sub = KVSequence(model).forward([1, 2, 3, 4])
    ids = torch.tensor(SUBSET16)
    outside = torch.tensor(sorted(set(range(16)) - set(SUBSET16)))
    if int8:
        assert torch.equal(sub[:, ids], full[:, ids])
    else:
        torch.testing.assert_close(sub[:, ids], full[:, ids], rtol=1e-6, atol=1e-5)
    assert (sub[:, outside] == FILL).all()
    assert subset_of(model).tolist() == SUBSET16


def test_q_is_zero_outside_the_subset_and_uniform_over_allowed_tokens_when_a_mask_leaves_none():
    from ssd.sampling import Bias, probs_from_logits

    logits = torch.full((16,), FILL, dtype=torch.float32)
    logits[torch.tensor(SUBSET16)] = torch.randn(10)
    q = probs_from_logits(logits, SamplingConfig(temperature=0.7))
    assert (q[[4, 6, 9, 11, 13, 15]] == 0).all() and abs(float(q.sum()) - 1) < 1e-12
    grammar = torch.full((16,), float("-inf"), dtype=torch.float64)
    grammar[[4, 6]] = 0.0  # only tokens outside the subset allowed
    q = probs_from_logits(logits, SamplingConfig(temperature=0.7), Bias(grammar))
    assert q[4] == q[6] == 0.5


def test_subset_ids_keep_eos_then_the_ranking_then_the_lowest_ids():
    assert subset_ids([9, 3, 3, 20, 5], 4, 16, always=[15]) == [3, 5, 9, 15]
    assert subset_ids([9], 3, 16) == [0, 1, 9]
    with pytest.raises(ConfigError, match="draft_vocab.size"):
        subset_ids([1], 17, 16)


def test_ranking_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "rank.json"
    write_ranking(path, [4, 2], tokenizer="tiny")
    assert read_ranking(path) == [4, 2]
    assert len(read_ranking("configs/vocab/qwen2.5-coder.json")) > 4096  # the shipped ranking, from any directory
    (tmp_path / "bad.json").write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ConfigError, match="ranking"):
        read_ranking(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_ranking(tmp_path / "missing.json")


def test_config_refuses_a_size_without_a_source_and_a_llamacpp_draft_keeps_its_head(tmp_path, caplog):
    with pytest.raises(ConfigError, match="draft_vocab.source"):
        DraftVocabConfig(size=10, source="")
    with pytest.raises(ConfigError, match="draft_vocab.size"):
        DraftVocabConfig(size=-1)
    not_torch = object()
    assert apply_draft_vocab(not_torch, DraftVocabConfig(size=10, source="x.json")) is not_torch
    assert "ignored on a llama.cpp draft" in caplog.text
    path = tmp_path / "rank.json"
    write_ranking(path, [14, 12, 10, 8, 7, 5])
    model = apply_draft_vocab(build_tiny_model(TINY), DraftVocabConfig(size=10, source=str(path)), [15])
    assert subset_of(model).tolist() == [0, 1, 2, 5, 7, 8, 10, 12, 14, 15]


# --- greedy == AR -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def subset_pair():
    target, draft = tiny_pair()
    return target, restrict_head(draft, SUBSET16)


def ar_ids(target, tokenizer, prompt, n=40):
    request = GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n))
    return AREngine(target, tokenizer).generate(request).token_ids


def test_greedy_sd_and_ssd_with_a_subset_equal_ar(subset_pair, tiny_tokenizer):
    target, draft = subset_pair
    outside = 0
    with SSDEngine.in_process(target, draft, tiny_tokenizer, SpeculationConfig(mode="ssd", k=3)) as ssd:
        for prompt in PROMPTS:
            ar = ar_ids(target, tiny_tokenizer, prompt)
            outside += sum(t not in SUBSET16 for t in ar)
            for k in (1, 4):
                sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=k))
                out = sd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
                assert out.token_ids == ar, f"SD K={k}"
                assert out.stats.accepted < out.stats.drafted
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == ar, "SSD"
    assert outside >= 3, "AR's output never left the subset: the rejection paths it forces did not run"


def test_verification_gets_full_vocabulary_q_rows_zero_outside_the_subset(subset_pair, tiny_tokenizer):
    target, draft = subset_pair
    seen = []

    def spy(drafted, q, p, gen, greedy=False):
        seen.append(q)
        return verify(drafted, q, p, gen, greedy)

    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3), verifier=spy)
    engine.generate(GenerationRequest([1, 2, 3], SamplingConfig(temperature=1.0, seed=3), GenerationConfig(max_new_tokens=12)))
    outside = sorted(set(range(16)) - set(SUBSET16))
    assert seen and all(q.shape[-1] == 16 and (q[:, outside] == 0).all() for q in seen if q is not None)
    ones = [torch.ones(q.shape[0], dtype=torch.float64) for q in seen]
    eps = torch.finfo(Q_DTYPE).eps  # the rows are rounded (ssd.sampling.as_drawn): sums within that rounding
    assert all(torch.allclose(q.double().sum(-1), one, rtol=0, atol=eps) for q, one in zip(seen, ones))


# --- chi-square ---------------------------------------------------------------------------


_SMALL_SUBSET: list = []


def small_subset_pair():
    """The 4-token pair, the draft's head over SUBSET4 (built once; test_adaptive_k uses it too)."""
    if not _SMALL_SUBSET:
        target, draft = sd_dist.small_models()
        _SMALL_SUBSET.append((target, restrict_head(draft, SUBSET4)))
    return _SMALL_SUBSET[0]


def subset_mask(q: torch.Tensor) -> torch.Tensor:
    """q renormalised over SUBSET4: what a subset draft draws from."""
    keep = torch.zeros(q.shape[-1], dtype=torch.bool)
    keep[SUBSET4] = True
    kept = q * keep.to(q.dtype)
    return kept / kept.sum(dim=-1, keepdim=True)


def sd_draws_subset_ships_full_q(monkeypatch) -> None:
    """SD's draft draws from its subset but ships its full-vocabulary q."""
    real = drafting_module.sample
    monkeypatch.setattr(drafting_module, "sample", lambda q, gen: real(subset_mask(q), gen))


def cache_draws_subset_ships_full_q(monkeypatch) -> None:
    """SSD's cached tokens drawn from the subset, shipped with the full q."""
    ssd_dist.break_cache(monkeypatch, lambda q, step, saguaro: subset_mask(q))


def outside_mass(law: dict) -> float:
    return sum(p for cell, p in law.items() if 1 in cell)


def sd_pvalue(pair, variant: str) -> float:
    sampling = sd_dist.CASES["t1.0"]
    draws = sd_dist.draw(pair, sampling, samples=400 if variant == "exact" else sd_dist.STRONG_SAMPLES)
    law = sd_dist.exact_joint(pair[0], sampling)
    assert outside_mass(law) > 0.3
    p = chi_square_pvalue(draws.samples, law)
    report_pvalue("sd, draft vocabulary subset", "t1.0", variant, len(draws.samples), p)
    return p


def test_sampled_sd_with_a_subset_matches_the_target():
    assert sd_pvalue(small_subset_pair(), "exact") > ALPHA


def test_the_sd_subset_test_rejects_full_q_shipped_for_subset_draws(monkeypatch):
    sd_draws_subset_ships_full_q(monkeypatch)
    assert sd_pvalue(sd_dist.small_models(), "subset draws, full q shipped") < ALPHA


def ssd_pvalue(pair, variant: str, samples: int) -> float:
    draws = ssd_dist.draw(pair, ssd_dist.spec(), ssd_dist.T1, ssd_dist.LATE, samples)
    assert draws.lookups > 0 and draws.hits == draws.lookups and draws.tested_from_round_1 == 0
    assert outside_mass(ssd_dist.exact(pair, ssd_dist.T1, ssd_dist.LATE)) > 0.15
    return ssd_dist.pvalue(pair, draws, ssd_dist.T1, ssd_dist.LATE, ("cache hit, draft vocabulary subset", "t1.0", variant))


def test_the_ssd_subset_test_rejects_full_q_shipped_for_subset_draws(monkeypatch):
    cache_draws_subset_ships_full_q(monkeypatch)
    p = ssd_pvalue(sd_dist.small_models(), "cache: subset draws, full q shipped", ssd_dist.STRONG_SAMPLES)
    assert p < ALPHA


def test_the_ranking_command_counts_tokens_most_frequent_first(tmp_path):
    from collections import Counter

    from ssd.tools.ablation.vocab import count_tokens, ranking_of, source_files

    class Chars:  # one token per character: its code point
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    (tmp_path / "a.py").write_text("aab")
    (tmp_path / "b.md").write_text("bbc")
    files = source_files(["*.py", "*.md"], root=tmp_path)
    counts = count_tokens(Chars(), files)
    assert counts == Counter({ord("b"): 3, ord("a"): 2, ord("c"): 1})
    assert ranking_of(counts) == [ord("b"), ord("a"), ord("c")]
    assert ranking_of(Counter({5: 1, 3: 1}), keep=1) == [3]  # ties: the lower id first
