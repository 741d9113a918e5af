"""Logits processing (logit_bias, penalties, a grammar's mask) is part of the target's law, exactly, in every mode.

Model: one layer, fp64, a 6-token vocabulary "abcdef" (ids 0-5); the draft is
the target plus 10 % weight noise. Processing: the regex ([abc][def])+ (ids
0-2 at even positions, 3-5 at odd ones: the mask changes at every position,
so a verification row masked for the wrong prefix shows), logit_bias
{a: +1, e: -1.5}, frequency penalty 1.0 and presence penalty 0.5 (they change
with every drafted token, so a row that ignores the drafts before it shows).

Greedy: AR, SD and SSD with the processing give the same tokens, which match
the regex, and differ from the unprocessed output (the processing acts).

Sampled: the joint of generated tokens 1-4 of 5 (token 0 from the prefill;
the first round drafts K = 3 and verifies them all: depths 1-3 and the bonus)
against the processed law, enumerated here with a reference bias written
independently of ssd.engine.processing (the allowed classes hard-coded, the
penalties from the prefix's counts); chi-square, cells below 5 expected
pooled, alpha 0.001 (tests/stats.py). AR, SD (draft under the same
processing) and SSD (the speculator unprocessed: only the target is masked).

Power, SD at the same seeds: `penalties_ignore_drafts` (the grammar
advanced through the drafts, the penalties counting committed tokens only)
must fail the chi-square; `rows_ignore_drafts` (every verification row
biased for the round's first position) emits tokens the grammar refuses,
and the run fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import pytest
import torch

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine import grammar
from ssd.engine.processing import LogitsProcessor
from ssd.engine.request import GenerationRequest, Processing
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.saguaro.target import SSDEngine
from ssd.sampling import Bias, probs_from_logits
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue

V = 6
SMALL = TinyModelConfig(vocab_size=V, num_hidden_layers=1, initializer_range=0.4, seed=4)
PROMPT = [0, 3, 1]
K = 3
N_TOKENS = K + 2
POSITIONS = [1, 2, 3, 4]
SAMPLES = 800
REGEX = "([abc][def])+"
BIAS = {0: 1.0, 4: -1.5}
FREQUENCY, PRESENCE = 1.0, 0.5
SPEC = Processing(tuple(sorted(BIAS.items())), PRESENCE, FREQUENCY, grammar.regex(REGEX))
SAMPLED = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def pair():
    target = build_tiny_model(SMALL, torch.float64)
    return target, build_tiny_model(dataclasses.replace(SMALL, noise=0.1), torch.float64)


def engine(mode: str, pair, k: int = K):
    target, draft = pair
    tok = TinyTokenizer(V)
    if mode == "ar":
        return AREngine(target, tok)
    spec = SpeculationConfig(mode=mode, k=k)
    return SDEngine(target, draft, tok, spec) if mode == "sd" else SSDEngine.in_process(target, draft, tok, spec)


def generate(eng, sampling: SamplingConfig, max_new: int, processing: Processing | None = SPEC, prompt=PROMPT):
    return eng.generate(GenerationRequest(prompt, sampling, GenerationConfig(max_new_tokens=max_new),
                                          processing=processing))


# --- the reference law ---------------------------------------------------------------------


def reference_bias(generated: list[int]) -> torch.Tensor:
    """The processed law's bias after `generated`, without ssd.engine.processing."""
    bias = torch.zeros(V, dtype=torch.float64)
    for token, value in BIAS.items():
        bias[token] += value
    for token, count in Counter(generated).items():
        bias[token] -= count * FREQUENCY + PRESENCE
    allowed = {0, 1, 2} if len(generated) % 2 == 0 else {3, 4, 5}
    for token in range(V):
        if token not in allowed:
            bias[token] = float("-inf")
    return bias


@torch.no_grad()
def exact_joint(model, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(tokens at POSITIONS) under the processed law, enumerated over every prefix."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(prefix: list[int], mass: float) -> None:
        logits = model(input_ids=torch.tensor([PROMPT + prefix])).logits[0, -1]
        probs = probs_from_logits(logits, sampling, Bias(reference_bias(prefix)))
        for token, p in enumerate(probs.tolist()):
            if p <= 0:
                continue
            seq = prefix + [token]
            if len(seq) == N_TOKENS:
                out[tuple(seq[i] for i in POSITIONS)] += mass * p
            else:
                walk(seq, mass * p)

    walk([], 1.0)
    return dict(out)


def draws(eng, samples: int = SAMPLES) -> list[tuple[int, ...]]:
    out = []
    for seed in range(samples):
        result = generate(eng, dataclasses.replace(SAMPLED, seed=seed), N_TOKENS)
        assert len(result.token_ids) == N_TOKENS, result
        out.append(tuple(result.token_ids[i] for i in POSITIONS))
    return out


# --- greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [PROMPT, [5, 5, 2, 1], [3]])
def test_greedy_with_processing_is_ar_with_processing_in_every_mode(pair, prompt):
    greedy = SamplingConfig(temperature=0.0)
    reference = generate(engine("ar", pair), greedy, 24, prompt=prompt)
    assert re.fullmatch(REGEX, reference.text), reference.text
    assert reference.token_ids != generate(engine("ar", pair), greedy, 24, None, prompt).token_ids
    assert generate(engine("sd", pair), greedy, 24, prompt=prompt).token_ids == reference.token_ids
    with engine("ssd", pair) as ssd:
        assert generate(ssd, greedy, 24, prompt=prompt).token_ids == reference.token_ids


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_completed_grammar_ends_the_row_with_stop(pair, mode):
    """[abc][def][abc] is complete after 3 tokens; the tiny model has no EOS, so the row ends there."""
    finite = Processing(grammar=grammar.regex("[abc][def][abc]"))
    eng = engine(mode, pair)
    try:
        for seed in range(5):
            out = generate(eng, dataclasses.replace(SAMPLED, seed=seed), 20, finite)
            assert out.finish_reason == "stop" and len(out.token_ids) == 3, out
            assert re.fullmatch("[abc][def][abc]", out.text)
    finally:
        eng.close()


def test_logit_bias_alone_forces_and_bans():
    """+100 makes a token all but certain; -100 all but impossible (OpenAI's documented extremes)."""
    target = build_tiny_model(SMALL, torch.float64)
    ar = AREngine(target, TinyTokenizer(V))
    forced = generate(ar, SAMPLED, 12, Processing(logit_bias=((2, 100.0),)))
    assert forced.token_ids == [2] * 12
    banned = generate(ar, SamplingConfig(temperature=0.0), 12, Processing(logit_bias=tuple((t, -100.0) for t in (0, 1))))
    assert not {0, 1} & set(banned.token_ids)


# --- sampled: chi-square against the processed law ------------------------------------------


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_sampled_output_follows_the_processed_law(pair, mode):
    expected = exact_joint(pair[0], SAMPLED)
    eng = engine(mode, pair)
    try:
        samples = draws(eng)
    finally:
        eng.close()
    pvalue = chi_square_pvalue(samples, expected)
    report_pvalue("processing", "regex+bias+penalties T=1", mode, len(samples), pvalue)
    assert pvalue > ALPHA, pvalue


def rows_ignore_drafts(monkeypatch) -> None:
    def rows(self, drafted, vocab):
        self.reset()
        return Bias.stack([self.bias(vocab)] * (len(drafted) + 1))

    monkeypatch.setattr(LogitsProcessor, "rows", rows)


def ignoring_drafts(monkeypatch, method: str) -> None:
    """Break LogitsProcessor.<method>: it sees the committed tokens only, not the drafts
    pending before a verification row."""
    original = getattr(LogitsProcessor, method)

    def committed_only(self, *args):
        pending, self.pending = self.pending, []
        try:
            return original(self, *args)
        finally:
            self.pending = pending

    monkeypatch.setattr(LogitsProcessor, method, committed_only)


def penalties_ignore_drafts(monkeypatch) -> None:
    ignoring_drafts(monkeypatch, "_penalties")


def test_rows_that_ignore_the_drafts_emit_what_the_grammar_refuses(pair, monkeypatch):
    """Row 1 masked for position 1's class: every draft there is rejected and its correction
    drawn from the wrong class, which the grammar refuses when it is emitted (a failed row)."""
    rows_ignore_drafts(monkeypatch)
    with pytest.raises(RuntimeError, match="grammar refused emitted token"):
        draws(engine("sd", pair))


@pytest.mark.parametrize("broken", [penalties_ignore_drafts])
def test_the_chi_square_rejects_verification_against_the_wrong_rows(pair, monkeypatch, broken):
    expected = exact_joint(pair[0], SAMPLED)
    broken(monkeypatch)
    samples = draws(engine("sd", pair))
    pvalue = chi_square_pvalue(samples, expected)
    report_pvalue("processing", "regex+bias+penalties T=1", broken.__name__, len(samples), pvalue)
    assert pvalue < ALPHA, pvalue


def test_ssd_hit_rate_under_a_mask(pair, capsys):
    """Reported, not asserted beyond > 0: the speculator drafts unmasked, so a cached outcome
    that the mask forbids is rejected; the hit rate says how often the cache still served."""
    with engine("ssd", pair) as ssd:
        hits = lookups = 0
        for seed in range(40):
            out = generate(ssd, dataclasses.replace(SAMPLED, seed=seed), 24)
            hits, lookups = hits + out.stats.spec.hits, lookups + out.stats.spec.lookups
    with engine("ssd", pair) as ssd:
        plain_hits = plain_lookups = 0
        for seed in range(40):
            out = generate(ssd, dataclasses.replace(SAMPLED, seed=seed), 24, None)
            plain_hits, plain_lookups = plain_hits + out.stats.spec.hits, plain_lookups + out.stats.spec.lookups
    with capsys.disabled():
        print(f"\nSSD hit rate under the mask {hits / lookups:.2f} ({lookups} lookups); "
              f"unmasked {plain_hits / plain_lookups:.2f} ({plain_lookups})")
    assert lookups > 0 and hits > 0
