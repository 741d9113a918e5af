"""Prompt lookup on plain target steps (ssd.engine.lookup): the rule that picks how many
tokens to verify, its two estimates, and exactness on every path that runs plain steps.

Exactness: greedy SD and SSD rows held at K 0 (speculation.k_policy {1: 0}), and SSD
rows without a draft, equal AR token for token while their lookups are accepted and
rejected (both asserted); sampled, the SD engine at K 0 with every round's lookup
forced to 3 tokens matches the target's enumerated joint of tokens 1-4 (chi-square),
and the same test rejects two broken verifiers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ssd.engine.proposers as proposers_module
from ssd.config import (
    BatchingConfig, ConfigError, GenerationConfig, PromptLookupConfig, SamplingConfig, SpeculationConfig,
)
from ssd.engine import AREngine, SDEngine
from ssd.engine.lookup import LookupOdds, StepCost, best_length
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.saguaro.target import SSDEngine
from ssd.tools.bench.sampling_check import run_rows
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import SMALL, accept_all, correction_from_p, small_models

GREEDY = SamplingConfig(temperature=0.0)


# --- the rule and its estimates ------------------------------------------------------------

def _rate(a: float, c: float, length: int) -> float:
    return sum(a**i for i in range(length + 1)) / (1 + c * length)


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 1), st.floats(0, 3), st.integers(0, 16))
def test_the_best_length_maximizes_expected_tokens_per_step_time(a, c, longest):
    best = best_length(a, c, longest)
    assert 0 <= best <= longest
    assert all(_rate(a, c, best) >= _rate(a, c, n) - 1e-12 for n in range(longest + 1))


def test_lookups_pay_only_where_acceptance_beats_their_cost():
    assert best_length(0.4, 0.5, 8) == 0  # a 0.5-step token accepted 40 % of the time: a plain step
    assert best_length(0.6, 0.5, 8) >= 1
    assert best_length(0.95, 0.5, 16) > best_length(0.8, 0.5, 16) >= 1  # surer text, longer lookups
    assert best_length(0.9, 0.01, 8) == 8  # nearly free tokens (a GPU's): the whole match
    assert best_length(1.0, 0.5, 3) == 3 and best_length(0.99, 0.5, 0) == 0


def test_the_odds_follow_the_lookups_and_drift_back_to_the_prior_when_they_stop():
    assert LookupOdds.after_match(4).rate == 0.75 and LookupOdds.after_match(2).rate == 0.5
    odds = LookupOdds.after_match(4)
    prior = odds.rate
    for _ in range(10):
        odds.record(4, 4)
    assert odds.rate > 0.95
    for _ in range(20):
        odds.record(2, 0)
    low = odds.rate
    assert low < 0.3 and best_length(low, 0.5, 8) == 0  # its lookups stop paying: plain steps
    for _ in range(30):
        odds.record(0, 0)  # rounds without a lookup
    assert low < odds.rate < prior + 1e-9 and abs(odds.rate - prior) < 0.1


def test_the_step_cost_starts_at_its_prior_and_finds_a_linear_cost():
    cost = StepCost(prior=0.5)
    assert cost.token_cost(1) == 0.5  # nothing seen
    for _ in range(50):
        cost.observe(1, 0.2)
    assert cost.token_cost(1) == pytest.approx(0.5)  # one token count seen: the prior, at its scale
    for _ in range(300):
        for n in (1, 3, 5):
            cost.observe(n, 0.1 + 0.05 * n)  # a forward of n tokens: 0.1 s + 0.05 s a token
    assert cost.token_cost(1) == pytest.approx(0.05 / 0.15, rel=0.02)
    assert cost.token_cost(4) == pytest.approx(0.05 / 0.30, rel=0.02)


def test_a_stale_outlier_gives_way_to_the_prior_once_only_one_count_is_seen():
    cost = StepCost(prior=0.5)
    cost.observe(1, 0.1)
    cost.observe(6, 5.0)  # a warm-up forward of a new shape: 10 s a token
    assert cost.token_cost(1) > 0.8  # lookups stop...
    for _ in range(150):
        cost.observe(1, 0.1)  # ...and only plain steps follow
    assert cost.token_cost(1) < 0.6  # back near the prior: lookups are tried again


def test_prompt_lookup_settings_are_checked_by_name():
    assert SpeculationConfig(mode="sd", prompt_lookup=PromptLookupConfig(max_tokens=0)).lookup_ceiling == 0
    for bad in (dict(max_tokens=-1), dict(max_tokens=65), dict(min_n=0), dict(min_n=3, max_n=2)):
        with pytest.raises(ConfigError, match="speculation.prompt_lookup"):
            PromptLookupConfig(**bad)
    for bad in (dict(max_tokens=True), dict(max_tokens=2.5)):
        with pytest.raises(ConfigError, match="speculation.prompt_lookup.max_tokens"):
            PromptLookupConfig(**bad)
    default = SpeculationConfig(mode="sd", k=2)
    assert default.lookup_ceiling == default.round_ceiling == 2  # the row's K
    spec = SpeculationConfig(mode="sd", k=2, prompt_lookup=PromptLookupConfig(max_tokens=6))
    assert spec.lookup_ceiling == spec.round_ceiling == 6  # admission reserves the longer of K and the lookup


# --- greedy: equal to AR while lookups are accepted and rejected ---------------------------

# a text that repeats itself, then what the tiny model makes of it
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 7, 7, 7], [3, 9, 4, 3, 9, 4, 3, 9], [5, 6, 7]]


def off_spec(mode: str, k: int = 3, **lookup) -> SpeculationConfig:
    """Speculation that k_policy holds at K 0 at every batch size: plain steps, with lookups."""
    return SpeculationConfig(mode=mode, k=k, k_policy={1: 0}, prompt_lookup=PromptLookupConfig(**lookup))


def requests(mode: str, n: int = 24, **lookup) -> list[GenerationRequest]:
    return [GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=n), off_spec(mode, **lookup)) for p in PROMPTS]


def ar(target, tokenizer, r: GenerationRequest) -> list[int]:
    return AREngine(target, tokenizer).generate(dataclasses.replace(r, speculation=None)).token_ids


@pytest.fixture
def eager(monkeypatch):
    """Every lookup verified whole (the rule alone would wait for odds a tiny model never earns)."""
    monkeypatch.setattr(proposers_module, "best_length", lambda a, c, longest, rows=1: longest)


def assert_equal_to_ar_with_lookups_accepted_and_rejected(outs, reqs, target, tokenizer):
    for r, out in zip(reqs, outs):
        assert out.token_ids == ar(target, tokenizer, r)
    looked_up = sum(o.stats.looked_up for o in outs)
    accepted = sum(o.stats.lookup_accepted for o in outs)
    assert 0 < accepted < looked_up, (accepted, looked_up)  # both verification outcomes ran
    assert sum(o.stats.drafted for o in outs) == 0  # the draft drafted nothing: K 0


def test_greedy_sd_at_k0_with_lookups_equals_ar_alone_and_batched(tiny_models, tiny_tokenizer, eager):
    target, draft = tiny_models
    reqs = requests("sd")
    engine = SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4))
    assert_equal_to_ar_with_lookups_accepted_and_rejected(run_rows(engine, reqs), reqs, target, tiny_tokenizer)
    alone = [engine.generate(r) for r in reqs]
    assert_equal_to_ar_with_lookups_accepted_and_rejected(alone, reqs, target, tiny_tokenizer)


def test_greedy_ssd_rows_held_off_the_draft_or_without_one_look_up_and_equal_ar(tiny_models, tiny_tokenizer, eager):
    target, draft = tiny_models
    reqs = requests("ssd")
    parked = SSDEngine.in_process(target, draft, tiny_tokenizer, off_spec("ssd"), BatchingConfig(max_rows=4))
    try:
        outs = run_rows(parked, reqs)
    finally:
        parked.close()
    assert_equal_to_ar_with_lookups_accepted_and_rejected(outs, reqs, target, tiny_tokenizer)
    speculating = [dataclasses.replace(r, speculation=dataclasses.replace(r.speculation, k_policy={})) for r in reqs]
    no_draft = SSDEngine(target, tiny_tokenizer, off_spec("ssd"), BatchingConfig(max_rows=4))  # no link: degraded
    outs = run_rows(no_draft, speculating)
    assert all(o.stats.spec.degraded_rounds > 0 for o in outs)
    assert_equal_to_ar_with_lookups_accepted_and_rejected(outs, speculating, target, tiny_tokenizer)


def test_the_greedy_test_fails_on_a_verifier_that_accepts_every_lookup(tiny_models, tiny_tokenizer, eager):
    target, draft = tiny_models
    reqs = requests("sd")
    engine = SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4),
                      verifier=lambda drafted, q, p, draws, greedy=False: accept_all(drafted, q, p, draws))
    with pytest.raises(AssertionError):
        assert_equal_to_ar_with_lookups_accepted_and_rejected(run_rows(engine, reqs), reqs, target, tiny_tokenizer)


def test_lookups_off_or_a_speculating_row_verify_no_lookup(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4))
    off = [engine.generate(r) for r in requests("sd", max_tokens=0)]
    drafting = [engine.generate(dataclasses.replace(r, speculation=SpeculationConfig(mode="sd", k=3)))
                for r in requests("sd")]
    assert all(o.stats.lookup_rounds == 0 for o in off + drafting)
    assert all(o.stats.drafted > 0 for o in drafting)


def test_the_rule_left_alone_looks_up_a_repeating_text_and_stays_exact(tiny_models, tiny_tokenizer):
    """No forcing: the engine's own odds and measured step cost decide (the tiny model answers this
    prompt with a run of 14 equal tokens)."""
    target, draft = tiny_models
    r = GenerationRequest([1, 2, 3, 4, 5] * 6, GREEDY, GenerationConfig(max_new_tokens=40), off_spec("sd", max_tokens=8))
    out = SDEngine(target, draft, tiny_tokenizer, off_spec("sd")).generate(r)
    assert out.token_ids == ar(target, tiny_tokenizer, r)
    assert out.stats.lookup_rounds > 0 and out.stats.lookup_accepted > 0


# --- sampled: the target's law, with lookups verified at depths 1-3 ------------------------

# [0, 1, 2, t, t, t, t] for each t, then [0, 1, 2]: whatever the prefill's token t0, the text
# ends [0, 1, 2, t0], which occurred before followed by [t0, t0, t0]: the first round looks up 3
# tokens (measured: acceptance lengths 0-3 in 33, 20, 13, 33 % of 300 seeds at T = 1)
PROMPT = [tok for t in range(4) for tok in (0, 1, 2, t, t, t, t)] + [0, 1, 2]
POSITIONS = [1, 2, 3, 4]
N_TOKENS = 5
SAMPLES = 600
STRONG = 300
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def small_pair():
    return small_models()


def lookup_draws(pair, sampling: SamplingConfig, verifier=None, samples: int = SAMPLES, mode: str = "sd",
                 prompt: list[int] = PROMPT, prediction: list[int] | None = None):
    """Tokens 1-4 of seeded SD rows at K 0 (mode "sd"; "no draft": an SD engine without a draft
    model; "ssd": SSD rows parked by k_policy) whose every lookup is forced to min(3, its match);
    asserts the first round after the prefill verified 3 looked-up tokens in every row, and
    returns (samples, first-round acceptance lengths)."""
    target, draft = pair
    spec = off_spec("ssd" if mode == "ssd" else "sd", max_tokens=3)
    kw = {"verifier": verifier} if verifier is not None else {}
    args = (TinyTokenizer(SMALL.vocab_size), spec, BatchingConfig(max_rows=16))
    if mode == "ssd":
        engine = SSDEngine.in_process(target, draft, *args, **kw)
    else:
        engine = SDEngine(target, draft if mode == "sd" else None, *args, **kw)
    rounds: list[list[list[int]]] = [[] for _ in range(samples)]
    reqs = [GenerationRequest(prompt, dataclasses.replace(sampling, seed=seed), GenerationConfig(max_new_tokens=N_TOKENS),
                              spec, on_tokens=rounds[seed].append, prediction=prediction) for seed in range(samples)]
    with engine:
        outs = run_rows(engine, reqs)
    first = Counter()
    for out, seed_rounds in zip(outs, rounds):
        assert out.stats.looked_up >= 3 and out.stats.drafted == 0
        first[len(seed_rounds[1]) - 1] += 1
    return [tuple(out.token_ids[i] for i in POSITIONS) for out in outs], first


@pytest.mark.parametrize("mode", ["sd", "no draft", "ssd"])
@pytest.mark.parametrize("sampling", [T1, SamplingConfig(temperature=1.0, top_p=0.8)], ids=["t1.0", "top_p"])
def test_sampled_lookups_keep_the_target_law(small_pair, eager, sampling, mode):
    samples, first = lookup_draws(small_pair, sampling, mode=mode)
    assert all(first[k] / len(samples) >= 0.05 for k in range(4)), first  # every acceptance length occurs
    pvalue = chi_square_pvalue(samples, exact_marginal(small_pair[0], PROMPT, N_TOKENS, sampling, POSITIONS))
    report_pvalue(f"lookup ({mode})", "top_p" if sampling.top_p < 1 else "t1.0", "exact", len(samples), pvalue)
    assert pvalue > ALPHA, f"prompt lookup changed the law: p = {pvalue:.2e}"


@pytest.mark.parametrize("mode, broken, samples", [
    ("sd", accept_all, STRONG), ("sd", correction_from_p, SAMPLES), ("ssd", accept_all, STRONG)],
    ids=["sd-accept_all", "sd-correction_from_p", "ssd-accept_all"])
def test_the_sampled_lookup_test_rejects_broken_verifiers(small_pair, eager, mode, broken, samples):
    drawn, _ = lookup_draws(small_pair, T1, broken, samples, mode)
    pvalue = chi_square_pvalue(drawn, exact_marginal(small_pair[0], PROMPT, N_TOKENS, T1, POSITIONS))
    report_pvalue(f"lookup ({mode})", "t1.0", broken.__name__, samples, pvalue)
    assert pvalue < ALPHA, f"{broken.__name__} went undetected: p = {pvalue:.2e}"


def test_sd_without_a_draft_model_runs_plain_steps_and_lookups_equal_to_ar(tiny_models, tiny_tokenizer, eager):
    """SDEngine(target, None): prompt lookup is the only speculation (launch/bench_lookup.py's row)."""
    target, _ = tiny_models
    reqs = [dataclasses.replace(r, speculation=SpeculationConfig(mode="sd", k=3)) for r in requests("sd")]
    engine = SDEngine(target, None, tiny_tokenizer, SpeculationConfig(mode="sd", k=3), BatchingConfig(max_rows=4))
    assert_equal_to_ar_with_lookups_accepted_and_rejected(run_rows(engine, reqs), reqs, target, tiny_tokenizer)


def test_the_lookup_bench_compares_ar_with_lookups_on_one_target(tmp_path, capsys):
    """launch/bench_lookup.py's command (ssd.tools.bench.lookup.main) end to end on the tiny config:
    a row per prompt, greedy tokens equal."""
    import json

    from ssd.tools.bench.lookup import main

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    prompts = tmp_path / "p.yaml"
    prompts.write_text('- "abcabcabcabc"\n- "ponm"\n')
    main(["--config", str(root / "configs" / "tiny.yaml"), "--prompt-file", str(prompts),
          "--max-new-tokens", "16", "--rounds", "2", "--threads", "1", "--out", str(tmp_path / "lookup")])
    result = json.loads((tmp_path / "lookup.json").read_text())
    assert [row["prompt"] for row in result["rows"]] == [0, 1]
    assert all(row["greedy_equal"] for row in result["rows"]) and result["lookup_ceiling"] == 8
    assert "| AR tok/s | AR + lookup tok/s |" in capsys.readouterr().out


def test_served_metrics_count_the_lookups(tiny_models, tiny_tokenizer, eager):
    from ssd.serve.metrics import ServerMetrics, prometheus_text, server_registry

    target, draft = tiny_models
    metrics = ServerMetrics()
    outs = run_rows(SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4)), requests("sd"))
    for out in outs:
        metrics.finished("length", out.stats, None, 1.0, 0.0)
    text = prometheus_text(server_registry(metrics, lambda: (0, 0)))
    proposed, accepted = sum(o.stats.looked_up for o in outs), sum(o.stats.lookup_accepted for o in outs)
    assert f"ssd:prompt_lookup_num_tokens_total {float(proposed)}" in text
    assert f"ssd:prompt_lookup_num_accepted_tokens_total {float(accepted)}" in text


def test_a_requests_stats_on_the_wire_carry_its_lookups(tiny_models, tiny_tokenizer, eager):
    from ssd.serve import convert, protos
    from ssd.serve.service import request_stats

    target, draft = tiny_models
    out = SDEngine(target, draft, tiny_tokenizer, off_spec("sd")).generate(requests("sd")[0])
    pb, _ = protos.load()
    wire = convert.request_stats(pb, request_stats(out.stats, 0.0, 0.1, 1.0))
    assert (wire.lookup_rounds, wire.looked_up, wire.lookup_accepted) == (
        out.stats.lookup_rounds, out.stats.looked_up, out.stats.lookup_accepted)
    assert wire.looked_up > 0


def test_the_prompt_lookup_flag_sets_its_config_key():
    import argparse

    from ssd.app.cli import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    configured = {flags: config_from_args(parser.parse_args(["--mode", "sd", *flags])).speculation
                  for flags in [(), ("--prompt-lookup", "0"), ("--prompt-lookup", "6")]}
    assert configured[()].lookup_ceiling == configured[()].k  # default: up to the row's K
    assert configured[("--prompt-lookup", "0")].lookup_ceiling == 0
    assert configured[("--prompt-lookup", "6")].lookup_ceiling == 6


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0, coupling="gumbel"),
                                      SamplingConfig(temperature=0.7, top_p=0.8, coupling="gumbel")],
                         ids=["t1.0", "t0.7-top_p0.8"])
def test_coupled_rows_with_lookups_give_coupled_ar_s_output(tiny_models, tiny_tokenizer, eager, sampling):
    """Coupled sampling: a seed gives AR's output whatever a round verifies, lookups included."""
    target, draft = tiny_models
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(sampling, seed=seed))
            for seed in range(3) for r in requests("sd")]
    outs = run_rows(SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4)), reqs)
    assert_equal_to_ar_with_lookups_accepted_and_rejected(outs, reqs, target, tiny_tokenizer)


# --- a predicted output (OpenAI's Predicted Outputs) as more text to look up in ----------------


def test_a_prediction_feeds_lookups_and_greedy_output_stays_ars(tiny_models, tiny_tokenizer, eager):
    """A prompt that never repeats looks up nothing; with AR's own output as the prediction every
    round looks it up and accepts it; with a wrong prediction the lookups are rejected. Output == AR."""
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4))
    plain = GenerationRequest([5, 6, 7], GREEDY, GenerationConfig(max_new_tokens=24), off_spec("sd"))
    want = ar(target, tiny_tokenizer, plain)
    alone = engine.generate(plain)
    right = engine.generate(dataclasses.replace(plain, prediction=[5, 6, 7] + want))
    wrong = engine.generate(dataclasses.replace(plain, prediction=[5, 6, 7] + [(t + 1) % 16 for t in want]))
    assert alone.token_ids == right.token_ids == wrong.token_ids == want
    assert right.stats.lookup_accepted > alone.stats.lookup_accepted
    assert right.stats.lookup_accepted == right.stats.looked_up and right.stats.rounds < alone.stats.rounds
    assert wrong.stats.looked_up > 0 and wrong.stats.lookup_accepted < wrong.stats.looked_up
    broken = SDEngine(target, draft, tiny_tokenizer, off_spec("sd"), BatchingConfig(max_rows=4),
                      verifier=lambda drafted, q, p, draws, greedy=False: accept_all(drafted, q, p, draws))
    assert broken.generate(dataclasses.replace(plain, prediction=[5, 6, 7] + [(t + 1) % 16 for t in want])).token_ids != want


# The prompt never repeats; the prediction holds [0, 2, t, t, t, t] for each t, so whatever the
# prefill's token t0, the text ends [0, 2, t0], which the prediction follows with [t0, t0, t0].
PREDICTED_PROMPT = [3, 1, 0, 2]
PREDICTION = [tok for t in range(4) for tok in (0, 2, t, t, t, t)]


def test_sampled_lookups_from_a_prediction_keep_the_target_law(small_pair, eager):
    samples, first = lookup_draws(small_pair, T1, prompt=PREDICTED_PROMPT, prediction=PREDICTION)
    assert all(first[k] / len(samples) >= 0.05 for k in range(4)), first
    pvalue = chi_square_pvalue(samples, exact_marginal(small_pair[0], PREDICTED_PROMPT, N_TOKENS, T1, POSITIONS))
    report_pvalue("lookup from a prediction", "t1.0", "exact", len(samples), pvalue)
    assert pvalue > ALPHA, f"a prediction changed the law: p = {pvalue:.2e}"
    drawn, _ = lookup_draws(small_pair, T1, accept_all, STRONG, prompt=PREDICTED_PROMPT, prediction=PREDICTION)
    broken = chi_square_pvalue(drawn, exact_marginal(small_pair[0], PREDICTED_PROMPT, N_TOKENS, T1, POSITIONS))
    report_pvalue("lookup from a prediction", "t1.0", "accept_all", STRONG, broken)
    assert broken < ALPHA, f"accept_all went undetected: p = {broken:.2e}"
