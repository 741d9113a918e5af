"""SD samples exactly the target's distribution deep into a round: chi-square on a tiny model.

Model: one layer, fp64, a 4-token vocabulary; the draft is the target plus
10 % weight noise. K = 3, 5 generated tokens. Token 0 comes from the prefill,
so the first round drafts exactly 3 tokens (remaining - 1) and verifies them
all: generated tokens 1-3 are its drafted depths 1-3 (from the first rejection
on, the residual correction, then later rounds) and token 4 is its bonus token
when all three pass. Every run asserts that a round verified 3 drafts (only
the first can); the passing tests also assert that the first round ended at
every acceptance length 0, 1, 2, 3 in >= 5 % of samples (measured: 15-47 %
each, T = 1: 17, 17, 20, 47 %), so accept-then-reject at depths 2 and 3 and
the bonus after depth 3 all occur.

Tested: the joint of tokens 1-4 against the target's exact joint, enumerated
over the vocabulary; chi-square, cells with expected count < 5 pooled into
one, alpha 0.001, SAMPLES fixed seeds, run as rows of one batch (each row
draws what it would alone: asserted on the first seeds of every draw). The
cells kept whole carry 85-99 % of the mass (T = 1: 32 cells and the pooled rest; top-k and top-p leave at most
32 cells in all). Settings: T = 0.6, T = 1, top-k 2 (T = 1), top-p 0.8 (T = 1), min-p
0.2 (T = 1: the law keeps 37 of the 256 joint outcomes; the same draws against
the law without min-p fail, p ~ 1e-36).

Power: the same test, at the same setting and with the same seeds, run on a
broken verifier passed as `verifier=`. Gross breaks use the first
STRONG_SAMPLES seeds only: fewer samples only make detection harder.
- every setting: `bonus_from_previous_row` (exact except the bonus after an
  all-accepted round, drawn from the last drafted position's p; STRONG_SAMPLES).
- T = 0.6, top-k, top-p: `deep_correction_from_p` (exact at a round's first
  drafted position; a rejection at depth >= 2 draws its correction from p,
  not the residual). At T = 1 its p-value (~3e-4) is too close to alpha to
  rely on, so it is not asserted there.
  Both are exact at depth 1, and the test asserts it: their token 1 alone
  passes; only the deeper positions of the joint catch them.
- T = 1 also: `correction_from_p` (at every depth), and on STRONG_SAMPLES
  `accept_all` and `skip_ratio_test` (accept only the target's argmax).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import SDEngine
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.sampling import sample
from ssd.verify import Outcome, residual, verify
from ssd.engine.request import GenerationRequest
from ssd.tools.bench.sampling_check import run_rows
from tests.exact import exact_marginal, exact_marginal_stepwise
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue

# initializer_range 0.4: next-token laws peaked enough for power, flat enough
# that the cells with >= 5 expected samples carry most of the joint's mass.
SMALL = TinyModelConfig(vocab_size=4, num_hidden_layers=1, initializer_range=0.4, seed=4)
DRAFT_NOISE = 0.1  # every depth is reached, and rejected, often
PROMPT = [0, 1, 2]
K = 3
N_TOKENS = K + 2  # the prefill's token, then a first round of K drafts and its bonus
POSITIONS = [1, 2, 3, 4]  # the first round: drafted depths 1..K and the bonus
SAMPLES = 800  # the weakest broken variant below still gives p < 1e-7
STRONG_SAMPLES = 300  # gross breaks: still p < 1e-14
CASES = {
    "t0.6": SamplingConfig(temperature=0.6),
    "t1.0": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=1.0, top_k=2),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.8),
    "min_p": SamplingConfig(temperature=1.0, min_p=0.2),
}


def small_models(tcfg: TinyModelConfig = SMALL, noise: float = DRAFT_NOISE):
    """(target, draft) in fp64: the draft is the target with relative weight noise."""
    target = build_tiny_model(tcfg, torch.float64)
    return target, build_tiny_model(dataclasses.replace(tcfg, noise=noise), torch.float64)


@pytest.fixture(scope="module")
def small_pair():
    return small_models()


def run(engine, prompt, sampling, generation, on_tokens=None):
    """The one call to generate in this file."""
    return engine.generate(GenerationRequest(prompt, sampling, generation, on_tokens=on_tokens))


@dataclass
class Draws:
    samples: list[tuple[int, ...]]  # tokens at POSITIONS, one tuple per seed
    first_round_accepted: Counter  # drafts the first round accepted -> seeds


# The seeds of a draw run as rows of one batch, ROWS at a time (one packed
# target forward per step for all rows). Every row owns its seeded generator,
# which the draft and the verifier draw from, so a row draws exactly what it
# would alone: the first ALONE seeds of every draw, broken verifiers included,
# run again one at a time and must give the same tokens.
ROWS = 16
ALONE = 12


def draw(pair, sampling: SamplingConfig, verifier=verify, samples: int = SAMPLES) -> Draws:
    target, draft = pair
    engine = SDEngine(target, draft, TinyTokenizer(SMALL.vocab_size), SpeculationConfig(mode="sd", k=K),
                      BatchingConfig(max_rows=ROWS), verifier=verifier)
    generation = GenerationConfig(max_new_tokens=N_TOKENS)
    draws = Draws([], Counter())
    rounds: list[list[list[int]]] = [[] for _ in range(samples)]  # per seed: the prefill's token, then each round's
    requests = [GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=seed), generation,
                                  on_tokens=rounds[seed].append) for seed in range(samples)]
    outs = run_rows(engine, requests)
    for seed in range(min(ALONE, samples)):
        alone = run(engine, PROMPT, requests[seed].sampling, generation)
        assert alone.token_ids == outs[seed].token_ids, f"seed {seed}: a row drew other tokens than alone"
    for out, seed_rounds in zip(outs, rounds):
        assert out.stats.drafted_at[K - 1] >= 1, "no round verified K drafts"
        draws.samples.append(tuple(out.token_ids[i] for i in POSITIONS))
        draws.first_round_accepted[len(seed_rounds[1]) - 1] += 1
    return draws


def sd_samples(pair, sampling: SamplingConfig, verifier=verify) -> list[tuple[int, ...]]:
    """Tokens 1-4 of SAMPLES seeded SD generations (test_quant reuses this)."""
    return draw(pair, sampling, verifier).samples


def exact_joint(model, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(tokens 1-4 | PROMPT) under the target and the sampling pipeline."""
    return exact_marginal(model, PROMPT, N_TOKENS, sampling, POSITIONS)


@pytest.mark.parametrize("case", CASES)
def test_the_depth_first_enumeration_gives_the_batched_ones_law(small_pair, case):
    """exact_marginal_stepwise (a model behind a next-logits function: llama.cpp's
    quantized law in test_llamacpp_distribution) against exact_marginal, pruning included."""
    target, sampling = small_pair[0], CASES[case]

    @torch.no_grad()
    def next_logits(prefix: list[int]) -> torch.Tensor:
        return target(torch.tensor([PROMPT + prefix])).logits[0, -1]

    want = exact_joint(target, sampling)
    got = exact_marginal_stepwise(next_logits, N_TOKENS, sampling, POSITIONS)
    assert want.keys() == got.keys()
    assert max(abs(want[cell] - got[cell]) for cell in want) < 1e-12


def assert_first_round_ends_at_every_depth(draws: Draws) -> None:
    shares = {k: draws.first_round_accepted[k] / len(draws.samples) for k in range(K + 1)}
    assert min(shares.values()) >= 0.05, f"first-round acceptance lengths too rare: {shares}"


@pytest.mark.parametrize("case", CASES)
def test_sd_matches_target_joint_distribution(small_pair, case):
    sampling = CASES[case]
    draws = draw(small_pair, sampling)
    assert_first_round_ends_at_every_depth(draws)
    pvalue = chi_square_pvalue(draws.samples, exact_joint(small_pair[0], sampling))
    report_pvalue("sd", case, "exact", len(draws.samples), pvalue)
    assert pvalue > ALPHA, f"SD output deviates from the target ({case}): p = {pvalue:.2e}"


def test_the_min_p_draws_fail_against_the_law_without_min_p(small_pair):
    """min-p changes the law (tokens below 0.2 x the likeliest's probability are dropped), and
    the test above sees it: the same draws fail against the law without the filter."""
    draws = draw(small_pair, CASES["min_p"], samples=STRONG_SAMPLES)
    plain = exact_joint(small_pair[0], CASES["t1.0"])
    pvalue = chi_square_pvalue(draws.samples, plain)
    report_pvalue("sd", "min_p", "law without min_p", STRONG_SAMPLES, pvalue)
    assert pvalue < ALPHA, f"min-p draws pass as draws without it: p = {pvalue:.2e}"


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


def bonus_from_previous_row(drafted, q, p, gen, greedy=False):
    """Exact, except that after an all-accepted round the bonus is drawn from
    the last drafted position's p (one row too early): wrong only past depth 1."""
    out = verify(drafted, q, p, gen, greedy)
    if drafted and out.k == len(drafted):
        return Outcome(out.k, sample(p[-2], gen))
    return out


def deep_correction_from_p(drafted, q, p, gen, greedy=False):
    """Exact at a round's first drafted position; a rejection at depth >= 2
    draws its correction from p instead of the residual."""
    out = verify(drafted, q, p, gen, greedy)
    if 1 <= out.k < len(drafted):
        return Outcome(out.k, sample(p[out.k], gen))
    return out


DEEP_ONLY = [bonus_from_previous_row, deep_correction_from_p]
POWER = (  # (setting, broken verifier, seeds)
    [(case, bonus_from_previous_row, STRONG_SAMPLES) for case in CASES]
    + [(case, deep_correction_from_p, SAMPLES) for case in CASES if case != "t1.0"]  # T = 1: p ~ 3e-4
    + [("t1.0", correction_from_p, SAMPLES), ("t1.0", accept_all, STRONG_SAMPLES)]
    + [("t1.0", skip_ratio_test, STRONG_SAMPLES)]
)


@pytest.mark.parametrize("case, broken, samples", POWER, ids=[f"{c}-{b.__name__}" for c, b, _ in POWER])
def test_distribution_test_rejects_broken_verifiers(small_pair, case, broken, samples):
    sampling = CASES[case]
    draws = draw(small_pair, sampling, broken, samples)
    expected = exact_joint(small_pair[0], sampling)
    pvalue = chi_square_pvalue(draws.samples, expected)
    report_pvalue("sd", case, broken.__name__, samples, pvalue)
    assert pvalue < ALPHA, f"{broken.__name__} went undetected at {case}: p = {pvalue:.2e}"
    if broken in DEEP_ONLY:  # token 1 alone is exact: only the deeper positions catch it
        token_1: dict[int, float] = {}
        for cells, prob in expected.items():
            token_1[cells[0]] = token_1.get(cells[0], 0.0) + prob
        assert chi_square_pvalue([s[0] for s in draws.samples], token_1) > ALPHA
