"""SD samples exactly the target's distribution: chi-square on a tiny model.

The first three generated tokens (the first from prefill, the next two from
one speculative round with K = 2, so acceptance, rejection with a residual
draw and the bonus token all occur) are compared with the target's exact
joint distribution, enumerated over the whole 6-token vocabulary. Each test
is paired with broken verifiers that the same test must reject.
"""

import dataclasses

import pytest
import torch

from ssd.config import GenerationConfig, SamplingConfig, TinyModelConfig
from ssd.engine import SDEngine
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.sampling import probs_from_logits, sample
from ssd.verify import Outcome, residual, verify
from ssd.engine.request import GenerationRequest
from tests.stats import ALPHA, chi_square_pvalue

SMALL = TinyModelConfig(vocab_size=6, seed=3)
PROMPT = [0, 1, 2]
N_TOKENS = 3
SAMPLES = 2500  # broken verifiers still give p < 1e-11 here
CASES = {
    "t0.6": SamplingConfig(temperature=0.6),
    "t1.0": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=1.0, top_k=3),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.8),
}


@pytest.fixture(scope="module")
def small_pair():
    target = build_tiny_model(SMALL, torch.float64)
    draft = build_tiny_model(dataclasses.replace(SMALL, noise=0.3), torch.float64)
    return target, draft


def exact_joint(model, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | PROMPT) under the target and the sampling pipeline."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            for token, prob in enumerate(probs_from_logits(logits, sampling).tolist()):
                if prob > 0:
                    nxt[prefix + (token,)] = mass * prob
        joint = nxt
    return joint


def sd_samples(pair, sampling: SamplingConfig, verifier=verify) -> list[tuple[int, ...]]:
    target, draft = pair
    engine = SDEngine(target, draft, TinyTokenizer(SMALL.vocab_size), k=2, verifier=verifier)
    config = GenerationConfig(max_new_tokens=N_TOKENS)
    return [
        tuple(engine.generate(GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=seed), config)).token_ids)
        for seed in range(SAMPLES)
    ]


@pytest.mark.parametrize("case", CASES)
def test_sd_matches_target_joint_distribution(small_pair, case):
    sampling = CASES[case]
    pvalue = chi_square_pvalue(sd_samples(small_pair, sampling), exact_joint(small_pair[0], sampling))
    assert pvalue > ALPHA, f"SD output deviates from the target ({case}): p = {pvalue:.2e}"


# --- power: the same test must catch broken verifiers ---------------------------------

def accept_all(drafted, q, p, gen, greedy=False):
    return Outcome(len(drafted), sample(p[-1], gen))


def correction_from_p(drafted, q, p, gen, greedy=False):
    """Rejection sampling right, but the correction drawn from p, not the residual."""
    out = verify(drafted, q, p, gen, greedy)
    if out.k == len(drafted):
        return out
    return Outcome(out.k, sample(p[out.k], gen))


def skip_ratio_test(drafted, q, p, gen, greedy=False):
    """Accept a draft only when it is the target's argmax (a known trap at T > 0)."""
    hard = torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)
    out = verify(drafted, q, hard, gen, greedy=True)
    if out.k == len(drafted):
        return Outcome(out.k, sample(p[-1], gen))
    return Outcome(out.k, sample(residual(p[out.k], q[out.k]), gen))


@pytest.mark.parametrize("broken", [accept_all, correction_from_p, skip_ratio_test])
def test_distribution_test_rejects_broken_verifiers(small_pair, broken):
    sampling = CASES["t1.0"]
    pvalue = chi_square_pvalue(sd_samples(small_pair, sampling, broken), exact_joint(small_pair[0], sampling))
    assert pvalue < ALPHA, f"{broken.__name__} went undetected: p = {pvalue:.2e}"
