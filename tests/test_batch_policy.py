"""The batch-aware policy (pure; runs in milliseconds): every expected value
below is worked out by hand in the comment next to it."""

from __future__ import annotations

import pytest

from ssd.saguaro.batch_policy import (
    BackupProfile,
    SSDProfile,
    backup_policy,
    batch_speedup,
    choose_k,
    critical_batch_size,
    expected_tokens_sd,
    k_by_batch,
    speedup_at,
)
from ssd.config import SpeculationConfig

MS = 1e-3


def test_batch_speedup_by_hand():
    # tokens = 0.8*4 + 0.2*3 = 3.8; b=1: 0.8*1 + 0.2*1.5 = 1.1; b=2: 0.64 + 0.36*1.5 = 1.18
    assert batch_speedup(0.8, 4, 3, t_p=0.5, t_b=0.5, b=1) == pytest.approx(3.8 / 1.1)
    assert batch_speedup(0.8, 4, 3, t_p=0.5, t_b=0.5, b=2) == pytest.approx(3.8 / 1.18)


def test_a_build_slower_than_verification_sets_the_hit_round_time():
    # T_p = 2 > 1: a hit round takes 2. tokens = 0.5*4 + 0.5*2 = 3;
    # b=1: 0.5*2 + 0.5*1.5 = 1.75; b=2: 0.25*2 + 0.75*1.5 = 1.625
    assert batch_speedup(0.5, 4, 2, t_p=2.0, t_b=0.5, b=1) == pytest.approx(3 / 1.75)
    assert batch_speedup(0.5, 4, 2, t_p=2.0, t_b=0.5, b=2) == pytest.approx(3 / 1.625)


@pytest.mark.parametrize("b", [1, 2, 64])
def test_p_one_and_p_zero_do_not_depend_on_the_batch(b):
    # p = 1: E_hit / max(1, T_p) = 5 / 2; p = 0: E_miss / (1 + T_b) = 2 / 2
    assert batch_speedup(1.0, 5, 3, t_p=2.0, t_b=9.0, b=b) == pytest.approx(2.5)
    assert batch_speedup(0.0, 5, 2, t_p=0.5, t_b=1.0, b=b) == pytest.approx(1.0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        batch_speedup(1.5, 4, 3, 0.5, 0.5, 1)
    with pytest.raises(ValueError):
        batch_speedup(0.5, 4, 3, 0.5, 0.5, 0)
    with pytest.raises(ValueError):
        backup_policy(0)


def profile(p: float) -> SSDProfile:
    """verify 10 ms at any batch, build 5 ms: T_p = 0.5, so a hit round takes 1."""
    return SSDProfile(k=4, verify_s=lambda b, t: 10 * MS, build_s=lambda b: 5 * MS, hit_rate=p, e_hit=4.0)


NEURAL = BackupProfile("neural", seconds=lambda b: 2 * MS, e_miss=3.0)  # T_b = 0.2
NGRAM = BackupProfile("ngram", seconds=lambda b: 0.0, e_miss=1.0)  # T_b = 0


def test_speedup_at_expresses_costs_in_verifications():
    # p = 0.95, b = 3: x = 0.857375; neural: 3.95 / (x + (1-x)*1.2) = 3.95 / 1.028525
    assert speedup_at(profile(0.95), NEURAL, 3) == pytest.approx(3.95 / 1.028525)
    assert speedup_at(profile(0.95), NGRAM, 3) == pytest.approx(3.85)  # 3.8 + 0.05 over 1


def test_critical_batch_size_by_hand():
    # p = 0.95: fast = 3.85 at every b; neural = 3.95 / (1.2 - 0.2 x), x = 0.95^b:
    # b=1: 3.95/1.01 = 3.911, b=2: 3.95/1.0195 = 3.874, b=3: 3.95/1.028525 = 3.840 < 3.85
    assert critical_batch_size(profile(0.95), NGRAM, NEURAL, max_batch=64) == 3
    assert critical_batch_size(profile(0.95), NGRAM, NEURAL, max_batch=2) is None


def test_critical_batch_size_edge_cases():
    # p = 1: no row ever misses, both speedups are 4 / 1: b* = 1.
    assert critical_batch_size(profile(1.0), NGRAM, NEURAL, 64) == 1
    # p = 0: every round misses; fast 1/1 = 1 < neural 3/1.2 = 2.5 at every b.
    assert critical_batch_size(profile(0.0), NGRAM, NEURAL, 64) is None
    # A fast backup as costly as the neural one and worse never wins.
    no_faster = BackupProfile("ngram", seconds=lambda b: 2 * MS, e_miss=1.0)
    assert critical_batch_size(profile(0.9), no_faster, NEURAL, 256) is None
    # A free backup as good as the neural one wins from the start.
    as_good = BackupProfile("ngram", seconds=lambda b: 0.0, e_miss=3.0)
    assert critical_batch_size(profile(0.9), as_good, NEURAL, 8) == 1


def test_backup_policy_from_b_star_drives_backup_for():
    assert backup_policy(None) == {1: "neural"}
    assert backup_policy(1) == {1: "ngram"}
    policy = backup_policy(3, fast="random")
    assert policy == {1: "neural", 3: "random"}
    spec = SpeculationConfig(mode="ssd", backup="ngram", backup_policy=policy)
    assert [spec.backup_for(b) for b in (1, 2, 3, 64)] == ["neural", "neural", "random", "random"]


def test_expected_tokens_sd():
    assert expected_tokens_sd(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)  # 3.3616
    assert expected_tokens_sd(1.0, 4) == 5.0
    assert expected_tokens_sd(0.0, 3) == 1.0
    assert expected_tokens_sd(0.5, 0) == 1.0


def verify_ms(b: int, tokens: int) -> float:
    """1 ms of weights read once per forward, plus 0.01 ms per token scored."""
    return (1.0 + 0.01 * b * tokens) * MS


def draft_ms(b: int, k: int) -> float:
    return 0.1 * k * MS


def test_choose_k_speculates_when_memory_bound_and_stops_when_compute_bound():
    # b=1, a=0.8: tokens/cost per K: 0: 1/1.01, 1: 1.8/1.12, 2: 2.44/1.23, 3: 2.952/1.34, 4: 3.3616/1.45 -> K=4
    assert choose_k(verify_ms, draft_ms, 0.8, b=1, k_max=4) == 4
    # b=100: verify = 1 + t: 0: 1/2 = .5, 1: 1.8/3.1 = .5806, 2: 2.44/4.2 = .5810, 3: 2.952/5.3 = .557 -> K=2
    assert choose_k(verify_ms, draft_ms, 0.8, b=100, k_max=4) == 2
    # b=1000: verify = 1 + 10 t: 0: 1/11 = .0909, 1: 1.8/21.1 = .0853 -> AR
    assert choose_k(verify_ms, draft_ms, 0.8, b=1000, k_max=4) == 0
    assert k_by_batch(verify_ms, draft_ms, 0.8, [1, 100, 1000], 4) == {1: 4, 100: 2, 1000: 0}


def test_choose_k_edge_cases():
    assert choose_k(verify_ms, draft_ms, 0.0, b=1, k_max=8) == 0  # nothing is ever accepted
    free = lambda b, t: 1.0  # noqa: E731 - verification costs the same for any length
    assert choose_k(free, lambda b, k: 0.0, 1.0, b=1, k_max=8) == 8  # all accepted, drafting free
    assert choose_k(free, lambda b, k: 0.0, 0.0, b=1, k_max=8) == 0  # a tie: the least work
    assert choose_k(verify_ms, draft_ms, 0.8, b=1, k_max=0) == 0
