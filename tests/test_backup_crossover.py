"""The backup crossover study on a tiny pair: measured rows, the prediction, the plot."""

from __future__ import annotations

import dataclasses

from ssd.ablation.backup_crossover import format_crossover, measure_crossover, predict
from ssd.ablation.plots import plot_backup_crossover
from ssd.config import SamplingConfig, load_config
from ssd.engine.factory import LoadedPair
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
    prediction = predict(points, k=config.speculation.k)
    # b* is searched at every batch size up to the largest, unmeasured ones (3) included
    from ssd.ablation.backup_crossover import _interpolated
    assert _interpolated({2: 1.0, 4: 3.0})(3) == 2.0
    assert set(prediction.speedups) == {"neural", "ngram"} and all(len(v) == 3 for v in prediction.speedups.values())
    assert prediction.b_star is None or 1 <= prediction.b_star <= 4
    assert "predicted b* =" in format_crossover(points, prediction)
    assert plot_backup_crossover(points, prediction, tmp_path / "crossover.png").stat().st_size > 1000
