"""Neural versus fast backup across batch sizes, measured live, with the
critical batch size b* the batch formula predicts (ssd.saguaro.batch_policy).

For each backup and batch size b, b requests run together through batched
SSD (the speculator in a thread, the target verifying every row in one
packed forward) to the end; tokens/s counts every row's tokens over the
wall time. The same runs give the formula's inputs, per row and round:
- p: hits / lookups; E_hit, E_miss: tokens per round after a hit / a miss;
- verify(b): the target's time per round (the shared forward and the row's
  own verification);
- T_p(b): the speculator builds the rows' caches one after another, so b
  times one row's build per round;
- T_b(b): the missed rows' backups, also one after another: a row's backup
  time per miss times the misses expected in a round that has any,
  b (1 - p) / (1 - p^b).
p, E_hit, verify and T_p come from the neural runs (the backup does not
change them: hits are served from the cache either way); E_miss and a row's
backup time from each backup's own runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ssd.saguaro.batch_policy import BackupProfile, SSDProfile, critical_batch_size, speedup_at
from ssd.config import Config, GenerationConfig
from ssd.factory import LoadedPair, make_engine
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class CrossoverPoint:
    """One backup at one batch size, as measured."""

    backup: str
    batch: int
    tokens: int
    seconds: float
    stats: GenerationStats  # the rows' stats, pooled

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    @property
    def rounds(self) -> int:
        return max(1, self.stats.rounds)

    def row(self) -> dict:
        spec = self.stats.spec
        return {
            "backup": self.backup, "batch": self.batch, "tok_s": round(self.throughput, 2),
            "hit_rate": round(spec.hit_rate, 3), "e_hit": round(spec.tokens_per_round_after_hit, 2),
            "e_miss": round(spec.tokens_per_round_after_miss, 2),
            "verify_ms": round(1000 * self.stats.target_s / self.rounds, 1),
            "build_ms_per_row": round(1000 * spec.build_s / self.rounds, 1),
            "backup_ms_per_miss": round(1000 * spec.backup_s / max(1, spec.rounds_after_miss), 1),
        }


def measure_crossover(
    pair: LoadedPair, config: Config, prompts: Sequence[list[int]], backups: Sequence[str],
    batch_sizes: Sequence[int], max_new_tokens: int, tick: Callable[[], None] = lambda: None,
) -> list[CrossoverPoint]:
    """Every backup at every batch size (see the module docstring)."""
    points = []
    batching = dataclasses.replace(config.batching, max_rows=max(batch_sizes))
    for backup in backups:
        spec = dataclasses.replace(config.speculation, mode="ssd", backup=backup, backup_policy={})
        engine = make_engine("ssd", pair, spec, batching)
        try:
            _run(engine, prompts[:1], spec, config, 4)  # warm-up
            for b in batch_sizes:
                points.append(_point(engine, backup, b, prompts, spec, config, max_new_tokens))
                log.info("%s", points[-1].row())
                tick()
        finally:
            engine.close()
    return points


def _point(engine, backup: str, b: int, prompts, spec, config: Config, max_new_tokens: int) -> CrossoverPoint:
    rows = [prompts[i % len(prompts)] for i in range(b)]
    started = time.perf_counter()
    results = _run(engine, rows, spec, config, max_new_tokens)
    seconds = time.perf_counter() - started
    return CrossoverPoint(backup, b, sum(len(r.token_ids) for r in results), seconds,
                          total([r.stats for r in results]))


def _run(engine, prompts, spec, config: Config, max_new_tokens: int):
    generation = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.admit(GenerationRequest(prompt, config.sampling, generation, spec))
    results = []
    while engine.rows:
        for finished in engine.step():
            if finished.error is not None:
                raise finished.error
            results.append(finished.result)
    return results


@dataclass
class Prediction:
    b_star: int | None  # the smallest b where the fast backup's speedup reaches the neural one's
    speedups: dict[str, dict[int, float]]  # backup -> batch size -> predicted speedup (verifications)
    measured_crossover: int | None  # the smallest measured b where the fast backup's tokens/s reach neural's


def predict(points: Sequence[CrossoverPoint], k: int, fast: str = "ngram", neural: str = "neural") -> Prediction:
    """The batch formula on the measured inputs, and the measured crossover to set beside it."""
    by = {(p.backup, p.batch): p for p in points}
    sizes = sorted({p.batch for p in points})
    base = total([by[(neural, b)].stats for b in sizes])
    p_hit = base.spec.hit_rate
    verify = _interpolated({b: _per_round(by[(neural, b)], by[(neural, b)].stats.target_s) for b in sizes})
    build = _interpolated({b: b * _per_round(by[(neural, b)], by[(neural, b)].stats.spec.build_s) for b in sizes})
    profile = SSDProfile(k=k, verify_s=lambda b, _n: verify(b), build_s=build, hit_rate=p_hit,
                         e_hit=base.spec.tokens_per_round_after_hit)
    profiles = {kind: _backup_profile(kind, [by[(kind, b)] for b in sizes], p_hit) for kind in (fast, neural)}
    speedups = {kind: {b: speedup_at(profile, prof, b) for b in sizes} for kind, prof in profiles.items()}
    b_star = critical_batch_size(profile, profiles[fast], profiles[neural], max(sizes)) if p_hit < 1 else 1
    measured = next((b for b in sizes if by[(fast, b)].throughput >= by[(neural, b)].throughput), None)
    return Prediction(b_star, speedups, measured)


def _backup_profile(kind: str, points: list[CrossoverPoint], p_hit: float) -> BackupProfile:
    pooled = total([p.stats for p in points]).spec
    per_miss = pooled.backup_s / max(1, pooled.rounds_after_miss)
    e_miss = pooled.tokens_per_round_after_miss

    def seconds(b: int) -> float:
        misses = b * (1 - p_hit) / (1 - p_hit**b) if p_hit < 1 else 0.0
        return per_miss * misses

    return BackupProfile(kind, seconds, e_miss)


def _interpolated(measured: dict[int, float]) -> Callable[[int], float]:
    """Seconds at any batch size in the measured range: linear between measured sizes."""
    sizes = sorted(measured)
    return lambda b: measured[b] if b in measured else float(np.interp(b, sizes, [measured[s] for s in sizes]))


def _per_round(point: CrossoverPoint, seconds: float) -> float:
    return seconds / point.rounds


def format_crossover(points: Sequence[CrossoverPoint], prediction: Prediction) -> str:
    lines = ["| backup | rows | tok/s | hit rate | E_hit | E_miss | verify ms | build ms/row | backup ms/miss | predicted speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        r = p.row()
        predicted = prediction.speedups.get(p.backup, {}).get(p.batch, float("nan"))
        lines.append(f"| {p.backup} | {p.batch} | {r['tok_s']:.2f} | {r['hit_rate']:.3f} | {r['e_hit']:.2f} | "
                     f"{r['e_miss']:.2f} | {r['verify_ms']:.1f} | {r['build_ms_per_row']:.1f} | "
                     f"{r['backup_ms_per_miss']:.1f} | {predicted:.2f} |")
    lines.append(f"\npredicted b* = {prediction.b_star}; measured crossover = {prediction.measured_crossover}")
    return "\n".join(lines)
