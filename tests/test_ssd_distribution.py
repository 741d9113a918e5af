"""SSD samples exactly the target's distribution on every path, deep into its rounds.

Model, prompt and sampling settings as in test_distribution (one layer, a
4-token vocabulary, draft = target + 10 % weight noise), K = 3, SAMPLES fixed
seeds per run, SSDEngine.in_process (the speculator in a thread); the
cache-hit, backup and Saguaro draws run their seeds as rows of one batch
(each row draws what it would alone: asserted on the first seeds of every
draw). Chi-square against the
target's exact law by enumeration, cells with expected count < 5 pooled into
one, alpha 0.001. Each generation records the tokens every round emits, so
each test asserts where its tested tokens came from: which round, and which
slot of it (slot i < K: drafted depth i + 1, or the correction there; slot K:
the bonus). "Reaches slots 0..d": each holds >= 5 % of the tested tokens.

Paths, each isolated by construction:
- cache hit: budget (K + 1) * V caches every outcome, so every round after the
  first is a hit (asserted: hits == lookups). Tested: the joint of tokens 5-7
  of 8 (15-19 whole cells, 87-94 % of the mass). Round 1 follows the prefill,
  has no cache to look in and ends by token K + 1 = 4, so every tested token
  comes from a hit round (asserted); slots 0..3 reached. Settings: T = 0.6,
  T = 1, top-k 2, top-p 0.8, min-p 0.2.
- backup (neural, n-gram, random): the cache is always empty, so every round
  is a backup round (asserted: no hits). Tested: the joint of tokens 1-4 of 5,
  the first round's slots 0..3 as in SD. T = 1. Neural reaches slots 0..3,
  random 0..2; the n-gram's proposals are rarely accepted on this random
  model, so it reaches slots 0..1.
- Saguaro c = 0.5 (uniform budget K + 1), c = 0.1 (geometric budget 2(K + 1)),
  c = 0 (uniform budget K + 1): hits and misses interleave (asserted:
  0 < hit rate < 1; measured 0.55, 0.92, 0.87). Tested: tokens 5-7 of 8, all
  from rounds after the first (asserted). T = 1. c = 0.5 and 0.1 reach slots
  0..3; at c = 0 the drafts avoid the draft's own top token, are rarely
  accepted, and slots 0..1 are reached.
- a running row prefilled on the draft again, draft = target (every draft
  accepted, so drafted tokens are the draft's own draws): parked by
  k_policy {2: 0} for one step while a second request joins, or moved to a
  new link (a healed draft's new Speculator) after its first round. Tested:
  round 1's first draft with the first draft after the second prefill.
  T = 1; power: `replays_the_first_stream` (the draft's stream keyed by the
  seed alone, as before the prefill epoch: every prefill replays the same
  uniforms).
- a link adopted mid-request (a healed draft): each request runs its first
  round without a link; the link arrives after token 1 and the next round
  prefills the speculator with the sequence so far. Tested: tokens 6-8 of 9,
  all from hit rounds after the adoption round (asserted). T = 0.6 and T = 1;
  power: `accept_all_after_adoption`.

Power: each path broken alone, at the same path, setting and seeds as the
passing test it pairs with; gross breaks (cache hit at T = 0.6 and T = 1,
n-gram, Saguaro c = 0) use only the first STRONG_SAMPLES seeds, since fewer
samples only make detection harder.
- cache hit, at each setting: `cache_draws_reversed`: cached tokens at
  depth >= 2 drawn with q's ranks reversed but shipped with q. Only the
  builder is patched: the backup and the verifier are untouched, and the
  tested tokens come from hit rounds only (asserted again in the broken run).
  Top-p 0.8 leaves most rows one or two tokens, where a deep-only break is too
  rare to see in SAMPLES seeds, so there it starts at depth 1:
  `cache_draws_reversed_at_every_depth`.
- backups, with the always-empty cache: `neural_draws_flat` (drafts at
  depth >= 2 drawn uniformly over q's support, shipped with q),
  `random_repeats_first` (depth >= 2 repeats the first token, shipped with
  the uniform q), `ngram_ships_uniform_q` (uniform q rows instead of the
  one-hot rows of its deterministic proposal, at every depth: its drafts past
  depth 1 are almost never verified).
- a broken backup next to a working cache: `neural_draws_flat` with every
  outcome cached (asserted: every lookup hits) still fails the backup test's
  tokens 1-4, which round 1, always a backup round, produces.
- Saguaro, the cache alone: at c = 0.1 and c = 0 `cache_ships_q_not_q_prime`
  (cached tokens drawn from Saguaro's q' but shipped with the plain q, at
  every depth); at c = 0.5, whose q' is too close to q for that to show in
  SAMPLES seeds, `cache_draws_reversed`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import ssd.saguaro.backups as backups_module
import ssd.saguaro.builder as builder_module
import ssd.engine.drafting as drafting_module
import ssd.saguaro.speculator as speculator_module
from ssd.config import (
    BatchingConfig, FanoutConfig, GenerationConfig, PromptLookupConfig, SamplingConfig, SpeculationConfig,
)
from ssd.saguaro.target import SSDEngine
from ssd.models import TinyTokenizer
from ssd.engine.request import GenerationRequest
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import CASES, PROMPT, SMALL, run_rows, small_models

K = 3
V = SMALL.vocab_size
FULL = (K + 1) * V  # every token at every acceptance length: every outcome cached
SAMPLES = 400  # the weakest broken variant below still gives p < 1e-6
STRONG_SAMPLES = 200  # gross breaks: still p < 1e-10
T1 = CASES["t1.0"]


@dataclass(frozen=True)
class Window:
    """Which generated tokens a test reads, out of how many."""

    n_tokens: int
    positions: tuple[int, ...]


LATE = Window(8, (5, 6, 7))  # past round 1, which ends by token K + 1
FIRST_ROUND = Window(K + 2, (1, 2, 3, 4))  # round 1's slots 0..K


@pytest.fixture(scope="module")
def small_pair():
    return small_models()


def spec(budget: int = FULL, kind: str = "uniform", anytime: bool = False, **kw) -> SpeculationConfig:
    """Each path isolated: builds run to their budget (no anytime cut) and the
    cache holds only what the draft built (no free n-gram entries), unless a
    path asks for them."""
    kw.setdefault("ngram_candidates", False)
    kw.setdefault("prompt_lookup", PromptLookupConfig(max_tokens=0))  # plain steps stay one token
    return SpeculationConfig(mode="ssd", k=K, fanout=FanoutConfig(kind=kind, budget=budget, anytime=anytime), **kw)


def run(ssd, prompt, sampling, generation, on_tokens=None):
    """The one call to generate in this file."""
    return ssd.generate(GenerationRequest(prompt, sampling, generation, on_tokens=on_tokens))


@dataclass
class Draws:
    samples: list[tuple[int, ...]]  # tokens at the window's positions, one tuple per seed
    hits: int
    lookups: int
    ngram_hits: int
    tested_from_round_1: int  # tested tokens that round 1 (never a cache hit) produced
    slots: Counter  # slot of each tested token in its round -> count

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.lookups)

    def add(self, out, rounds: list[list[int]], positions: tuple[int, ...], last_early_round: int = 1) -> None:
        """One generation: its tokens at `positions`, its cache counts, and where each
        tested token came from (rounds up to `last_early_round` count as early)."""
        self.samples.append(tuple(out.token_ids[i] for i in positions))
        self.hits += out.stats.spec.hits
        self.ngram_hits += out.stats.spec.ngram_hits
        self.lookups += out.stats.spec.lookups
        origin = [(r, slot) for r, tokens in enumerate(rounds) for slot in range(len(tokens))]
        for position in positions:
            round_index, slot = origin[position]
            self.tested_from_round_1 += round_index <= last_early_round
            self.slots[slot] += 1


# The seeds of a draw run as rows of one batch, ROWS at a time (the rows share
# each step's forwards and the draft's one exchange: about twice as fast as
# one request at a time). Every row owns its streams (its seed's target
# generator, the draft's per-row stream), so a row draws exactly what it
# would alone: the first ALONE seeds of every draw, broken ones included, run
# again one at a time and must give the same tokens.
ROWS = 16
ALONE = 12


def draw(
    pair, spec_config: SpeculationConfig, sampling: SamplingConfig, window: Window, samples: int = SAMPLES,
    prompt: tuple[int, ...] = tuple(PROMPT),
) -> Draws:
    target, draft = pair
    prompt = list(prompt)
    generation = GenerationConfig(max_new_tokens=window.n_tokens)
    draws = Draws([], 0, 0, 0, 0, Counter())
    rounds: list[list[list[int]]] = [[] for _ in range(samples)]  # per seed: the prefill's token, then each round's
    requests = [GenerationRequest(prompt, dataclasses.replace(sampling, seed=seed), generation,
                                  on_tokens=rounds[seed].append) for seed in range(samples)]
    with SSDEngine.in_process(target, draft, TinyTokenizer(V), spec_config, BatchingConfig(max_rows=ROWS)) as ssd:
        outs = run_rows(ssd, requests)
        for seed in range(min(ALONE, samples)):
            alone = run(ssd, prompt, requests[seed].sampling, generation)
            assert alone.token_ids == outs[seed].token_ids, f"seed {seed}: a row drew other tokens than alone"
    for out, seed_rounds in zip(outs, rounds):
        draws.add(out, seed_rounds, window.positions)
    return draws


_EXACT: dict[tuple, dict] = {}


def exact(pair, sampling: SamplingConfig, window: Window, prompt: tuple[int, ...] = tuple(PROMPT)) -> dict:
    """The target's exact law at the window, cached: its 4^7 prefixes take about a second."""
    key = (id(pair[0]), dataclasses.astuple(sampling), window, prompt)
    if key not in _EXACT:
        _EXACT[key] = exact_marginal(pair[0], list(prompt), window.n_tokens, sampling, list(window.positions))
    return _EXACT[key]


def pvalue(pair, draws: Draws, sampling: SamplingConfig, window: Window, row: tuple[str, str, str],
           prompt: tuple[int, ...] = tuple(PROMPT)) -> float:
    """The chi-square p-value, reported as a (path, setting, variant) row of the table."""
    p = chi_square_pvalue(draws.samples, exact(pair, sampling, window, prompt))
    report_pvalue(*row, len(draws.samples), p)
    return p


def assert_slots_reached(draws: Draws, deepest: int) -> None:
    """Slots 0..deepest each hold >= 5 % of the tested tokens."""
    total = sum(draws.slots.values())
    shares = {slot: round(draws.slots[slot] / total, 3) for slot in range(K + 1)}
    assert all(shares[slot] >= 0.05 for slot in range(deepest + 1)), f"slot shares {shares}"


@pytest.fixture
def always_miss(monkeypatch):
    """A speculator whose cache never holds anything: every round uses the backup."""
    monkeypatch.setattr(speculator_module, "build_caches", lambda jobs: [{} for _ in jobs])


# --- broken paths: each breaks one path alone -------------------------------------------

Break = Callable[[pytest.MonkeyPatch], None]


def flat(q: torch.Tensor) -> torch.Tensor:
    """Uniform over q's support (same support: no drafted token becomes impossible)."""
    support = (q > 0).to(q.dtype)
    return support / support.sum(dim=-1, keepdim=True)


def reversed_ranks(q: torch.Tensor) -> torch.Tensor:
    """q's probabilities dealt out in reverse order of rank within its support:
    the likeliest token gets the smallest mass (same support)."""
    values, order = q.sort(dim=-1, descending=True)  # support first, zeros last
    rank = torch.arange(q.shape[-1]).expand_as(q)
    size = (q > 0).sum(dim=-1, keepdim=True)
    source = torch.where(rank < size, size - 1 - rank, rank)
    return torch.zeros_like(q).scatter(-1, order, values.gather(-1, source))


def break_cache(monkeypatch, drawn_from) -> None:
    """Cache path only: every cached speculation ships the plain q of each step,
    but its tokens are drawn from drawn_from(q, step, saguaro) (step 0: depth 1;
    drawing q there, under Saguaro too, stays exact). The backups and the
    verifier are untouched."""
    real_build, real_sample_ids = speculator_module.build_caches, builder_module.sample_ids
    pending: list[torch.Tensor] = []  # what the builder's next draw really samples from

    class ShipsPlainQ:  # stands in for the builder's Saguaro: q' is never shipped
        def __init__(self, saguaro):
            self.saguaro = saguaro

        def apply_rows(self, q, step):
            pending.append(drawn_from(q, step, self.saguaro))
            return q

    def build_caches(jobs):
        for job in jobs:
            job.saguaro = ShipsPlainQ(job.saguaro)
        return real_build(jobs)

    def sample_ids(q, gen):  # a step's rows may come in groups (branches that joined late: one position behind)
        drawn = torch.cat(pending)
        pending.clear()
        assert drawn.shape == q.shape
        return real_sample_ids(drawn, gen)

    monkeypatch.setattr(speculator_module, "build_caches", build_caches)
    monkeypatch.setattr(builder_module, "sample_ids", sample_ids)


def cache_draws_reversed(monkeypatch) -> None:
    """Cached tokens at depth >= 2 drawn with q's ranks reversed, shipped with q."""
    break_cache(monkeypatch, lambda q, step, saguaro: q if step == 0 else reversed_ranks(q))


def cache_draws_reversed_at_every_depth(monkeypatch) -> None:
    """Cached tokens at every depth drawn with q's ranks reversed, shipped with q."""
    break_cache(monkeypatch, lambda q, step, saguaro: reversed_ranks(q))


def cache_ships_q_not_q_prime(monkeypatch) -> None:
    """Cached tokens drawn from Saguaro's q' but shipped with the plain q."""
    break_cache(monkeypatch, lambda q, step, saguaro: saguaro.apply_rows(q, step))


def neural_draws_flat(monkeypatch) -> None:
    """Neural backup: drafts at depth >= 2 drawn uniformly over q's support, shipped with q."""
    real_chain, real_sample = backups_module.drafted_chain, drafting_module.sample
    depth = [0]

    def drafted_chain(*args, **kwargs):
        depth[0] = 0
        return real_chain(*args, **kwargs)

    def sample(q, gen):  # the chain's only draw: one per drafted token
        depth[0] += 1
        return real_sample(q if depth[0] == 1 else flat(q), gen)

    monkeypatch.setattr(backups_module, "drafted_chain", drafted_chain)
    monkeypatch.setattr(drafting_module, "sample", sample)


def ngram_ships_uniform_q(monkeypatch) -> None:
    """n-gram backup: uniform q rows shipped instead of its one-hot rows."""
    real_propose = backups_module.NgramBackup.propose

    def propose(self, *args, **kwargs):
        out = real_propose(self, *args, **kwargs)
        out.q.fill_(1.0 / V)
        return out

    monkeypatch.setattr(backups_module.NgramBackup, "propose", propose)


def random_repeats_first(monkeypatch) -> None:
    """Random backup: depth >= 2 repeats the first token, still shipped with uniform q."""
    real_propose = backups_module.RandomBackup.propose

    def propose(self, *args, **kwargs):
        out = real_propose(self, *args, **kwargs)
        out.tokens[1:] = [out.tokens[0]] * (len(out.tokens) - 1)
        return out

    monkeypatch.setattr(backups_module.RandomBackup, "propose", propose)


@dataclass(frozen=True)
class Case:
    spec: SpeculationConfig
    sampling: SamplingConfig
    deepest: int  # slots 0..deepest must be reached
    broken: Break  # breaks this path alone; the same test must then fail
    broken_samples: int = SAMPLES  # seeds for the broken run: fewer only make detection harder


# --- cache hits ---------------------------------------------------------------------------

HIT_CASES = {  # T = 0.6, T = 1 (fold and reuse glue), top-k 2, top-p 0.8, min-p 0.2
    "t0.6": Case(spec(), CASES["t0.6"], K, cache_draws_reversed, STRONG_SAMPLES),
    "t1.0": Case(spec(), CASES["t1.0"], K, cache_draws_reversed, STRONG_SAMPLES),
    # the glue that feeds s_K alone before branching (the default folds it into the first step)
    "t1.0 reuse": Case(spec(glue="reuse"), CASES["t1.0"], K, cache_draws_reversed, STRONG_SAMPLES),
    "top_k": Case(spec(), CASES["top_k"], K, cache_draws_reversed),
    # top-p rows keep one or two tokens: a deep-only break is too rare to see
    "top_p": Case(spec(), CASES["top_p"], K, cache_draws_reversed_at_every_depth),
    # min-p rows keep one or two tokens as well: 400 seeds saw the break only at p ~ 1e-3
    "min_p": Case(spec(), CASES["min_p"], K, cache_draws_reversed_at_every_depth, 3 * SAMPLES),
}


def hit_draws(pair, case: Case, samples: int = SAMPLES) -> Draws:
    draws = draw(pair, case.spec, case.sampling, LATE, samples)
    assert draws.lookups > 0 and draws.hits == draws.lookups  # every round after the first hit
    assert draws.tested_from_round_1 == 0  # so every tested token comes from a hit round
    return draws


@pytest.mark.parametrize("name", HIT_CASES)
def test_cache_hit_path_matches_target(small_pair, name):
    case = HIT_CASES[name]
    draws = hit_draws(small_pair, case)
    assert_slots_reached(draws, case.deepest)
    p = pvalue(small_pair, draws, case.sampling, LATE, ("cache hit", name, "exact"))
    assert p > ALPHA, f"cache hits at {name}: p = {p:.2e}"


@pytest.mark.parametrize("name", HIT_CASES)
def test_cache_hit_test_rejects_a_broken_cache(small_pair, monkeypatch, name):
    case = HIT_CASES[name]
    case.broken(monkeypatch)
    draws = hit_draws(small_pair, case, case.broken_samples)
    p = pvalue(small_pair, draws, case.sampling, LATE, ("cache hit", name, case.broken.__name__))
    assert p < ALPHA, f"{case.broken.__name__} went undetected at {name}: p = {p:.2e}"


# --- backups ------------------------------------------------------------------------------

BACKUP_CASES = {
    "neural": Case(spec(backup="neural"), T1, K, neural_draws_flat),
    "ngram": Case(spec(backup="ngram"), T1, 1, ngram_ships_uniform_q, STRONG_SAMPLES),
    "random": Case(spec(backup="random"), T1, 2, random_repeats_first),
}


def backup_draws(pair, case: Case, samples: int = SAMPLES) -> Draws:
    draws = draw(pair, case.spec, case.sampling, FIRST_ROUND, samples)
    assert draws.lookups > 0 and draws.hits == 0  # every round a backup round
    return draws


@pytest.mark.parametrize("name", BACKUP_CASES)
def test_backup_path_matches_target(small_pair, always_miss, name):
    case = BACKUP_CASES[name]
    draws = backup_draws(small_pair, case)
    assert_slots_reached(draws, case.deepest)
    p = pvalue(small_pair, draws, case.sampling, FIRST_ROUND, (f"{name} backup", "t1.0", "exact"))
    assert p > ALPHA, f"{name} backup: p = {p:.2e}"


@pytest.mark.parametrize("name", BACKUP_CASES)
def test_backup_test_rejects_a_broken_backup(small_pair, always_miss, monkeypatch, name):
    case = BACKUP_CASES[name]
    case.broken(monkeypatch)
    draws = backup_draws(small_pair, case, case.broken_samples)
    p = pvalue(small_pair, draws, case.sampling, FIRST_ROUND, (f"{name} backup", "t1.0", case.broken.__name__))
    assert p < ALPHA, f"{case.broken.__name__} went undetected: p = {p:.2e}"


def test_backup_test_rejects_a_broken_backup_while_the_cache_works(small_pair, monkeypatch):
    case = BACKUP_CASES["neural"]
    case.broken(monkeypatch)
    draws = draw(small_pair, spec(backup="neural"), case.sampling, FIRST_ROUND)
    assert draws.lookups > 0 and draws.hits == draws.lookups  # the cache served every lookup
    row = ("neural backup, cache working", "t1.0", case.broken.__name__)
    p = pvalue(small_pair, draws, case.sampling, FIRST_ROUND, row)
    assert p < ALPHA, f"a broken backup next to a working cache went undetected: p = {p:.2e}"


# --- Saguaro ------------------------------------------------------------------------------

SAGUARO_CASES = {
    "c0.5": Case(spec(saguaro_c=0.5, budget=K + 1), T1, K, cache_draws_reversed),
    "c0.1": Case(spec(saguaro_c=0.1, budget=2 * (K + 1), kind="geometric"), T1, K, cache_ships_q_not_q_prime),
    "c0": Case(spec(saguaro_c=0.0, budget=K + 1), T1, 1, cache_ships_q_not_q_prime, STRONG_SAMPLES),
}


def saguaro_draws(pair, case: Case, samples: int = SAMPLES) -> Draws:
    draws = draw(pair, case.spec, case.sampling, LATE, samples)
    assert 0 < draws.hit_rate < 1  # both paths ran, interleaved
    assert draws.tested_from_round_1 == 0
    return draws


@pytest.mark.parametrize("name", SAGUARO_CASES)
def test_saguaro_matches_target(small_pair, name):
    case = SAGUARO_CASES[name]
    draws = saguaro_draws(small_pair, case)
    assert_slots_reached(draws, case.deepest)
    p = pvalue(small_pair, draws, case.sampling, LATE, (f"saguaro {name}", "t1.0", "exact"))
    assert p > ALPHA, f"Saguaro {name}: p = {p:.2e}"


@pytest.mark.parametrize("name", SAGUARO_CASES)
def test_saguaro_test_rejects_a_broken_cache(small_pair, monkeypatch, name):
    case = SAGUARO_CASES[name]
    case.broken(monkeypatch)
    draws = saguaro_draws(small_pair, case, case.broken_samples)
    p = pvalue(small_pair, draws, case.sampling, LATE, (f"saguaro {name}", "t1.0", case.broken.__name__))
    assert p < ALPHA, f"{case.broken.__name__} went undetected at Saguaro {name}: p = {p:.2e}"


# --- anytime builds and free n-gram candidates -------------------------------------------
# An anytime build that the outcome cut short answers from shorter branches:
# forced here at the same step of every build (before its third branch step:
# early branches hold 2 tokens, the bonus ones that joined at step 1 hold 1),
# with every outcome prepared, so every round after the first is a hit on a cut
# entry. Free n-gram entries: budget 1, so the draft prepares one outcome per
# round and the text's own predictions fill others (asserted: they serve
# hits); misses run the neural backup.

CUT_AT = 2


def cut_every_build(monkeypatch) -> None:
    """Every build stops before branch step CUT_AT, as if the outcome arrived then."""
    class CutAtOnce(speculator_module._Cut):  # first asked before step MIN_CUT_STEPS == CUT_AT
        def __call__(self) -> bool:
            self.fired = True
            return True

    assert builder_module.MIN_CUT_STEPS == CUT_AT
    monkeypatch.setattr(speculator_module, "_Cut", CutAtOnce)
    monkeypatch.setattr(speculator_module.AnytimeBudget, "observe", lambda *a, **kw: None)  # keep every outcome


def candidates_ship_smoothed_q(monkeypatch) -> None:
    """Free n-gram entries: q rows smoothed (0.1 on the proposed token, the rest
    spread over the others) instead of one-hot: not the law the tokens came from,
    so verification accepts them almost always. (A q of 0 at the proposed token
    is refused by verification itself.)"""
    real = speculator_module.ngram_candidates

    def ngram_candidates(*args, **kwargs):
        entries = real(*args, **kwargs)
        for entry in entries.values():
            entry.q.copy_(entry.q * 0.1 + (1 - entry.q) * (0.9 / (V - 1)))
        return entries

    monkeypatch.setattr(speculator_module, "ngram_candidates", ngram_candidates)


def anytime_draws(pair, monkeypatch, samples: int = SAMPLES) -> Draws:
    cut_every_build(monkeypatch)
    draws = draw(pair, spec(anytime=True), T1, LATE, samples)
    assert draws.lookups > 0 and draws.hits == draws.lookups and draws.tested_from_round_1 == 0
    assert max(draws.slots) == CUT_AT  # no round verified more than the cut's CUT_AT tokens
    return draws


# The target's favourite token, over and over: the text predicts what the target
# likes, so n-gram entries hit and their drafts are often accepted.
REPETITIVE = (1,) * 8


def candidate_draws(pair, samples: int = SAMPLES) -> Draws:
    draws = draw(pair, spec(budget=1, ngram_candidates=True), T1, LATE, samples, prompt=REPETITIVE)
    assert draws.ngram_hits > 0.05 * draws.lookups and draws.tested_from_round_1 == 0
    return draws


def test_a_cut_anytime_build_keeps_the_target_law(small_pair, monkeypatch):
    draws = anytime_draws(small_pair, monkeypatch)
    assert_slots_reached(draws, CUT_AT)
    p = pvalue(small_pair, draws, T1, LATE, ("anytime build, cut at step 2", "t1.0", "exact"))
    assert p > ALPHA, f"cut builds: p = {p:.2e}"


def test_the_anytime_test_rejects_a_broken_cache(small_pair, monkeypatch):
    cache_draws_reversed(monkeypatch)
    draws = anytime_draws(small_pair, monkeypatch)  # depth 2 only (the cut keeps no deeper): all the seeds
    p = pvalue(small_pair, draws, T1, LATE, ("anytime build, cut at step 2", "t1.0", "cache_draws_reversed"))
    assert p < ALPHA, f"a broken cut cache went undetected: p = {p:.2e}"


def test_free_ngram_candidates_keep_the_target_law(small_pair):
    draws = candidate_draws(small_pair)
    print(f"n-gram entries served {draws.ngram_hits} of {draws.lookups} lookups")
    p = pvalue(small_pair, draws, T1, LATE, ("free n-gram entries", "t1.0", "exact"), REPETITIVE)
    assert p > ALPHA, f"n-gram entries: p = {p:.2e}"


def test_the_candidates_test_rejects_smoothed_q_rows(small_pair, monkeypatch):
    candidates_ship_smoothed_q(monkeypatch)
    draws = candidate_draws(small_pair)
    p = pvalue(small_pair, draws, T1, LATE, ("free n-gram entries", "t1.0", "candidates_ship_smoothed_q"),
               REPETITIVE)
    assert p < ALPHA, f"n-gram entries with smoothed q rows went undetected: p = {p:.2e}"


# --- a draft link adopted mid-request (a healed draft) -----------------------------------

ADOPTED = Window(9, (6, 7, 8))  # past the adoption round, which spans tokens 2..K + 2


def adoption_draws(pair, sampling: SamplingConfig, broken: bool = False, samples: int = SAMPLES) -> Draws:
    """Each request starts without a link and runs alone for one round; the
    link arrives after token 1 (as a healed draft's does) and is adopted at the
    next round, which prefills the speculator with the sequence so far.
    broken: once adopted, verification accepts every draft (the test must see it)."""
    from ssd.saguaro.speculator import Speculator
    from ssd.transport import inprocess_pair
    from ssd.verify import verify
    from tests.test_distribution import accept_all

    target, draft = pair
    adopted = [False]

    def verifier(*args, **kwargs):
        return (accept_all if broken and adopted[0] else verify)(*args, **kwargs)

    engine = SSDEngine(target, TinyTokenizer(V), spec(), verifier=verifier)
    target_end, draft_end = inprocess_pair()
    speculator = threading.Thread(target=Speculator(draft, draft_end).serve, daemon=True)
    speculator.start()
    draws = Draws([], 0, 0, 0, 0, Counter())
    for seed in range(samples):
        rounds: list[list[int]] = []

        def attach_after_token_1(tokens: list[int]) -> None:
            rounds.append(tokens)
            if len(rounds) == 2:  # the prefill's token, then one round alone
                engine.attach(target_end)
                adopted[0] = True

        engine.channel, adopted[0] = None, False  # as a lost link leaves it
        out = run(engine, PROMPT, dataclasses.replace(sampling, seed=seed),
                  GenerationConfig(max_new_tokens=ADOPTED.n_tokens), attach_after_token_1)
        assert out.stats.spec.degraded_rounds == 1 and out.stats.spec.lookups > 0, out.stats.summary()
        draws.add(out, rounds, ADOPTED.positions, last_early_round=2)  # early: before or in the adoption round
    engine.stop_draft()
    speculator.join(timeout=10)
    return draws


@pytest.mark.parametrize("name", ["t0.6", "t1.0"])
def test_a_link_adopted_mid_request_keeps_the_target_law(small_pair, name):
    draws = adoption_draws(small_pair, CASES[name])
    assert draws.tested_from_round_1 == 0 and draws.hits == draws.lookups  # tested tokens: hit rounds after adoption
    assert_slots_reached(draws, K)
    p = pvalue(small_pair, draws, CASES[name], ADOPTED, ("adopted link", name, "exact"))
    assert p > ALPHA, f"after a mid-request adoption at {name}: p = {p:.2e}"


def test_the_adoption_test_rejects_accept_all_after_adoption(small_pair):
    draws = adoption_draws(small_pair, T1, broken=True, samples=STRONG_SAMPLES)
    p = pvalue(small_pair, draws, T1, ADOPTED, ("adopted link", "t1.0", "accept_all_after_adoption"))
    assert p < ALPHA, f"accept-all after adoption went undetected: p = {p:.2e}"


# --- a running row prefilled on the draft again ---------------------------------------------
#
# draft = target (the same fp64 weights), so every draft is accepted and every
# drafted token is the draft's own draw: what its random stream does shows
# straight in the output. Tested: the first drafted token of the row's first
# round (token 1) with the first drafted token of the first round after the
# row was prefilled again; the old draft keyed its stream by the seed alone,
# so a second prefill replayed the first one's uniforms and the two tokens
# agree far more often than the target's law says (`replays_the_first_stream`).

REPREFILL_SAMPLES = 300  # the replayed stream: p = 4e-8 (parked) and 8e-7 (re-linked) at STRONG_SAMPLES


@pytest.fixture
def unrounded_rows(monkeypatch):
    """q rows drawn from and shipped in float64: only then does the draft = target
    accept every draft. In bfloat16 (ssd.sampling.as_drawn) a row is p rounded,
    and about one draft in a thousand is rejected, which these tests' fixed round
    lengths do not allow (the law stays exact either way)."""
    for module in (drafting_module, builder_module):
        monkeypatch.setattr(module, "as_drawn", lambda q: q)


def replays_the_first_stream(monkeypatch) -> None:
    """The old draft: each prefill of a row restarts the stream its first prefill had."""
    real = speculator_module.draft_seed
    monkeypatch.setattr(speculator_module, "draft_seed", lambda seed, epoch=0: real(seed))


def run_rounds(engine, request, rounds: list[list[int]], between: Callable[[], None]) -> object:
    """Step `engine` until `request` finishes; between(): after every step."""
    engine.admit(request)
    while True:
        for finished in engine.step():
            if finished.request is request:
                assert finished.error is None, finished.error
                return finished.result
        between()


def joined_draws(pair, sampling: SamplingConfig, samples: int, k_policy: dict[int, int], window: Window,
                 companion_tokens: int, rounds_first: list[int]) -> Draws:
    """The row alone under `k_policy`; after its second round a second request of
    `companion_tokens` tokens joins (the batch size moves the row's K); each sample's
    first rounds must have the lengths `rounds_first`."""
    target, _ = pair
    draws = Draws([], 0, 0, 0, 0, Counter())
    with SSDEngine.in_process(target, target, TinyTokenizer(V), spec(k_policy=k_policy)) as engine:
        for seed in range(samples):
            rounds: list[list[int]] = []
            request = GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=seed),
                                        GenerationConfig(max_new_tokens=window.n_tokens), on_tokens=rounds.append)
            joined = []

            def join_after_round_1() -> None:
                if len(rounds) == 2 and not joined:
                    joined.append(GenerationRequest([3, 2], SamplingConfig(),
                                                    GenerationConfig(max_new_tokens=companion_tokens)))
                    engine.admit(joined[0])

            out = run_rounds(engine, request, rounds, join_after_round_1)
            assert [len(r) for r in rounds[: len(rounds_first)]] == rounds_first, rounds
            draws.add(out, rounds, window.positions, last_early_round=-1)
            while engine.rows:  # the companion leaves before the next sample
                engine.step()
    return draws


def parked_draws(pair, sampling: SamplingConfig, samples: int = REPREFILL_SAMPLES) -> tuple[Draws, Window]:
    """k_policy {2: 0}: once the row has run one speculative round, a second
    request joins for one step (the row is parked: released on the draft, a
    plain target step), leaves, and the row is prefilled on the draft again.
    Rounds: the prefill's token, K + 1 (all accepted), 1 (parked), K + 1, ..."""
    window = Window(2 * K + 4, (1, K + 3))  # round 1's first draft; the first draft after the re-prefill
    # a companion of one token leaves in the step it joins
    return joined_draws(pair, sampling, samples, {2: 0}, window, 1, [1, K + 1, 1, K + 1]), window


def relinked_draws(pair, sampling: SamplingConfig, samples: int = REPREFILL_SAMPLES) -> tuple[Draws, Window]:
    """After the row's first round a new link arrives (a healed draft: a new
    Speculator) and is adopted at the next step, which prefills the row on it.
    Rounds: the prefill's token, K + 1 on the first draft, K + 1 on the second."""
    from ssd.saguaro.speculator import Speculator
    from ssd.transport import inprocess_pair

    target, _ = pair
    window = Window(2 * K + 3, (1, K + 2))
    draws = Draws([], 0, 0, 0, 0, Counter())
    engine = SSDEngine(target, TinyTokenizer(V), spec())
    threads = []

    def new_link():
        target_end, draft_end = inprocess_pair()
        threads.append(threading.Thread(target=Speculator(target, draft_end).serve, daemon=True))
        threads[-1].start()
        return target_end

    for seed in range(samples):
        engine.attach(new_link())
        rounds: list[list[int]] = []
        request = GenerationRequest(PROMPT, dataclasses.replace(sampling, seed=seed),
                                    GenerationConfig(max_new_tokens=window.n_tokens), on_tokens=rounds.append)
        relinked = []

        def relink_after_round_1() -> None:
            if len(rounds) == 2 and not relinked:
                relinked.append(True)
                engine.stop_draft()  # the old speculator stops; the new link is adopted at the next step
                engine.attach(new_link())

        out = run_rounds(engine, request, rounds, relink_after_round_1)
        engine.stop_draft()
        assert [len(r) for r in rounds[:3]] == [1, K + 1, K + 1] and out.stats.spec.degraded_rounds == 0, rounds
        draws.add(out, rounds, window.positions, last_early_round=-1)
    for thread in threads:
        thread.join(timeout=10)
    return draws, window


def late_linked_draws(pair, sampling: SamplingConfig, samples: int = REPREFILL_SAMPLES) -> tuple[Draws, Window]:
    """k_policy {1: 0, 2: K}: the row, admitted alone, is not prefilled on the draft and runs
    plain target steps; a second request joins after its first plain token and the row is
    prefilled on the draft for the first time, mid-request. Rounds: the prefill's token, 1
    (plain), K + 1, ... Read: the plain step's token with the first draft after the link."""
    window = Window(K + 4, (1, 2))
    # the companion stays past the row's window
    return joined_draws(pair, sampling, samples, {1: 0, 2: K}, window, 2 * K + 8, [1, 1, K + 1]), window


REPREFILLS = {"parked": parked_draws, "re-linked": relinked_draws}


@pytest.mark.parametrize("path", [*REPREFILLS, "linked late"])
def test_a_row_prefilled_again_keeps_the_target_law(small_pair, unrounded_rows, path):
    draws, window = {**REPREFILLS, "linked late": late_linked_draws}[path](small_pair, T1)
    p = pvalue(small_pair, draws, T1, window, (f"{path} row, prefilled again", "t1.0", "exact"))
    assert p > ALPHA, f"a {path} row prefilled again: p = {p:.2e}"


@pytest.mark.parametrize("path", REPREFILLS)
def test_the_reprefill_test_rejects_a_replayed_draft_stream(small_pair, unrounded_rows, monkeypatch, path):
    replays_the_first_stream(monkeypatch)
    draws, window = REPREFILLS[path](small_pair, T1, STRONG_SAMPLES)
    p = pvalue(small_pair, draws, T1, window, (f"{path} row, prefilled again", "t1.0", "replays_the_first_stream"))
    assert p < ALPHA, f"a replayed draft stream went undetected ({path}): p = {p:.2e}"


def test_the_late_link_test_rejects_a_draft_stream_shared_with_the_target(small_pair, unrounded_rows, monkeypatch):
    """The row linked late drew its plain step from the target's stream; a draft seeded
    with the request's seed itself replays those uniforms in its first drafts."""
    monkeypatch.setattr(speculator_module, "draft_seed", lambda seed, epoch=0: seed)
    draws, window = late_linked_draws(small_pair, T1, STRONG_SAMPLES)
    p = pvalue(small_pair, draws, T1, window, ("row linked late", "t1.0", "draft_stream_is_the_target_s"))
    assert p < ALPHA, f"a draft stream shared with the target went undetected: p = {p:.2e}"
