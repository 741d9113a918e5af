"""Fan-out schedules and the online estimators (pure; runs in milliseconds)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd.saguaro.fanout import (
    AcceptanceEstimator,
    FanoutPlanner,
    PowerLawEstimator,
    acceptance_lengths_pmf,
    allocate,
    expected_hit_rate,
    geometric_fanout,
    share_budget,
    uniform_fanout,
)

FAST = settings(max_examples=100, deadline=None)

a_st = st.floats(0.0, 1.0)
r_st = st.floats(0.0, 50.0)
k_st = st.integers(0, 12)
budget_st = st.integers(0, 300)


def closed_form(a: float, r: float, big_k: int, budget: int) -> list[float]:
    """B * P(k)^(1/(1+r)) / sum_j P(j)^(1/(1+r)), written out independently."""
    pmf = [(1 - a) * a**i for i in range(big_k)] + [a**big_k]
    w = [p ** (1 / (1 + r)) for p in pmf]
    return [budget * x / sum(w) for x in w]


def water_filled(weights: list[float], total: int, caps: list[int]) -> list[float]:
    """Oracle for capped proportional shares: min(cap, lam * w) summing to total.

    Found by bisection on lam, an independent route to what allocate() must
    approximate (assumes some positive weight can absorb the total).
    """
    weights = [w / max(weights) for w in weights]  # no overflow of lam for tiny weights
    lo, hi = 0.0, 1.0
    while sum(min(c, hi * w) for w, c in zip(weights, caps)) < total:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(min(c, mid * w) for w, c in zip(weights, caps)) < total:
            lo = mid
        else:
            hi = mid
    return [min(c, hi * w) for w, c in zip(weights, caps)]


# --- acceptance law ---------------------------------------------------------


@given(a_st, k_st)
@FAST
def test_pmf_sums_to_one(a, big_k):
    pmf = acceptance_lengths_pmf(a, big_k)
    assert len(pmf) == big_k + 1
    assert math.isclose(sum(pmf), 1.0, abs_tol=1e-12)
    assert all(p >= 0 for p in pmf)


def test_pmf_edges():
    assert acceptance_lengths_pmf(0.0, 3) == [1.0, 0.0, 0.0, 0.0]
    assert acceptance_lengths_pmf(1.0, 3) == [0.0, 0.0, 0.0, 1.0]
    assert acceptance_lengths_pmf(0.5, 0) == [1.0]
    assert acceptance_lengths_pmf(0.5, 2) == pytest.approx([0.5, 0.25, 0.25])


# --- allocate -----------------------------------------------------------------


@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=20), budget_st)
@FAST
def test_allocate_spends_budget_and_tracks_shares(weights, budget):
    out = allocate(weights, budget)
    assert sum(out) == budget
    assert all(isinstance(f, int) and f >= 0 for f in out)
    if sum(weights) > 0:
        for f, w in zip(out, weights):
            assert abs(f - budget * w / sum(weights)) < 1
            if w == 0:
                assert f == 0


@given(
    st.lists(
        st.tuples(st.one_of(st.just(0.0), st.floats(1e-6, 100.0)), st.integers(0, 30)),
        min_size=1,
        max_size=12,
    ),
    budget_st,
)
@FAST
def test_allocate_caps_respected_and_redistributed(pairs, budget):
    weights = [w for w, _ in pairs]
    caps = [c for _, c in pairs]
    out = allocate(weights, budget, caps)
    total = min(budget, sum(caps))
    assert sum(out) == total
    assert all(0 <= f <= c for f, c in zip(out, caps))
    room = sum(c for w, c in zip(weights, caps) if w > 0)
    if total == 0:
        assert out == [0] * len(caps)
    elif total <= room:
        # Positive weights can absorb everything: zero weights get nothing and
        # the rest is within rounding of the water-filled shares.
        for f, q, w in zip(out, water_filled(weights, total, caps), weights):
            assert abs(f - q) < 1 + 1e-9
            if w == 0:
                assert f == 0
    else:
        # Budget forces spill: every positive-weight position is full.
        assert all(f == c for f, c, w in zip(out, caps, weights) if w > 0)


def test_allocate_redistribution_by_hand():
    # Position 0 wants 5 but holds 2; the 3 it cannot take split 1:1.
    assert allocate([4, 2, 2], 10, caps=[2, 10, 10]) == [2, 4, 4]
    # The spill follows weights 3:1.
    assert allocate([4, 3, 1], 8, caps=[0, 10, 10]) == [0, 6, 2]
    # A cascade: after position 0 is capped, position 1 overflows too.
    assert allocate([10, 5, 1], 12, caps=[2, 3, 100]) == [2, 3, 7]
    # Budget above sum(caps) spends sum(caps).
    assert allocate([1, 1], 50, caps=[3, 4]) == [3, 4]


def test_allocate_zero_weights():
    assert allocate([1, 0, 1], 5) == [3, 0, 2]
    # Positive positions full: the rest is spread evenly over zero weights.
    assert allocate([1, 0, 0, 1], 7, caps=[1, 10, 10, 1]) == [1, 3, 2, 1]
    assert allocate([0, 0, 0], 5) == [2, 2, 1]
    assert allocate([0.0], 0) == [0]


def test_allocate_ties_go_to_lower_k():
    assert allocate([1, 1, 1, 1], 6) == [2, 2, 1, 1]
    assert allocate([1, 1], 1) == [1, 0]
    assert allocate([1, 2, 1], 3) == [1, 1, 1]  # shares .75, 1.5, .75: largest remainders
    assert allocate([1, 2, 1], 2) == [1, 1, 0]  # shares .5, 1, .5: the tie goes to k=0


@pytest.mark.parametrize(
    "weights, budget, caps",
    [
        ([], 3, None),
        ([1, -1], 3, None),
        ([1, float("nan")], 3, None),
        ([1, float("inf")], 3, None),
        ([1, 1], -1, None),
        ([1, 1], 2.5, None),
        ([1, 1], True, None),
        ([1, 1], 3, [1]),
        ([1, 1], 3, [1, -2]),
        ([1, 1], 3, [1, 1.5]),
    ],
)
def test_allocate_rejects_bad_input(weights, budget, caps):
    with pytest.raises(ValueError):
        allocate(weights, budget, caps)


# --- schedules ----------------------------------------------------------------


def test_uniform_default_and_evenness():
    assert uniform_fanout(7, 24) == [3] * 8
    assert uniform_fanout(3, 10) == [3, 3, 2, 2]
    assert uniform_fanout(3, 10, caps=[1, 5, 5, 5]) == [1, 3, 3, 3]


@given(a_st, r_st, k_st, budget_st)
@FAST
def test_geometric_spends_budget(a, r, big_k, budget):
    out = geometric_fanout(a, r, big_k, budget)
    assert len(out) == big_k + 1
    assert sum(out) == budget


@given(st.floats(0.0, 0.999), r_st, st.integers(1, 12), budget_st)
@FAST
def test_geometric_monotone_below_k_and_close_to_closed_form(a, r, big_k, budget):
    out = geometric_fanout(a, r, big_k, budget)
    assert all(out[i] >= out[i + 1] for i in range(big_k - 1))
    for f, x in zip(out, closed_form(a, r, big_k, budget)):
        assert abs(f - x) < 1 + 1e-9


@pytest.mark.parametrize(
    "a, r, big_k, budget", [(0.8, 1.0, 7, 24), (0.6, 0.5, 4, 16), (0.9, 2.0, 3, 8)]
)
def test_geometric_matches_closed_form(a, r, big_k, budget):
    out = geometric_fanout(a, r, big_k, budget)
    assert sum(out) == budget
    for f, x in zip(out, closed_form(a, r, big_k, budget)):
        assert abs(f - x) < 1


def test_last_position_can_exceed_previous():
    # a^K is the whole tail: P = (.1, .09, .081, .729) at a = 0.9, K = 3.
    out = geometric_fanout(0.9, 1.0, 3, 16)
    x = closed_form(0.9, 1.0, 3, 16)
    assert x[3] > x[2] and out[3] > out[2]
    assert geometric_fanout(0.8, 1.0, 7, 24) == [4, 3, 3, 3, 3, 2, 2, 4]


def test_geometric_with_caps():
    out = geometric_fanout(0.9, 0.0, 3, 16, caps=[8, 8, 8, 5])
    assert sum(out) == 16 and out[3] == 5
    assert all(f <= c for f, c in zip(out, [8, 8, 8, 5]))


@pytest.mark.parametrize("a, big_k, budget", [(0.8, 7, 24), (0.6, 4, 17), (0.95, 3, 9)])
def test_large_r_approaches_uniform(a, big_k, budget):
    assert geometric_fanout(a, math.inf, big_k, budget) == uniform_fanout(big_k, budget)
    even = budget / (big_k + 1)
    assert all(abs(f - even) < 1 for f in geometric_fanout(a, 1e4, big_k, budget))


@pytest.mark.parametrize("a, big_k, budget", [(0.8, 7, 24), (0.6, 4, 17), (0.95, 3, 9)])
def test_zero_r_is_proportional_to_pmf(a, big_k, budget):
    pmf = acceptance_lengths_pmf(a, big_k)
    assert geometric_fanout(a, 0.0, big_k, budget) == allocate(pmf, budget)
    near_zero = geometric_fanout(a, 1e-6, big_k, budget)
    assert all(abs(f - budget * p) < 1 for f, p in zip(near_zero, pmf))


def test_geometric_beats_uniform():
    geo = geometric_fanout(0.8, 1.0, 7, 24)
    uni = uniform_fanout(7, 24)
    assert expected_hit_rate(geo, 0.8, 1.0) > expected_hit_rate(uni, 0.8, 1.0)


def test_expected_hit_rate():
    assert expected_hit_rate([3] * 8, 0.8, 1.0) == pytest.approx(2 / 3)
    assert expected_hit_rate([0, 0], 0.5, 1.0) == 0.0
    # c large enough: every position misses; F = 1 with c = 1 always misses.
    assert expected_hit_rate([1, 1, 1], 0.5, 2.0) == 0.0
    assert expected_hit_rate([2, 0], 0.0, 1.0, c=0.5) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        expected_hit_rate([], 0.5, 1.0)
    with pytest.raises(ValueError):
        expected_hit_rate([1, -1], 0.5, 1.0)


@pytest.mark.parametrize("a, r", [(1.5, 1.0), (-0.1, 1.0), (0.5, -1.0), (0.5, float("nan"))])
def test_geometric_rejects_bad_params(a, r):
    with pytest.raises(ValueError):
        geometric_fanout(a, r, 3, 8)


# --- estimators ----------------------------------------------------------------


def draw_accepted(rng: random.Random, a: float, big_k: int) -> int:
    k = 0
    while k < big_k and rng.random() < a:
        k += 1
    return k


def test_acceptance_estimator_prior_then_converges():
    est = AcceptanceEstimator(prior_a=0.7)
    assert est.a == pytest.approx(0.7)
    assert AcceptanceEstimator(prior_a=0.4, prior_weight=0).a == pytest.approx(0.4)
    rng = random.Random(1234)
    for _ in range(20_000):
        est.update(draw_accepted(rng, 0.83, 7), 7)
    assert abs(est.a - 0.83) < 0.02
    assert est.rounds == 20_000


def test_acceptance_estimator_counts():
    est = AcceptanceEstimator(prior_a=0.5, prior_weight=0)
    est.update(2, 4)  # two successes, one failure
    est.update(4, 4)  # four successes, capped: no failure
    assert est.a == pytest.approx(6 / 7)
    with pytest.raises(ValueError):
        est.update(5, 4)
    with pytest.raises(ValueError):
        est.update(-1, 4)


def test_power_law_estimator_prior_until_two_usable_f():
    est = PowerLawEstimator(prior_r=1.5)
    assert est.r == 1.5 and not est.fitted
    for hit in (True, False, True):
        est.update(3, hit)
    est.update(5, True)  # F = 5 has no misses yet: not usable
    assert est.r == 1.5 and not est.fitted
    with pytest.raises(ValueError):
        est.update(0, False)


@pytest.mark.parametrize("r_true, c_true", [(0.8, 0.7), (1.5, 0.9), (0.4, 0.5)])
def test_power_law_estimator_converges(r_true, c_true):
    rng = random.Random(99)
    est = PowerLawEstimator()
    for _ in range(2_000):
        for f in range(1, 9):
            est.update(f, rng.random() >= c_true * f**-r_true)
    assert est.fitted
    assert abs(est.r - r_true) < 0.15 * r_true
    assert abs(est.c - c_true) < 0.15 * c_true


def test_power_law_estimator_clamps():
    est = PowerLawEstimator(r_min=0.05, r_max=20.0)
    # Misses rising with F: slope positive -> r would be negative -> clamped.
    for f, misses in ((1, 1), (2, 5)):
        for i in range(10):
            est.update(f, hit=i >= misses)
    assert est.r == 0.05


# --- planner --------------------------------------------------------------------


def test_planner_keeps_hit_and_miss_schedules_separate():
    big_k, budget = 4, 16
    p = FanoutPlanner("geometric", big_k, budget, refresh_every=10)
    assert p.schedule(True) == p.schedule(False)  # same priors
    for _ in range(100):
        p.observe(True, big_k, 3, None)  # after hits everything is accepted
        p.observe(False, 0, 3, None)  # after misses nothing is
    assert p.a(True) > 0.95 and p.a(False) < 0.05
    hit_s, miss_s = p.schedule(True), p.schedule(False)
    assert sum(hit_s) == sum(miss_s) == budget
    assert hit_s[big_k] > miss_s[big_k] and miss_s[0] > hit_s[0]


def test_planner_refreshes_every_n_observations():
    p = FanoutPlanner("geometric", 3, 12, refresh_every=8)
    before = p.schedule(True)
    for _ in range(7):
        p.observe(True, 3, 3, True)
    assert p.schedule(True) == before and p.refreshes == 0
    p.observe(True, 3, 3, True)
    assert p.refreshes == 1
    after = p.schedule(True)
    assert after != before and after[3] > before[3]
    assert p.schedule(False) == before  # no miss-round data: prior unchanged


def test_planner_learns_r_from_hits():
    rng = random.Random(7)
    p = FanoutPlanner("geometric", 3, 12, refresh_every=50)
    assert p.r == pytest.approx(1.0)
    for _ in range(2_000):
        for f in range(1, 9):
            p.observe(True, 2, f, rng.random() >= 0.8 * f**-2.0)
    assert abs(p.r - 2.0) < 0.3
    for _ in range(10):
        p.observe(False, 1, 0, False)  # F = 0: a certain miss, no evidence on r
        p.observe(False, 1, 4, None)
    assert abs(p.r - 2.0) < 0.3


def test_uniform_planner_ignores_estimates():
    p = FanoutPlanner("uniform", 7, 24, refresh_every=4)
    for _ in range(40):
        p.observe(True, 7, 3, True)
        p.observe(False, 0, 3, False)
    assert p.refreshes == 20
    assert p.schedule(True) == p.schedule(False) == [3] * 8
    assert p.a(True) > p.a(False)


def test_planner_schedule_is_a_copy_and_caps_hold():
    p = FanoutPlanner("geometric", 3, 20, caps=[4, 4, 4, 4])
    s = p.schedule(True)
    s[0] = 99
    assert p.schedule(True) == [4, 4, 4, 4]


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("beam", 3, 8), {}),
        (("uniform", -1, 8), {}),
        (("uniform", 3, -8), {}),
        (("uniform", 3, 8), {"refresh_every": 0}),
        (("uniform", 3, 8), {"caps": [1, 2]}),
    ],
)
def test_planner_rejects_bad_config(args, kwargs):
    with pytest.raises(ValueError):
        FanoutPlanner(*args, **kwargs)


def test_planner_rejects_bad_observation():
    p = FanoutPlanner("geometric", 3, 8)
    with pytest.raises(ValueError):
        p.observe(True, 4, 1, True)  # k > K
    with pytest.raises(ValueError):
        p.observe(True, 1, 0, True)  # a hit with nothing cached


# ---------------------------------------------------------------------------
# A batch's shared branch cap


def test_share_budget_by_hand():
    assert share_budget([8, 8, 8], None) == [8, 8, 8]
    assert share_budget([8, 8, 8], 30) == [8, 8, 8]  # under the cap: untouched
    assert share_budget([8, 8, 8], 12) == [4, 4, 4]  # 1 each + 9 split 3/3/3
    assert share_budget([8, 4], 7) == [5, 2]  # 1 each + 5 split 3.5/1.5, the tie to the lower index
    assert share_budget([0, 8], 4) == [0, 4]  # a row asking for nothing gets nothing
    assert share_budget([8, 8, 8], 2) == [1, 1, 1]  # below one per row: one per row


@FAST
@given(st.lists(st.integers(0, 64), min_size=1, max_size=12), st.integers(1, 800))
def test_share_budget_caps_the_total_and_keeps_one_per_row(budgets, cap):
    shares = share_budget(budgets, cap)
    assert all(min(1, b) <= s <= b for s, b in zip(shares, budgets))
    if cap >= sum(min(1, b) for b in budgets):
        assert sum(shares) == min(cap, sum(budgets))


@pytest.mark.parametrize("kind", ["uniform", "geometric"])
def test_a_scaled_schedule_keeps_the_planners_shape(kind):
    planner = FanoutPlanner(kind, 4, 16, caps=[15] * 4 + [16], prior_a=0.6, prior_r=0.5)
    for h in (True, False):
        assert planner.schedule(h, budget=16) == planner.schedule(h)
        grown = planner.schedule(h, budget=24)  # an anytime build grown past the plan: same shape, more branches
        assert sum(grown) == 24 and grown == allocate(planner._weights[h], 24, planner.caps)
        assert sum(planner.schedule(h, budget=99)) == 4 * 15 + 16  # no more than the caps
    want = uniform_fanout(4, 6) if kind == "uniform" else geometric_fanout(0.6, 0.5, 4, 6)
    assert planner.schedule(True, budget=6) == want and sum(want) == 6
