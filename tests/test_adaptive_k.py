"""K follows the measured round (ssd.saguaro.adaptive_k) and SSD stays exact while K moves.

The controller alone (milliseconds): it moves towards the K with the most
tokens per second, within [1, max_k], and not for gains under its margin.
The protocol carries K to the draft (draft_k), which refuses a K outside its
room. Exactness with K forced to vary: a stub controller cycling K through
1..4 round by round (every row, every round: the draft's cache keyed by
(k, t*) then holds speculations of another length than the one verified
before), greedy SSD == AR on the 16-token tiny pair, and the chi-square of
test_ssd_distribution (tokens 5-7 of 8, T = 0.6) on the 4-token pair, with
the draft's vocabulary subset, anytime builds and free n-gram entries on
too (the one sampled test of them all together). Power,
same seeds: a K chosen after seeing the target's p (the drafts its argmax
agrees with, then a draw from p: `k_from_the_targets_choices`) must fail.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import ssd.saguaro.target as target_module
from ssd.config import ConfigError, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine
from ssd.engine.request import GenerationRequest
from ssd.sampling import sample
from ssd.saguaro import protocol
from ssd.saguaro.adaptive_k import KController, expected_tokens
from ssd.saguaro.speculator import requested_k
from ssd.saguaro.target import SSDEngine
from ssd.verify import Outcome, verify
from tests import test_ssd_distribution as ssd_dist
from tests.test_vocab_subset import small_subset_pair
from tests.stats import ALPHA

GREEDY = SamplingConfig(temperature=0.0)
CYCLE = (1, 2, 3, 4)
T06 = ssd_dist.CASES["t0.6"]


# --- the controller -----------------------------------------------------------------------


def feed(control: KController, rounds: int, a: float, seconds) -> None:
    """`rounds` rounds at the controller's K: each draft accepted with probability
    a until the first rejection (seeded), each round taking seconds(K)."""
    rng = random.Random(0)
    for _ in range(rounds):
        k = control.next_k()
        accepted = next((i for i in range(k) if rng.random() >= a), k)
        control.observe(k, accepted, seconds(k))


def test_cheap_extra_tokens_and_high_acceptance_raise_k_to_its_ceiling():
    control = KController(k=1, max_k=5)
    feed(control, 200, 1.0, lambda k: 1.0 + 0.05 * k)
    assert control.k == 5


def test_low_acceptance_lowers_k_to_one():
    control = KController(k=4, max_k=8)
    feed(control, 200, 0.0, lambda k: 1.0 + 0.3 * k)
    assert control.k == 1


def test_expensive_tokens_settle_between_the_extremes():
    # a = 0.75 and each drafted token a third of a round: the best K is 2 or 3.
    control = KController(k=1, max_k=8)
    feed(control, 400, 0.75, lambda k: 1.0 + k / 3)
    best = max(range(1, 9), key=lambda k: expected_tokens(control.a, k) / (1 + k / 3))
    assert abs(control.k - best) <= 1 and 1 < control.k < 8


def test_a_gain_under_the_margin_does_not_move_k():
    control = KController(k=2, max_k=4, margin=0.5)
    feed(control, 100, 1.0, lambda k: 1.0 + 0.05 * k)
    assert control.k == 2


def test_controller_refuses_a_k_outside_its_range_and_ignores_empty_rounds():
    with pytest.raises(ValueError):
        KController(k=5, max_k=4)
    control = KController(k=2, max_k=4)
    control.observe(0, 0, 1.0)
    assert control.a == KController(k=2, max_k=4).a


def test_config_ceiling_and_validation():
    assert SpeculationConfig(k=3).k_ceiling == 3
    assert SpeculationConfig(k=3, adaptive_k=True, max_k=6).k_ceiling == 6
    assert SpeculationConfig(k=5, adaptive_k=True, max_k=2).k_ceiling == 5
    with pytest.raises(ConfigError, match="max_k"):
        SpeculationConfig(max_k=0)


def test_rounds_carry_k_and_the_draft_checks_it():
    row = protocol.RoundRow(3, 1, 7, 4)
    assert protocol.parse_rounds(protocol.rounds([row])) == [row]
    spec = SpeculationConfig(k=2, adaptive_k=True, max_k=4)
    assert requested_k(protocol.RoundRow(0, 0, 0, None), spec) == 2
    assert requested_k(row, spec) == 4
    with pytest.raises(ValueError, match="draft_k 5"):
        requested_k(protocol.RoundRow(0, 0, 0, 5), spec)


# --- exactness with K forced to vary --------------------------------------------------------


class Cycling:
    """A stub controller: each call to next_k gives the next K of CYCLE."""

    def __init__(self, k: int, max_k: int) -> None:
        self._ks = itertools.cycle(CYCLE)
        self.observed: list[int] = []

    def next_k(self) -> int:
        return next(self._ks)

    def observe(self, drafted: int, accepted: int, round_s: float) -> None:
        self.observed.append(drafted)


@pytest.fixture
def cycling_k(monkeypatch):
    monkeypatch.setattr(target_module, "KController", Cycling)


def varying(spec: SpeculationConfig) -> SpeculationConfig:
    return SpeculationConfig(**{**spec.__dict__, "adaptive_k": True, "max_k": max(CYCLE)})


@pytest.mark.parametrize("controller", ["cycling", "measured"])
def test_greedy_ssd_with_k_moving_equals_ar(tiny_models, tiny_tokenizer, monkeypatch, controller):
    if controller == "cycling":
        monkeypatch.setattr(target_module, "KController", Cycling)
    target, draft = tiny_models
    spec = SpeculationConfig(mode="ssd", k=2, adaptive_k=True, max_k=4)
    if controller == "cycling":  # static builds: which lengths are verified then does not depend on timing
        spec = dataclasses.replace(spec, fanout=FanoutConfig(anytime=False), ngram_candidates=False)
    with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
        for prompt in ([1, 2, 3], [7, 7, 7, 7, 0, 1, 9, 12, 15]):
            request = GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40))
            ar = AREngine(target, tiny_tokenizer).generate(request)
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == ar.token_ids
        if controller == "cycling":
            assert set(ssd.k_control.observed) >= set(CYCLE), "K did not take every value"


def k_from_the_targets_choices(drafted, q, p, gen, greedy=False):
    """A K chosen after seeing the target's p: the drafts its argmax agrees with
    are kept (K = their number, no ratio test), then a token drawn from p."""
    best = p.argmax(dim=-1).tolist()
    k = next((i for i, x in enumerate(drafted) if x != best[i]), len(drafted))
    return Outcome(k, sample(p[k], gen))


def cycling_draws(pair, samples: int, verifier=verify, **spec) -> ssd_dist.Draws:
    class Engine(SSDEngine):
        @classmethod
        def in_process(cls, *args, **kwargs):
            engine = super().in_process(*args, **kwargs)
            engine.verifier = verifier
            return engine

    # A row's K sequence depends on the rows beside it (one controller for the
    # batch), so a row alone draws other tokens: no alone-vs-batch check (ALONE = 0).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ssd_dist, "SSDEngine", Engine)
        patch.setattr(ssd_dist, "ALONE", 0)
        draws = ssd_dist.draw(pair, varying(ssd_dist.spec(**spec)), T06, ssd_dist.LATE, samples)
    # round 1 (no cache) ends by token 5 when it drafts 4: most tested tokens still come from hit rounds
    assert draws.lookups > 0 and draws.hits > 0.5 * draws.lookups and draws.tested_from_round_1 < 0.1 * 3 * samples
    return draws


def test_sampled_ssd_with_k_moving_a_vocabulary_subset_and_anytime_ngram_builds_matches_the_target(
    cycling_k, monkeypatch,
):
    """Everything at once: K cycling, the draft's head over {0, 2, 3}
    (test_vocab_subset), anytime builds (every one cut at step 2, as the
    outcome would cut it: test_ssd_distribution's `cut_every_build`, so the
    run does not depend on timing) and free n-gram entries."""
    ssd_dist.cut_every_build(monkeypatch)
    pair = small_subset_pair()
    draws = cycling_draws(pair, ssd_dist.STRONG_SAMPLES, anytime=True, ngram_candidates=True)
    assert set(draws.slots) >= {0, 1, 2}  # a cut build's speculations have 2 tokens; a miss's backup up to 4
    p = ssd_dist.pvalue(pair, draws, T06, ssd_dist.LATE, ("K cycling 1..4, subset, anytime, n-gram", "t0.6", "exact"))
    assert p > ALPHA


def test_the_moving_k_test_rejects_a_k_chosen_from_the_outcome(small_pair, cycling_k):
    draws = cycling_draws(small_pair, ssd_dist.STRONG_SAMPLES, k_from_the_targets_choices)
    p = ssd_dist.pvalue(small_pair, draws, T06, ssd_dist.LATE, ("K cycling 1..4", "t0.6", "k_from_the_targets_choices"))
    assert p < ALPHA


@pytest.fixture(scope="module")
def small_pair():
    return ssd_dist.small_models()
