"""Coupled sampling (sampling.coupling: gumbel): a seed gives AR's tokens in every mode.

The noise (ssd.sampling.keyed_uniforms / gumbel_noise): a pure function of
(seed, position, token) with fixed golden values, uniform (chi-square over 64
bins of 1M draws, and over their low bits; power: u^1.05 fails), sensitive to
every key (seed's low and high bits, position, token), and its Gumbel-max
draws follow the law they are taken from (power: the same noise at every
position fails).

Equality, token for token with coupled AR alone at the same seed (tiny fp64
pair, V = 16; T = 1, T = 0.7 with top-k 5, T = 1 with top-p 0.8):
- SD for K = 1, 3, 5, and with a draft unrelated to the target (its
  acceptance drops, its output does not change);
- SSD on cache hits (every outcome cached: every lookup hits), on every
  backup with forced misses (nothing cached: no lookup hits), both branch
  decoders and every glue;
- batches of mixed settings (coupled rows of different settings beside greedy
  and standard rows, a row joining mid-run) in the batched AR, SD and SSD
  engines;
- a row the draft fails mid-request, a link that dies mid-batch (closed, or the
  speculator gone), a link adopted mid-batch, rows parked by k_policy.
Power of the equality tests: standard sampling in SD is not AR's for these
seeds, and a coupled verifier that accepts every draft is caught.

The draft proposes with the target's noise at the right positions: with the
draft = the target every draft is accepted and, with the guesses of t* ranked
by the perturbed scores log q + g, every lookup hits; ranked by raw logits
(the standard sampler's ranking) they miss often.

The law: coupled AR, SD and SSD (cache-hit rounds) against the target's exact
joint law of four tokens (chi-square, as in test_distribution and
test_ssd_distribution); power: noise keyed without the position, and noise
keyed without the seed, fail the same test at the same seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from scipy import stats as scipy_stats

import ssd.sampling as sampling_module
import ssd.saguaro.builder as builder_module
import ssd.saguaro.speculator as speculator_module
from ssd.config import (
    GLUES, BatchingConfig, ConfigError, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig,
)
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.sampling import GumbelNoise, coupled_ids, gumbel_noise, keyed_uniforms, probs_from_logits
from ssd.saguaro.host import DraftThread
from ssd.saguaro.target import SSDEngine
from ssd.verify import Outcome, verify
from tests.conftest import TINY
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_batch_ssd import fail_row_once, linked, ok, run_batch
from tests.test_distribution import CASES as LAW_CASES, K as LAW_K, N_TOKENS, POSITIONS, PROMPT as LAW_PROMPT
from tests.test_distribution import draw as sd_draw, exact_joint, small_models
from tests.test_ssd_distribution import LATE, draw as ssd_draw, exact as ssd_exact, spec as full_spec
from tests.spies import slow_draft_counting_cuts

SETTINGS = {
    "t1.0": SamplingConfig(temperature=1.0, coupling="gumbel"),
    "t0.7-top_k5": SamplingConfig(temperature=0.7, top_k=5, coupling="gumbel"),
    "t1.0-top_p0.8": SamplingConfig(temperature=1.0, top_p=0.8, coupling="gumbel"),
}
T1 = SETTINGS["t1.0"]
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]
SEEDS = range(3)
N = 24


def seeded(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    return dataclasses.replace(sampling, seed=seed)


def ar_ids(target, tokenizer, prompt, sampling: SamplingConfig, n: int = N) -> list[int]:
    """Coupled AR alone: the reference every mode must reproduce."""
    return AREngine(target, tokenizer).generate(
        GenerationRequest(prompt, sampling, GenerationConfig(max_new_tokens=n))).token_ids


def ssd_spec(k: int = 3, budget: int = 8, kind: str = "geometric", anytime: bool = False, **kw) -> SpeculationConfig:
    """Builds to the budget with the draft's entries only, so that each test knows which
    lookups hit; test_coupled_ssd_with_anytime_builds_and_ngram_entries_equals_ar runs the defaults."""
    kw.setdefault("ngram_candidates", False)
    return SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(kind=kind, budget=budget, anytime=anytime), **kw)


def coupled_request(prompt, sampling=T1, n=N, speculation=None, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, sampling, GenerationConfig(max_new_tokens=n), speculation, **kw)


# --- the noise -------------------------------------------------------------------------------

def test_the_noise_is_a_pure_function_of_seed_position_and_token():
    u = keyed_uniforms(5, [3, 10, 7], 64)
    assert torch.equal(u, keyed_uniforms(5, [3, 10, 7], 64))
    assert torch.equal(keyed_uniforms(5, [10], 64)[0], u[1])  # alone or among others
    assert torch.equal(keyed_uniforms(5, [7, 3], 64), u[[2, 0]])  # in any order
    assert torch.equal(keyed_uniforms(5, [3], 200)[0, :64], u[0])  # a token's noise ignores the vocabulary size
    grid = u * 2**52 - 0.5  # u = (n + 0.5) / 2^52 exactly: strictly inside (0, 1)
    assert torch.equal(grid, grid.round()) and bool((u > 0).all() and (u < 1).all())
    g = gumbel_noise(5, [3, 10, 7], 64)
    assert torch.equal(g, -torch.log(-torch.log(u))) and bool(torch.isfinite(g).all())


def test_the_noise_has_fixed_values():
    """A change of the hash changes every coupled output ever produced: it must be deliberate."""
    got = keyed_uniforms(0, [0, 1], 4).flatten().tolist()
    assert got == pytest.approx(GOLDEN, abs=0, rel=0), got


GOLDEN = [  # keyed_uniforms(0, [0, 1], 4), as first computed
    0.478216228003291, 0.5905234697958902, 0.05120219224248024, 0.7982403106624362,
    0.9843850687813877, 0.17138736919467623, 0.022358337104326886, 0.32240967518506836,
]


@pytest.mark.parametrize("other", ["seed+1", "seed+2^32", "seed+2^63", "position+1", "token+1"])
def test_every_key_changes_the_noise(other):
    base = keyed_uniforms(1, range(64), 257)
    changed = {
        "seed+1": lambda: keyed_uniforms(2, range(64), 257),
        "seed+2^32": lambda: keyed_uniforms(1 + 2**32, range(64), 257),
        "seed+2^63": lambda: keyed_uniforms(1 + 2**63, range(64), 257),
        "position+1": lambda: keyed_uniforms(1, range(1, 65), 257),
        "token+1": lambda: keyed_uniforms(1, range(64), 258)[:, 1:],
    }[other]()
    assert not bool((base == changed).any())
    r = torch.corrcoef(torch.stack([base.flatten(), changed.flatten()]))[0, 1]
    assert abs(float(r)) < 0.03  # 16k pairs: independent draws give |r| ~ 0.008


def uniformity_pvalue(u: torch.Tensor, bins: int = 64) -> float:
    counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
    return float(scipy_stats.chisquare(counts.tolist()).pvalue)


def test_the_noise_is_uniform_and_the_test_sees_a_skew():
    u = keyed_uniforms(3, range(256), 4096).flatten()  # 1M draws
    low_bits = ((u * 2**52 - 0.5) % 64).to(torch.int64)  # the last lane's low bits
    assert uniformity_pvalue(u) > ALPHA
    assert float(scipy_stats.chisquare(torch.bincount(low_bits, minlength=64).tolist()).pvalue) > ALPHA
    assert uniformity_pvalue(u**1.05) < ALPHA  # power: a mild skew is caught


def positionless(real: Callable) -> Callable:
    """Broken noise: keyed without the position (every position gets position 0's)."""
    return lambda seed, positions, vocab, device="cpu", ids=None: real(seed, [0] * len(positions), vocab, device, ids)


def seedless(real: Callable) -> Callable:
    """Broken noise: keyed without the seed."""
    return lambda seed, positions, vocab, device="cpu", ids=None: real(0, positions, vocab, device, ids)


LAW = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02], dtype=torch.float64)


def gumbel_max_pvalue(positions: int = 4000) -> float:
    ids = coupled_ids(LAW.expand(positions, -1), GumbelNoise(11, tuple(range(positions)))).tolist()
    return chi_square_pvalue(ids, dict(enumerate(LAW.tolist())))


def test_gumbel_max_draws_follow_the_law_and_the_test_sees_a_positionless_key(monkeypatch):
    assert gumbel_max_pvalue() > ALPHA
    monkeypatch.setattr(sampling_module, "gumbel_noise", positionless(gumbel_noise))
    assert gumbel_max_pvalue() < ALPHA


def test_noise_at_chosen_ids_is_the_full_rows_noise_there():
    ids = torch.tensor([[0, 17, 199], [5, 5, 3]])
    full = keyed_uniforms(5, [3, 10], 200)
    assert torch.equal(keyed_uniforms(5, [3, 10], 200, ids=ids), full.gather(1, ids))


def test_a_draft_s_top_candidates_draw_agrees_with_the_full_draw_inside_them():
    """GumbelNoise.candidates (a draft's proposals): the full Gumbel-max whenever
    it falls among the row's top tokens, and never a token outside them."""
    positions = tuple(range(3000))
    rows = LAW.expand(len(positions), -1)
    full = coupled_ids(rows, GumbelNoise(11, positions)).tolist()
    top4 = coupled_ids(rows, GumbelNoise(11, positions, candidates=4)).tolist()
    assert all(b == a for a, b in zip(full, top4) if a < 4) and set(top4) <= {0, 1, 2, 3}
    assert any(a >= 4 for a in full)  # the restriction did act


def test_coupled_draws_never_take_a_masked_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0]] * 500, dtype=torch.float64)
    probs = probs_from_logits(logits, SamplingConfig(temperature=5.0, top_k=2, coupling="gumbel"))
    ids = coupled_ids(probs, GumbelNoise(0, tuple(range(500))))
    assert set(ids.tolist()) == {0, 1}


def test_the_coupling_setting_is_checked():
    with pytest.raises(ConfigError, match="sampling.coupling"):
        SamplingConfig(coupling="philox")
    assert not SamplingConfig(coupling="gumbel").coupled  # greedy stays greedy
    assert SamplingConfig(temperature=0.5, coupling="gumbel").coupled and not T1.needs_q


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_noise_is_the_same_on_a_gpu():
    positions = list(range(100, 164))
    cpu = keyed_uniforms(42, positions, 151936)
    assert torch.equal(keyed_uniforms(42, positions, 151936, "cuda").cpu(), cpu)  # the integer hash, bit for bit
    g = gumbel_noise(42, positions, 151936, "cuda").cpu()
    assert torch.allclose(g, gumbel_noise(42, positions, 151936), rtol=1e-14, atol=1e-14)  # two logs: ~1 ulp


def test_coupled_verification_accepts_exactly_the_target_s_choices():
    """verify() with a GumbelNoise: drafts equal to the target's Gumbel-max tokens
    are accepted, the first other one is replaced by the target's; q is never read."""
    p = torch.softmax(torch.randn(5, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    noise = GumbelNoise(9, (20, 21, 22, 23, 24))
    best = coupled_ids(p, noise).tolist()
    assert verify(best[:4], None, p, noise) == Outcome(4, best[4])
    for i in range(4):
        drafted = [*best[:i], (best[i] + 1) % 16, *best[i + 1 : 4]]
        assert verify(drafted, None, p, noise) == Outcome(i, best[i])
    with pytest.raises(ValueError, match="K=4"):
        verify(best[:4], None, p[:4], noise)


# --- equality with AR: SD -----------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("setting", SETTINGS)
def test_coupled_sd_equals_coupled_ar(tiny_models, tiny_tokenizer, k, setting):
    target, draft = tiny_models
    sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=k))
    accepted = drafted = 0
    for prompt in PROMPTS:
        for seed in SEEDS:
            sampling = seeded(SETTINGS[setting], seed)
            out = sd.generate(coupled_request(prompt, sampling))
            assert out.token_ids == ar_ids(target, tiny_tokenizer, prompt, sampling), (prompt, seed)
            accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert 0 < accepted < drafted  # both acceptance and rejection ran


def test_an_unrelated_draft_changes_acceptance_not_output(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    unrelated = build_tiny_model(dataclasses.replace(TINY, seed=5), torch.float64)
    rates = []
    for proposer in (draft, unrelated):
        sd = SDEngine(target, proposer, tiny_tokenizer, SpeculationConfig(mode="sd", k=4))
        outs = [sd.generate(coupled_request(p, seeded(T1, s))) for p in PROMPTS for s in SEEDS]
        for (p, s), out in zip([(p, s) for p in PROMPTS for s in SEEDS], outs):
            assert out.token_ids == ar_ids(target, tiny_tokenizer, p, seeded(T1, s))
        rates.append(sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs))
    assert rates[1] < rates[0]


def accept_all_coupled(drafted, q, p, gen, greedy=False):
    """Broken: every draft accepted, then the target's own token at the last position."""
    last = GumbelNoise(gen.seed, gen.positions[-1:])
    return Outcome(len(drafted), int(coupled_ids(p[-1:], last)[0]))


def test_a_draft_restricted_to_few_candidates_still_gives_ar_s_output(tiny_models, tiny_tokenizer, monkeypatch):
    """The draft's proposals over its top 3 tokens only (DRAFT_CANDIDATES is 64,
    more than the tiny vocabulary): SD and SSD still give AR's output."""
    import ssd.engine.drafting as drafting_module

    monkeypatch.setattr(drafting_module, "DRAFT_CANDIDATES", 3)
    monkeypatch.setattr(builder_module, "DRAFT_CANDIDATES", 3)
    target, draft = tiny_models
    sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))
    for p in PROMPTS:
        for s in SEEDS:
            sampling = seeded(T1, s)
            assert sd.generate(coupled_request(p, sampling)).token_ids == ar_ids(target, tiny_tokenizer, p, sampling)
    assert_ar(target, tiny_tokenizer, ssd_outputs(target, draft, tiny_tokenizer, ssd_spec(3, 6)))


def test_the_equality_tests_have_power(tiny_models, tiny_tokenizer):
    """Standard sampling in SD is not AR's for these seeds (coupling is what makes
    them equal), and a coupled verifier that accepts every draft is caught."""
    target, draft = tiny_models
    standard = dataclasses.replace(T1, coupling="standard")
    sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))
    broken = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3), verifier=accept_all_coupled)
    cases = [(p, s) for p in PROMPTS for s in SEEDS]
    assert any(sd.generate(coupled_request(p, seeded(standard, s))).token_ids
               != ar_ids(target, tiny_tokenizer, p, seeded(standard, s)) for p, s in cases)
    assert any(broken.generate(coupled_request(p, seeded(T1, s))).token_ids
               != ar_ids(target, tiny_tokenizer, p, seeded(T1, s)) for p, s in cases)


# --- equality with AR: SSD ----------------------------------------------------------------------

@pytest.fixture
def always_miss(monkeypatch):
    """Nothing is ever cached: every round runs the backup."""
    monkeypatch.setattr(speculator_module, "build_caches", lambda jobs: [{} for _ in jobs])


def ssd_outputs(target, draft, tokenizer, spec: SpeculationConfig, setting: str = "t1.0"):
    """[(prompt, sampling, result)] of SSD in process over PROMPTS x SEEDS."""
    with SSDEngine.in_process(target, draft, tokenizer, spec) as engine:
        return [(p, seeded(SETTINGS[setting], s), engine.generate(coupled_request(p, seeded(SETTINGS[setting], s))))
                for p in PROMPTS for s in SEEDS]


def assert_ar(target, tokenizer, runs) -> None:
    for prompt, sampling, out in runs:
        assert out.token_ids == ar_ids(target, tokenizer, prompt, sampling), (prompt, sampling.seed)


@pytest.mark.parametrize("setting", SETTINGS)
def test_coupled_ssd_on_cache_hits_equals_ar(tiny_models, tiny_tokenizer, setting):
    """Every outcome cached ((K + 1) V branches): every lookup hits."""
    target, draft = tiny_models
    runs = ssd_outputs(target, draft, tiny_tokenizer, ssd_spec(3, 4 * TINY.vocab_size, "uniform"), setting)
    assert_ar(target, tiny_tokenizer, runs)
    spec = [out.stats.spec for *_, out in runs]
    assert sum(s.lookups for s in spec) > 0 and all(s.hits == s.lookups for s in spec)


@pytest.mark.parametrize("glue", GLUES)
@pytest.mark.parametrize("decoder", ["tree", "batched"])
def test_coupled_ssd_with_a_partial_cache_equals_ar(tiny_models, tiny_tokenizer, glue, decoder):
    target, draft = tiny_models
    runs = ssd_outputs(target, draft, tiny_tokenizer, ssd_spec(3, 6, glue=glue, branch_decoder=decoder))
    assert_ar(target, tiny_tokenizer, runs)
    hits = sum(out.stats.spec.hits for *_, out in runs)
    assert 0 < hits < sum(out.stats.spec.lookups for *_, out in runs)  # hits and misses both ran


def test_coupled_ssd_with_anytime_builds_and_ngram_entries_equals_ar(tiny_models, tiny_tokenizer, monkeypatch):
    """The defaults: builds cut short (a slowed draft, so that the outcome arrives
    mid-build) and free n-gram entries (one-hot, no noise of their own) leave coupled
    SSD's output AR's."""
    target, draft = tiny_models
    cuts = slow_draft_counting_cuts(monkeypatch)
    runs = ssd_outputs(target, draft, tiny_tokenizer, ssd_spec(4, 6, anytime=True, ngram_candidates=True))
    assert_ar(target, tiny_tokenizer, runs)
    assert any(cuts) and sum(out.stats.spec.hits for *_, out in runs) > 0


@pytest.mark.parametrize("backup", ["neural", "lookup", "ngram", "random"])
def test_coupled_ssd_on_every_backup_with_forced_misses_equals_ar(tiny_models, tiny_tokenizer, always_miss, backup):
    target, draft = tiny_models
    runs = ssd_outputs(target, draft, tiny_tokenizer, ssd_spec(3, 8, backup=backup))
    assert_ar(target, tiny_tokenizer, runs)
    used = {"lookup": ("ngram", "neural")}.get(backup, (backup,))  # lookup: its n-gram match, else neural
    assert all(out.stats.spec.hits == 0 and sum(out.stats.spec.backups.get(b, 0) for b in used) > 0
               for *_, out in runs)


def perfect_draft_spec() -> SpeculationConfig:
    """One branch per acceptance length: the bonus outcome (the only one a perfect
    draft meets) gets a single guess; full-length bonus branches (glue reuse)."""
    return ssd_spec(4, 5, "uniform", glue="reuse")


def test_a_perfect_draft_proposes_with_the_targets_noise(tiny_models, tiny_tokenizer):
    """Draft = target: every draft is accepted (the draft's noise is the target's,
    at the same positions, in the backup chain and in every cache branch) and,
    with t* guessed by the perturbed scores, every lookup hits."""
    target, _ = tiny_models
    runs = ssd_outputs(target, target, tiny_tokenizer, perfect_draft_spec())
    assert_ar(target, tiny_tokenizer, runs)
    for *_, out in runs:
        assert out.stats.acceptance_rate == 1.0 and out.stats.spec.hit_rate == 1.0


def test_raw_logit_guesses_miss_under_shared_noise(tiny_models, tiny_tokenizer, monkeypatch):
    """The same run with t* guessed by raw logits (the standard sampler's ranking):
    the output is still AR's, but the bonus guesses miss."""
    target, _ = tiny_models
    monkeypatch.setattr(builder_module, "guess_scores", lambda logits, sampling, first: logits)
    runs = ssd_outputs(target, target, tiny_tokenizer, perfect_draft_spec())
    assert_ar(target, tiny_tokenizer, runs)
    hits = sum(out.stats.spec.hits for *_, out in runs)
    assert hits < 0.8 * sum(out.stats.spec.lookups for *_, out in runs)


# --- mixed batches and faults -------------------------------------------------------------------

def mixed_rows(speculation: SpeculationConfig | None) -> list[GenerationRequest]:
    """Coupled rows of three settings beside a greedy and a standard sampled row."""
    settings = [seeded(SETTINGS["t1.0"], 1), seeded(SETTINGS["t0.7-top_k5"], 2), seeded(SETTINGS["t1.0-top_p0.8"], 3),
                SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, seed=4)]
    return [coupled_request(p, s, 20, speculation) for p, s in zip([*PROMPTS, [2, 9], [11, 4, 4]], settings)]


def assert_coupled_rows_are_ar(target, tokenizer, rows, outs) -> None:
    for r, out in zip(rows, outs):
        if r.sampling.coupled or r.sampling.greedy:
            assert ok(out).token_ids == ar_ids(target, tokenizer, r.prompt_ids, r.sampling, 20), r.sampling


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_coupled_rows_in_a_mixed_batch_equal_ar_alone(tiny_models, tiny_tokenizer, mode):
    """Five rows of different settings, the last joining at step 3."""
    target, draft = tiny_models
    spec = ssd_spec(3, 6) if mode == "ssd" else SpeculationConfig(mode=mode, k=3)
    rows = mixed_rows(spec if mode != "ar" else None)
    batching = BatchingConfig(max_rows=8)
    if mode == "ssd":
        with linked(target, draft, tiny_tokenizer, batching) as (engine, spy, serving):
            outs = run_batch(engine, rows[:-1], admit_at={3: rows[-1:]})
    else:
        engine = AREngine(target, tiny_tokenizer, batching) if mode == "ar" else SDEngine(
            target, draft, tiny_tokenizer, spec, batching)
        outs = run_batch(engine, rows[:-1], admit_at={3: rows[-1:]})
    assert_coupled_rows_are_ar(target, tiny_tokenizer, rows, outs)


def test_a_row_the_draft_fails_mid_request_keeps_ar_s_output(tiny_models, tiny_tokenizer, monkeypatch):
    target, draft = tiny_models
    rows = mixed_rows(ssd_spec(3, 6))
    seen = fail_row_once(monkeypatch, head=5, at_round=3)
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        outs = run_batch(engine, rows)
    assert seen["failed_seq"] is not None
    assert_coupled_rows_are_ar(target, tiny_tokenizer, rows, outs)
    assert ok(outs[1]).stats.spec.degraded_rounds == 1  # the failed row ran one plain step, then speculated again


@pytest.mark.parametrize("how", ["closed", "speculator gone"])
def test_a_draft_that_dies_mid_request_keeps_ar_s_output(tiny_models, tiny_tokenizer, how):
    target, draft = tiny_models
    rows = mixed_rows(ssd_spec(3, 6))
    with linked(target, draft, tiny_tokenizer, timeout_s=0.5) as (engine, spy, serving):

        def kill(step: int) -> None:
            if step == 4 and how == "closed":
                spy.dead = True
            elif step == 4:
                serving.stop()

        outs = run_batch(engine, rows, after_step=kill)
        assert not engine.link_up
    assert_coupled_rows_are_ar(target, tiny_tokenizer, rows, outs)
    assert all(0 < ok(out).stats.spec.degraded_rounds < ok(out).stats.rounds for out in outs)


def test_a_link_adopted_mid_request_keeps_ar_s_output(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    rows = mixed_rows(ssd_spec(3, 6))
    engine = SSDEngine(target, tiny_tokenizer, ssd_spec(3, 6))
    serving = DraftThread(draft)
    try:
        outs = run_batch(engine, rows, after_step=lambda step: engine.attach(serving.channel) if step == 3 else None)
    finally:
        serving.stop()
    assert_coupled_rows_are_ar(target, tiny_tokenizer, rows, outs)
    assert all(ok(out).stats.spec.hits > 0 for out in outs[:3])


def test_rows_parked_by_the_k_policy_keep_ar_s_output(tiny_models, tiny_tokenizer):
    """k_policy {1: 3, 4: 0}: with four rows or more every row runs plain steps,
    then the rows left are prefilled on the draft again (a new epoch)."""
    target, draft = tiny_models
    rows = mixed_rows(dataclasses.replace(ssd_spec(3, 6), k_policy={1: 3, 4: 0}))
    rows = [dataclasses.replace(r, generation=GenerationConfig(max_new_tokens=6 if i < 2 else 20))
            for i, r in enumerate(rows)]
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        outs = run_batch(engine, rows)
    for r, out in zip(rows, outs):
        if r.sampling.coupled or r.sampling.greedy:
            n = r.generation.max_new_tokens
            assert ok(out).token_ids == ar_ids(target, tiny_tokenizer, r.prompt_ids, r.sampling, n)


# --- the law, with power ------------------------------------------------------------------------

LAW_SAMPLES = 600
SSD_LAW_SAMPLES = 300  # SSD's rounds cost more; position-less noise still gives p ~ 1e-50 here
STRONG = 200


@pytest.fixture(scope="module")
def law_pair():
    return small_models()


def ar_law_samples(pair, sampling: SamplingConfig, samples: int) -> list[tuple[int, ...]]:
    engine = AREngine(pair[0], TinyTokenizer(4))
    out = []
    for seed in range(samples):
        ids = engine.generate(GenerationRequest(LAW_PROMPT, seeded(sampling, seed),
                                                GenerationConfig(max_new_tokens=N_TOKENS))).token_ids
        out.append(tuple(ids[i] for i in POSITIONS))
    return out


def law_pvalue(pair, path: str, case: str, samples: int, variant: str) -> float:
    sampling = COUPLED_LAW[case]
    if path == "ar":
        drawn, expected = ar_law_samples(pair, sampling, samples), exact_joint(pair[0], sampling)
    elif path == "sd":
        drawn, expected = sd_draw(pair, sampling, samples=samples).samples, exact_joint(pair[0], sampling)
    else:  # ssd, from cache-hit rounds only
        draws = ssd_draw(pair, full_spec(), sampling, LATE, samples)
        assert draws.lookups > 0 and draws.hits == draws.lookups and draws.tested_from_round_1 == 0
        drawn, expected = draws.samples, ssd_exact(pair, sampling, LATE)
    pvalue = chi_square_pvalue(drawn, expected)
    report_pvalue(f"coupled {path}", case, variant, samples, pvalue)
    return pvalue


COUPLED_LAW = {name: dataclasses.replace(s, coupling="gumbel") for name, s in LAW_CASES.items()}


@pytest.mark.parametrize("path, case", [("ar", "t1.0"), ("sd", "t0.6"), ("sd", "t1.0"), ("sd", "top_p"), ("ssd", "t1.0")])
def test_coupled_output_follows_the_target_law(law_pair, path, case):
    assert law_pvalue(law_pair, path, case, SSD_LAW_SAMPLES if path == "ssd" else LAW_SAMPLES, "exact") > ALPHA


@pytest.mark.parametrize("path", ["sd", "ssd"])
@pytest.mark.parametrize("broken", [positionless, seedless], ids=["positionless", "seedless"])
def test_the_law_test_rejects_a_broken_noise_key(law_pair, monkeypatch, path, broken):
    monkeypatch.setattr(sampling_module, "gumbel_noise", broken(gumbel_noise))
    samples = STRONG if broken is seedless else SSD_LAW_SAMPLES if path == "ssd" else LAW_SAMPLES
    assert law_pvalue(law_pair, path, "t1.0", samples, broken.__name__) < ALPHA


def test_the_law_setting_reaches_every_depth(law_pair):
    """The SD law test's first round ends at every acceptance length, as in test_distribution."""
    draws = sd_draw(law_pair, COUPLED_LAW["t1.0"], samples=200)
    shares = {k: draws.first_round_accepted[k] / 200 for k in range(LAW_K + 1)}
    assert min(shares.values()) >= 0.03, shares


# --- the ablation tool ---------------------------------------------------------------------------

def test_the_ablation_runs_every_variant_and_coupled_ssd_is_ar(tiny_models, tiny_tokenizer, tmp_path):
    from ssd.config import Config
    from ssd.factory import LoadedPair
    from ssd.tools.ablation import coupling

    target, draft = tiny_models
    config = Config(speculation=ssd_spec(3, 6), generation=GenerationConfig(max_new_tokens=12))
    rows = coupling.run(config, LoadedPair(target, draft, tiny_tokenizer), PROMPTS[:2], [1.0])
    assert [r.variant for r in rows] == list(coupling.VARIANTS)
    assert all(r.equal_to_ar == 2 for r in rows if r.variant != "standard")
    assert all(0 < r.acceptance <= 1 and 0 <= r.hit_rate <= 1 for r in rows)
    assert builder_module.guess_scores.__name__ == "guess_scores"  # the raw-guess variant put it back
    assert "gumbel-raw-guesses" in coupling.table(rows)
    assert coupling.plot(rows, tmp_path / "c.png").stat().st_size > 0
    (same,) = coupling.same_contexts(config, LoadedPair(target, draft, tiny_tokenizer), PROMPTS[:2], [1.0], 4)
    assert same.positions == 24 and 0 < same.bound <= same.standard <= 1 and 0 < same.coupled <= 1
