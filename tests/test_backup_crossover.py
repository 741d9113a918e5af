"""The backup crossover study on a tiny pair: measured rows, the prediction, the plot."""

from __future__ import annotations

import dataclasses

import pytest

from ssd.tools.ablation.backup_crossover import CrossoverPoint, format_crossover, measure_crossover, predict
from ssd.tools.ablation.plots import plot_backup_crossover
from ssd.config import SamplingConfig, load_config
from ssd.factory import LoadedPair
from ssd.engine.metrics import GenerationStats, SpecStats
from tests.conftest import ROOT


def test_both_backups_at_each_batch_size(tiny_models, tiny_tokenizer, tmp_path):
    config = load_config(ROOT / "configs" / "tiny.yaml")
    config = dataclasses.replace(config, sampling=SamplingConfig(temperature=1.0, seed=3))
    pair = LoadedPair(*tiny_models, tiny_tokenizer)
    points = measure_crossover(pair, config, [[1, 2, 3], [5, 6], [7]], ["neural", "ngram"], [1, 2, 4], 16)
    assert [(p.backup, p.batch) for p in points] == [(b, n) for b in ("neural", "ngram") for n in (1, 2, 4)]
    assert all(p.tokens == 16 * p.batch and p.throughput > 0 for p in points)
    assert all(p.stats.spec.backups.keys() <= {p.backup} for p in points)  # each run used its own backup
    assert all(p.stats.requests == p.batch for p in points)
    prediction = predict(points, k=config.speculation.k)  # its arithmetic: the test below
    assert set(prediction.speedups) == {"neural", "ngram"} and all(len(v) == 3 for v in prediction.speedups.values())
    assert f"predicted b* = {prediction.b_star}" in format_crossover(points, prediction)
    assert plot_backup_crossover(points, prediction, tmp_path / "crossover.png").stat().st_size > 1000


def point(backup: str, batch: int, tok_s: float, e_miss: float, backup_per_miss: float) -> CrossoverPoint:
    """100 rounds at p = 0.5, E_hit = 3, 1 s per verification, free builds."""
    spec = SpecStats(lookups=100, hits=50, rounds_after_hit=50, tokens_after_hit=150, rounds_after_miss=50,
                     tokens_after_miss=round(50 * e_miss), backup_s=50 * backup_per_miss)
    stats = GenerationStats(mode="ssd", k=2, rounds=100, target_s=100.0, spec=spec)
    return CrossoverPoint(backup, batch, round(tok_s * 10), 10.0, stats)


def test_b_star_is_where_the_cheap_backup_catches_up():
    """A fast backup (free, E_miss 0.8) against a neural one (0.3 s per miss,
    E_miss 2): at p = 0.5 the neural one's speedup is 2.17, 1.92, 1.72, 1.56
    at b = 1..4 (its misses cost more as rows miss together) and the fast
    one's 1.9 throughout, so b* = 3: unmeasured, between the measured 2 and 4."""
    sizes, tok_s = (1, 2, 4), {"neural": (10, 10, 10), "ngram": (8, 9, 11)}
    points = [point("neural", b, tok_s["neural"][i], 2.0, 0.3) for i, b in enumerate(sizes)]
    points += [point("ngram", b, tok_s["ngram"][i], 0.8, 0.0) for i, b in enumerate(sizes)]
    prediction = predict(points, k=2)
    assert prediction.b_star == 3
    assert prediction.measured_crossover == 4
    assert prediction.speedups["neural"] == pytest.approx({1: 2.5 / 1.15, 2: 2.5 / 1.3, 4: 2.5 / 1.6})
    assert prediction.speedups["ngram"] == pytest.approx({1: 1.9, 2: 1.9, 4: 1.9})
