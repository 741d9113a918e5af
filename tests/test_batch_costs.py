"""Batch cost tables, the K policy drawn from them, and the acceptance estimate."""

from __future__ import annotations

import pytest

import ssd.tools.ablation.batch_costs as batch_costs_module
import ssd.saguaro.costs as costs_module
from ssd.tools.ablation.batch_costs import BatchCosts, acceptance_rate, measure_batch_costs
from ssd.engine.metrics import GenerationStats
from tests.spies import WorkClock


def test_acceptance_is_accepted_over_reached():
    stats = GenerationStats(mode="sd")
    stats.rounds, stats.accepted_at = 4, [3, 2, 1]  # reached: 4 rounds, then 3, then 2
    assert acceptance_rate(stats) == pytest.approx(6 / 9)


def test_unmeasured_batch_sizes_interpolate_and_extrapolate():
    costs = BatchCosts(verify={(1, 1): 1.0, (4, 1): 2.5, (8, 1): 4.5}, draft={(1, 2): 0.5})
    assert costs.verify_s(2, 1) == pytest.approx(1.5) and costs.verify_s(16, 1) == pytest.approx(8.5)
    assert costs.draft_s(3, 2) == pytest.approx(1.5) and costs.draft_s(3, 0) == 0.0


def test_the_policy_turns_speculation_off_where_verification_is_compute_bound():
    """Verification of K + 1 tokens costs as one token at b = 1 (memory bound) and
    (K + 1) times one token at b = 8: speculate alone, stop at 8."""
    verify = {(b, n): (1.0 if b == 1 else float(n)) for b in (1, 8) for n in (1, 2, 3)}
    draft = {(b, k): 0.1 * k for b in (1, 8) for k in (1, 2)}
    policy = BatchCosts(verify, draft).k_policy(acceptance=0.8, batch_sizes=[1, 8], k_max=2)
    assert policy == {1: 2, 8: 0}


def test_measured_on_a_tiny_pair(tiny_models, monkeypatch):
    """On a clock that counts tokens (target 1, draft 100 each), verify(b, n)
    is exactly one forward of n tokens for each of b rows and draft(b, k)
    exactly k draft steps for each of b rows."""
    target, draft = tiny_models
    with WorkClock({target: 1, draft: 100}) as clock:
        clock.install(monkeypatch, costs_module)  # the probes are timed by costs.round_robin
        costs = measure_batch_costs(target, draft, [1, 2], k_max=2, prefix=8, repeats=1)
    assert costs.verify == {(b, n): b * n for b in (1, 2) for n in (1, 2, 3)}
    assert costs.draft == {(b, k): 100 * b * k for b in (1, 2) for k in (1, 2)}
    assert "| 2 |" in costs.table()


def test_the_policy_from_measured_throughput_takes_the_fastest_k():
    from ssd.tools.ablation.batch_costs import best_k_policy

    rates = {(1, 0): 5.0, (1, 4): 9.0, (2, 0): 9.0, (2, 4): 12.0, (8, 0): 22.0, (8, 4): 18.0, (16, 0): 30.0, (16, 4): 30.0}
    assert best_k_policy(rates) == {1: 4, 8: 0}  # a tie goes to the smaller K


def test_k_throughput_is_measured_on_the_batched_engine(tiny_models, tiny_tokenizer, monkeypatch):
    """On a clock that ticks once per target forward: every row's tokens are
    counted (rate x forwards = b rows x 8 tokens), the b rows run together
    (at K = 0 two rows take the forwards one row takes), and K reaches the
    engine (K = 0 drafts nothing; K = 3 drafts and needs fewer target forwards)."""
    from ssd.tools.ablation.batch_costs import measure_k_throughput
    from ssd.config import BatchingConfig, SamplingConfig
    from ssd.factory import LoadedPair

    target, draft = tiny_models
    pair = LoadedPair(target, draft, tiny_tokenizer)
    with WorkClock({target: 1, draft: 0}, per_call=True) as clock:  # time = target forwards
        clock.install(monkeypatch, batch_costs_module)
        runs = [(0, 0)]  # (target forwards, draft forwards) at the start and after each (b, k) run
        tick = lambda: runs.append((clock.calls[target], clock.calls[draft]))  # noqa: E731
        rates = measure_k_throughput(pair, [[1, 2, 3], [5]], [1, 2], [0, 3], 8, SamplingConfig(), BatchingConfig(),
                                     tick)
    used = {key: (t1 - t0, d1 - d0) for key, (t0, d0), (t1, d1) in zip(rates, runs, runs[1:])}
    assert {key: rate * used[key][0] for key, rate in rates.items()} == {
        (b, k): b * 8 for b in (1, 2) for k in (0, 3)
    }
    assert used[(1, 0)][0] == used[(2, 0)][0]  # together: one forward serves both rows
    for b in (1, 2):  # K = 0: the draft at most prefills, never drafts; K = 3 drafts every round
        assert used[(b, 0)][1] <= 1 and used[(b, 3)][1] >= used[(b, 3)][0]
    assert used[(1, 3)][0] < used[(1, 0)][0]  # drafts accepted: fewer target forwards for the same tokens

