"""Choose K, budget B, Saguaro C and fan-out kind for a trace and a machine.

Every candidate is replayed on the trace (ssd.tools.ablation.replay) and priced with
the measured costs (ssd.tools.ablation.speed); candidates are ranked by modelled
tokens/s. C only changes anything at T > 0, so a greedy trace is searched at
C = 1 only. Build costs at unmeasured (K, B) come from the costs' fit (see
ssd.saguaro.costs). The SD baseline is plain speculative decoding at its
own best K over the same K grid, its tokens per round replayed at C = 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ssd.saguaro.costs import Costs
from ssd.tools.ablation.replay import ReplayData, ReplayResult, replay, ssd_spec
from ssd.saguaro.speed import Speed, ar_speed, sd_speed
from ssd.tools.ablation.speed import ssd_speed
from ssd.tools.ablation.trace import load_trace
from ssd.config import SpeculationConfig

DEFAULT_KS = tuple(range(1, 9))
DEFAULT_BUDGETS = (4, 8, 12, 16, 24, 32)
DEFAULT_CS = (0.25, 0.5, 0.75, 1.0)
KINDS = ("uniform", "geometric")


@dataclass(frozen=True)
class Candidate:
    kind: str
    k: int
    budget: int
    c: float


@dataclass
class Evaluation:
    candidate: Candidate
    replay: ReplayResult
    speed: Speed
    speedup_vs_sd: float = 0.0  # against SD at its best K; filled by `recommend`

    def as_dict(self) -> dict:
        return {
            **self.replay.as_dict(), "tokens_per_s": self.speed.tokens_per_s,
            "speedup_vs_ar": self.speed.speedup_vs_ar, "speedup_vs_sd": self.speedup_vs_sd,
            "round_s": self.speed.round_s,
        }


@dataclass
class SDBaseline:
    k: int
    tokens_per_round: float
    speed: Speed


@dataclass
class Plan:
    ranked: list[Evaluation]  # best first
    sd: SDBaseline
    ar: Speed

    def top(self, n: int) -> list[Evaluation]:
        return self.ranked[:n]


def candidates(
    greedy: bool, ks: Sequence[int] = DEFAULT_KS, budgets: Sequence[int] = DEFAULT_BUDGETS,
    cs: Sequence[float] = DEFAULT_CS, kinds: Sequence[str] = KINDS,
) -> list[Candidate]:
    """The search grid; under greedy C collapses to 1 (it cannot matter there)."""
    for name, values in (("ks", ks), ("budgets", budgets), ("cs", cs), ("kinds", kinds)):
        if not values:
            raise ValueError(f"{name} must not be empty")
    bad = [kind for kind in kinds if kind not in KINDS]
    if bad:
        raise ValueError(f"kinds must be among {KINDS}, got {bad}")
    c_grid = (1.0,) if greedy else tuple(cs)
    return [Candidate(*x) for x in itertools.product(kinds, ks, budgets, c_grid)]


def evaluate(
    data: ReplayData, costs: Costs, cand: Candidate, base: SpeculationConfig | None = None,
    samples: int = 1, seed: int = 0,
) -> Evaluation:
    result = replay(data, ssd_spec(cand.kind, cand.k, cand.budget, cand.c, base), samples=samples, seed=seed)
    return Evaluation(cand, result, ssd_speed(result, costs))


def sd_baseline(
    data: ReplayData, costs: Costs, ks: Sequence[int], samples: int = 1, seed: int = 0,
) -> SDBaseline:
    """SD at its best K: acceptance does not depend on the cache at C = 1, so any schedule replays it."""
    best = None
    for k in ks:
        tpr = replay(data, ssd_spec("uniform", k, k + 1), samples=samples, seed=seed).tokens_per_round
        cand = SDBaseline(k, tpr, sd_speed(tpr, k, costs))
        if best is None or cand.speed.tokens_per_s > best.speed.tokens_per_s:
            best = cand
    assert best is not None  # ks is non-empty
    return best


def recommend(
    data: ReplayData, costs: Costs, grid: Iterable[Candidate], base: SpeculationConfig | None = None,
    samples: int = 1, seed: int = 0,
) -> Plan:
    """Evaluate every candidate (wrap `grid` in a progress bar if wanted) and rank by modelled tokens/s.

    Ties keep grid order, so a cheaper equal candidate listed first wins.
    """
    evals = [evaluate(data, costs, c, base, samples, seed) for c in grid]  # lazily: progress bars tick
    if not evals:
        raise ValueError("the candidate grid is empty")
    sd = sd_baseline(data, costs, sorted({e.candidate.k for e in evals}), samples, seed)
    for e in evals:
        e.speedup_vs_sd = e.speed.tokens_per_s / sd.speed.tokens_per_s
    ranked = sorted(evals, key=lambda e: -e.speed.tokens_per_s)
    return Plan(ranked, sd, ar_speed(costs))


def plan_trace(
    path: Path, costs: Costs, ks: Sequence[int], budgets: Sequence[int], base: SpeculationConfig | None = None,
) -> Plan:
    """A recorded trace's plan in one call (the GPU smoke run's last phase), over kinds x ks x budgets at C = 1
    for a greedy trace and the default C grid otherwise."""
    data = ReplayData(load_trace(path))
    return recommend(data, costs, candidates(data.greedy, ks, budgets), base)
