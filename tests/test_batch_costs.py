"""Batch cost tables, the K policy drawn from them, and the acceptance estimate."""

from __future__ import annotations

import pytest

from ssd.ablation.batch_costs import BatchCosts, acceptance_rate, measure_batch_costs
from ssd.engine.metrics import GenerationStats


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


def test_measured_on_a_tiny_pair(tiny_models):
    target, draft = tiny_models
    costs = measure_batch_costs(target, draft, [1, 2], k_max=2, prefix=8, repeats=1)
    assert set(costs.verify) == {(b, n) for b in (1, 2) for n in (1, 2, 3)}
    assert set(costs.draft) == {(b, k) for b in (1, 2) for k in (1, 2)}
    assert all(s > 0 for s in [*costs.verify.values(), *costs.draft.values()])
    assert "| 2 |" in costs.table()


def test_the_policy_from_measured_throughput_takes_the_fastest_k():
    from ssd.ablation.batch_costs import best_k_policy

    rates = {(1, 0): 5.0, (1, 4): 9.0, (2, 0): 9.0, (2, 4): 12.0, (8, 0): 22.0, (8, 4): 18.0, (16, 0): 30.0, (16, 4): 30.0}
    assert best_k_policy(rates) == {1: 4, 8: 0}  # a tie goes to the smaller K


def test_k_throughput_is_measured_on_the_batched_engine(tiny_models, tiny_tokenizer):
    from ssd.ablation.batch_costs import measure_k_throughput
    from ssd.config import BatchingConfig, SamplingConfig
    from ssd.engine.factory import LoadedPair

    pair = LoadedPair(*tiny_models, tiny_tokenizer)
    rates = measure_k_throughput(pair, [[1, 2, 3], [5]], [1, 2], [0, 3], 8, SamplingConfig(), BatchingConfig())
    assert set(rates) == {(1, 0), (1, 3), (2, 0), (2, 3)} and all(r > 0 for r in rates.values())
