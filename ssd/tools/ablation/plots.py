"""PNG figures of the ablations (matplotlib, Agg: no display needed).

(a) hit rate against acceptance as Saguaro C varies (a T > 0 trace);
(b) miss rate against fan-out on log-log axes, with the fitted power law;
(c) geometric against uniform hit rate across budgets.
Each `plot_*` takes rows the studies in ssd.tools.ablation.replay return, so the
numbers in a figure are the numbers in the tables. Figures are drawn on
their own Agg canvas, never through pyplot: no global backend or figure state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from ssd.tools.ablation.replay import (
    MissPoint, PowerLawFit, ReplayData, c_tradeoff, compare_kinds, fit_power_law, miss_vs_fanout,
)
from ssd.config import SpeculationConfig

log = logging.getLogger(__name__)


def plot_c_tradeoff(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = _figure()
    acc, hit = [r["acceptance_rate"] for r in rows], [r["hit_rate"] for r in rows]
    ax.plot(acc, hit, "o-")
    for r in rows:
        ax.annotate(f"C={r['c']:g}", (r["acceptance_rate"], r["hit_rate"]), textcoords="offset points", xytext=(4, 4))
    first = rows[0]
    ax.set(xlabel="acceptance rate", ylabel="cache hit rate",
           title=f"Saguaro C trade-off ({first['kind']}, K={first['k']}, B={first['budget']}, T={first['temperature']:g})")
    return _save(fig, path)


def plot_miss_vs_fanout(points: Sequence[MissPoint], fit: PowerLawFit | None, path: Path) -> Path:
    fig, ax = _figure()
    shown = [p for p in points if p.miss_rate > 0]
    ax.loglog([p.fanout for p in shown], [p.miss_rate for p in shown], "o", label="replayed")
    if fit is not None:
        fs = [p.fanout for p in points]
        ax.loglog(fs, [fit.miss(f) for f in fs], "-", label=f"{fit.c:.2f} F^-{fit.r:.2f}")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    top = max(p.fanout for p in points)
    ax.set_xticks([f for f in (1, 2, 4, 8, 16, 32, 64, 128) if f <= top])  # every F would overlap
    ax.set(xlabel="fan-out F (same at every k)", ylabel="cache miss rate", title="miss rate vs fan-out")
    ax.legend()
    return _save(fig, path)


def plot_kinds(rows: Sequence[dict], path: Path) -> Path:
    fig, ax = _figure()
    for kind in ("uniform", "geometric"):
        mine = sorted((r["budget"], r["hit_rate"]) for r in rows if r["kind"] == kind)
        ax.plot([b for b, _ in mine], [h for _, h in mine], "o-", label=kind)
    ax.set(xlabel="budget B (branches per round)", ylabel="cache hit rate",
           title=f"geometric vs uniform fan-out (K={rows[0]['k']})")
    ax.legend()
    return _save(fig, path)


def write_all(
    data: ReplayData, spec: SpeculationConfig, out_dir: Path, budgets: Sequence[int],
    cs: Sequence[float], max_fanout: int, samples: int = 1, seed: int = 0,
) -> list[Path]:
    """The three figures for `spec`'s K (and kind/budget for (a)); (a) only for T > 0 traces."""
    out_dir = Path(out_dir)
    paths = []
    if data.greedy:
        log.info("greedy trace: skipping the Saguaro C figure (C has no effect at T = 0)")
    else:
        paths.append(plot_c_tradeoff(c_tradeoff(data, spec, cs, samples, seed), out_dir / "c_tradeoff.png"))
    points = miss_vs_fanout(data, spec.k, max_fanout, spec, samples, seed)
    try:
        fit = fit_power_law([p.fanout for p in points], [p.miss_rate for p in points])
    except ValueError as exc:
        log.warning("no power-law fit: %s", exc)
        fit = None
    paths.append(plot_miss_vs_fanout(points, fit, out_dir / "miss_vs_fanout.png"))
    rows = compare_kinds(data, spec.k, budgets, spec.saguaro_c, spec, samples, seed)
    paths.append(plot_kinds(rows, out_dir / "fanout_kinds.png"))
    return paths


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(5, 4))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_backup_crossover(points: Sequence, prediction, path: Path) -> Path:
    """Neural versus fast backup by batch size: measured tokens/s (left) and the
    batch formula's predicted speedup (right), with b* and the measured crossover."""
    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    measured, predicted = fig.subplots(1, 2)
    for backup in sorted({p.backup for p in points}):
        mine = sorted((p for p in points if p.backup == backup), key=lambda p: p.batch)
        measured.plot([p.batch for p in mine], [p.throughput for p in mine], "o-", label=backup)
        curve = prediction.speedups.get(backup, {})
        predicted.plot(list(curve), list(curve.values()), "o--", label=backup)
    if prediction.measured_crossover is not None:
        measured.axvline(prediction.measured_crossover, color="grey", ls=":", label="measured crossover")
    if prediction.b_star is not None:
        predicted.axvline(prediction.b_star, color="grey", ls=":", label=f"b* = {prediction.b_star}")
    measured.set(xlabel="batch size", ylabel="tokens/s (all rows)", title="measured")
    predicted.set(xlabel="batch size", ylabel="speedup (tokens per verification time)", title="batch formula")
    for ax in (measured, predicted):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.legend()
    return _save(fig, path)
