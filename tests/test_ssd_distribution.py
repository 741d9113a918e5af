"""SSD samples exactly the target's distribution, on every path.

Tiny 6-token model, K = 2, four generated tokens; the joint of tokens 3 and 4
(the first speculative round's and, mostly, a later round's) is compared with the target's exact distribution (chi-square, alpha 0.001).
Paths are isolated by construction: a budget covering every token makes
every round after the first a cache hit; a speculator whose cache is always
empty makes every round a backup round. Each path is paired with a broken
variant that the same test must reject.
"""

import dataclasses

import pytest
import torch

import ssd.speculation.builder as builder_module
import ssd.speculation.speculator as speculator_module
from ssd.config import FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine.local import LocalSSD
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.sampling import sample_rows, saguaro_rescale_rows
from ssd.verify import verify
from ssd.engine.request import GenerationRequest
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue
from tests.test_distribution import accept_all, correction_from_p, skip_ratio_test

SMALL = TinyModelConfig(vocab_size=6, seed=3)
PROMPT = [0, 1, 2]
N_TOKENS = 4
POSITIONS = [2, 3]
SAMPLES = 1000  # the weakest broken variant still gives p ~ 3e-8
K = 2
FULL = (K + 1) * SMALL.vocab_size  # every token at every k: every outcome cached
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def small_pair():
    target = build_tiny_model(SMALL, torch.float64)
    draft = build_tiny_model(dataclasses.replace(SMALL, noise=0.3), torch.float64)
    return target, draft


def spec(budget=FULL, kind="uniform", **kw) -> SpeculationConfig:
    return SpeculationConfig(mode="ssd", k=K, fanout=FanoutConfig(kind=kind, budget=budget), **kw)


def ssd_samples(pair, spec_config, sampling, verifier=verify):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=N_TOKENS)
    with LocalSSD(target, draft, TinyTokenizer(SMALL.vocab_size), spec_config, verifier) as ssd:
        samples, hits, lookups = [], 0, 0
        for seed in range(SAMPLES):
            out = ssd.generate(GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=seed), config))
            samples.append(tuple(out.token_ids[i] for i in POSITIONS))
            hits, lookups = hits + out.stats.spec.hits, lookups + out.stats.spec.lookups
    return samples, hits / max(1, lookups)


def pvalue(pair, spec_config, sampling, verifier=verify):
    samples, hit_rate = ssd_samples(pair, spec_config, sampling, verifier)
    return chi_square_pvalue(samples, exact_marginal(pair[0], PROMPT, N_TOKENS, sampling, POSITIONS)), hit_rate


@pytest.fixture
def always_miss(monkeypatch):
    """A speculator whose cache never holds anything: every round uses the backup."""
    monkeypatch.setattr(speculator_module, "build_cache", lambda *args, **kwargs: {})


HIT_CASES = {
    "t1.0": (spec(), T1),
    "t0.6_top_k": (spec(), SamplingConfig(temperature=0.6, top_k=3)),
    "top_p": (spec(), SamplingConfig(temperature=1.0, top_p=0.8)),
    "saguaro_c0.5": (spec(saguaro_c=0.5, budget=K + 1), T1),
    "saguaro_c0.1": (spec(saguaro_c=0.1, budget=2 * (K + 1)), T1),
    "saguaro_c0": (spec(saguaro_c=0.0, budget=2 * (K + 1)), T1),
    "geometric_mixed_t0.7": (spec(budget=4, kind="geometric"), SamplingConfig(temperature=0.7)),
}


@pytest.mark.parametrize("case", HIT_CASES)
def test_cache_path_matches_target(small_pair, case):
    spec_config, sampling = HIT_CASES[case]
    p, hit_rate = pvalue(small_pair, spec_config, sampling)
    assert p > ALPHA, f"{case}: p = {p:.2e}"
    if spec_config.fanout.budget == FULL:
        assert hit_rate > 0.99
    else:  # both paths ran, interleaved
        assert 0 < hit_rate < 1


@pytest.mark.parametrize("backup", ["neural", "ngram", "random"])
def test_backup_path_matches_target(small_pair, always_miss, backup):
    p, hit_rate = pvalue(small_pair, spec(backup=backup), T1)
    assert hit_rate == 0.0
    assert p > ALPHA, f"{backup} backup: p = {p:.2e}"


# --- power: the same tests reject broken variants ------------------------------------

def test_cache_path_rejects_accept_all(small_pair):
    p, _ = pvalue(small_pair, spec(), T1, accept_all)
    assert p < ALPHA, f"accept-all went undetected: p = {p:.2e}"


def test_saguaro_rejects_verifying_with_q_instead_of_q_prime(small_pair, monkeypatch):
    """Tokens drawn from q' (c = 0.1 on the top-2) but shipped with plain q."""
    def sample_from_q_prime(q, gen):
        return sample_rows(saguaro_rescale_rows(q, 2, 0.1), gen)

    monkeypatch.setattr(builder_module, "sample_rows", sample_from_q_prime)
    p, _ = pvalue(small_pair, spec(budget=2 * (K + 1)), T1)
    assert p < ALPHA, f"q instead of q' went undetected: p = {p:.2e}"


@pytest.mark.parametrize("backup, broken", [("random", skip_ratio_test), ("ngram", correction_from_p)])
def test_backup_path_rejects_broken_verifiers(small_pair, always_miss, backup, broken):
    p, _ = pvalue(small_pair, spec(backup=backup), T1, broken)
    assert p < ALPHA, f"{broken.__name__} with {backup} backup went undetected: p = {p:.2e}"
