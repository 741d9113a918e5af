"""One-knob-at-a-time tables around a base configuration.

Three tables, each varying one thing and holding the rest at `spec`:
fan-out kind x budget, K, and Saguaro C (T > 0 traces only). With costs,
every row also gets its modelled tokens/s and speedups (ssd.tools.ablation.speed).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from ssd.saguaro.costs import Costs
from ssd.tools.ablation.planner import sd_baseline
from ssd.tools.ablation.replay import ReplayData, replay, ssd_spec
from ssd.tools.ablation.speed import ssd_speed
from ssd.config import SpeculationConfig


@dataclasses.dataclass
class SweepGrid:
    ks: Sequence[int]
    budgets: Sequence[int]
    cs: Sequence[float]

    def size(self, greedy: bool) -> int:
        return 2 * len(self.budgets) + len(self.ks) + (0 if greedy else len(self.cs))


def sweep_tables(
    data: ReplayData, spec: SpeculationConfig, grid: SweepGrid, costs: Costs | None = None,
    samples: int = 1, seed: int = 0, progress: Callable[[], None] | None = None,
) -> dict[str, list[dict]]:
    """{"fanout_budget": rows, "k": rows, "c": rows}; progress is called once per replay."""
    tick = progress or (lambda: None)
    sd = sd_baseline(data, costs, sorted(set(grid.ks) | {spec.k}), samples, seed) if costs else None

    def row(s: SpeculationConfig) -> dict:
        res = replay(data, s, samples=samples, seed=seed)
        out = res.as_dict()
        if costs is not None:
            speed = ssd_speed(res, costs)
            out.update(tokens_per_s=speed.tokens_per_s, speedup_vs_ar=speed.speedup_vs_ar,
                       speedup_vs_sd=speed.tokens_per_s / sd.speed.tokens_per_s)
        tick()
        return out

    tables = {
        "fanout_budget": [
            row(ssd_spec(kind, spec.k, b, spec.saguaro_c, spec))
            for kind in ("uniform", "geometric") for b in grid.budgets
        ],
        "k": [row(ssd_spec(spec.fanout.kind, k, spec.fanout.budget, spec.saguaro_c, spec)) for k in grid.ks],
        "c": [] if data.greedy else [
            row(ssd_spec(spec.fanout.kind, spec.k, spec.fanout.budget, c, spec)) for c in grid.cs
        ],
    }
    if sd is not None:
        tables["sd_best"] = [{"k": sd.k, "tokens_per_round": sd.tokens_per_round,
                              "tokens_per_s": sd.speed.tokens_per_s, "speedup_vs_ar": sd.speed.speedup_vs_ar}]
    return tables
