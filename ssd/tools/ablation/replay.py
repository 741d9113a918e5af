"""Replay SSD's speculation cache on a recorded trace: no models, only arithmetic.

What a round does (ssd.saguaro.speculator, ssd.saguaro.target), and how it is replayed:
the draft speculates K tokens (at most remaining - 1, the engine's
max_new_tokens truncation), the target accepts k of them and adds t*; while
it verifies, the draft caches its top-F_k tokens at each acceptance length k
(for k < K without the drafted token s_{k+1}; ranked by raw logits, as
ssd.saguaro.builder.guessed_outcomes does). The next round looks (k, t*) up:
hit or miss. Per sequence a fresh FanoutPlanner (the speculator's own
`make_planner`) sees the same observations in the same order as live: at each
lookup, observe(after_hit of the verified speculation, k, F_k of the cache it
was built with, hit); the cache built in a round uses schedule(after_hit =
that round's hit); a backup speculation drafts with the after-miss schedule's
Saguaro, a cached one with the after-hit schedule in force when it was built.
The first round follows the prefill and is not a lookup (as in SpecStats).

Greedy (T = 0): EXACT. Every emitted token is the trajectory token g_i, and a
drafted token is accepted iff it is the draft's argmax at a trajectory
position, so k = the number of leading positions whose draft argmax equals
g_i (capped at the truncated K), t* = g_{pos+k}, and the excluded token is the
draft's argmax. Hit = rank of t* among the draft's logits, less one when the
excluded token ranks above it, < min(F_k, V - 1) for k < K and < min(F_K, V)
for the bonus position, where nothing is excluded (as guessed_outcomes).

Sampled (T > 0): a seeded Monte Carlo, conditioned on the trajectory. The
recorded trajectory is a draw from the target, and speculative decoding emits
exactly the target's law, so rounds can be sampled GIVEN that the emitted
tokens are the trajectory's: at a drafted position with q' (the draft's q
Saguaro-rescaled with C on the top-F of the schedule the speculation was
drafted with) and target p, P(emit g by accepting) = min(p(g), q'(g)) and
P(emit g as a correction) = max(0, p(g) - q'(g)), so the draft is accepted
with probability min(1, q'(g) / p(g)). After a rejection the drafted token x
(which the cache excludes) is distributed as norm(max(0, q' - p)),
independently of t*; it only matters when t*'s rank equals min(F_k, V - 1).
Every context visited is on the trajectory, so nothing off-trajectory is
needed, and averaged over trajectories the expected counts (lookups, hits,
drafted, accepted, rounds) are those of live SSD. Approximations: (1) the recorded distributions come from one
teacher-forced forward (numerically, not bitwise, those of the live
incremental forwards; a dynamically quantized draft quantizes activations
per call); (2) with top_n < V, mass outside each model's top-N is dropped
from the residual and the Saguaro top-F mass (F is capped at N), and a
t* ranked beyond N is a miss ("unresolved" when F could reach it);
(3) variance: a trajectory is one sample; use several per prompt and
`samples` Monte Carlo passes per trajectory.

Both modes: the backup is the neural draft (as plain SD). With the folded
glue (ssd.saguaro.builder) a hit on a bonus outcome serves a K - 1 token
speculation, whose cache covers k = 0..K-1 (ssd.saguaro.builder.fanout_for);
replayed the same way, assuming the fold always runs (live, a build whose
schedule puts no branch below the bonus position does not fold). A trajectory that
ended on EOS ends the replay there; the live engine may count drafted tokens
past the EOS as accepted in that final round (admitted tokens, rounds and
hits are unaffected).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ssd.tools.ablation.trace import Trace, TraceSequence
from ssd.config import SpeculationConfig
from ssd.engine.metrics import RoundRatios, SpecStats
from ssd.saguaro.fanout import FanoutPlanner, fanout_for, make_planner

PlannerFactory = Callable[[SpeculationConfig, int], FanoutPlanner]


# ---------------------------------------------------------------------------
# Precomputed views of a trace


@dataclass(frozen=True)
class SequenceView:
    """One trajectory, reduced to what a replay reads (plain lists: the walk is scalar Python)."""

    n: int
    rank: list[int]  # draft rank of g_i; top_n means "not among the kept rows"
    top1: list[bool]  # g_i is the draft's argmax (torch.argmax: the lowest id among tied maxima)
    argmax_rank: list[int]  # rank of that argmax in the kept order (0 unless tied maxima were reordered)
    p_tok: list[float] = field(default_factory=list)  # target p(g_i) at T (sampled only)
    q_tok: list[float] = field(default_factory=list)  # draft q(g_i) at T
    q_sorted: np.ndarray | None = None  # [n, N] draft q at its top-N, descending
    q_cum: np.ndarray | None = None  # [n, N] cumulative sums of q_sorted
    p_at_q: np.ndarray | None = None  # [n, N] target p at the draft's top-N


class ReplayData:
    """A trace precomputed once for any number of replays (schedules, K, C)."""

    def __init__(self, trace: Trace) -> None:
        if not trace.sequences:
            raise ValueError("trace has no sequences")
        self.meta = trace.meta
        self.vocab_size = trace.meta.vocab_size
        self.top_n = trace.meta.top_n
        self.temperature = trace.meta.temperature
        self.sequences = [self._view(s) for s in trace.sequences]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _view(self, seq: TraceSequence) -> SequenceView:
        pos = seq.positions
        tokens = torch.tensor(seq.tokens, dtype=torch.long)
        ids, values = pos.draft_top_indices.long(), pos.draft_top_values
        match = ids == tokens.unsqueeze(1)
        rank = torch.where(match.any(1), match.int().argmax(1), torch.full_like(tokens, self.top_n))
        # The drafted token under greedy is torch.argmax's choice; topk may order tied maxima otherwise.
        argmax_id = torch.where(values == values[:, :1], ids, ids.new_tensor(1 << 40)).min(1).values
        argmax_rank = (ids == argmax_id.unsqueeze(1)).int().argmax(1)
        common = dict(n=len(seq.tokens), rank=rank.tolist(), top1=(argmax_id == tokens).tolist(),
                      argmax_rank=argmax_rank.tolist())
        if self.greedy:
            return SequenceView(**common)
        t = self.temperature
        q_sorted = torch.exp(pos.draft_top_values.double() / t - pos.draft_lse.unsqueeze(1)).numpy()
        return SequenceView(
            **common,
            p_tok=torch.exp(pos.target_token_logit / t - pos.target_lse).tolist(),
            q_tok=torch.exp(pos.draft_token_logit / t - pos.draft_lse).tolist(),
            q_sorted=q_sorted, q_cum=np.cumsum(q_sorted, axis=1),
            p_at_q=torch.exp(pos.target_at_draft_top.double() / t - pos.target_lse.unsqueeze(1)).numpy(),
        )


# ---------------------------------------------------------------------------
# Results


@dataclass
class ReplayResult(RoundRatios):
    """Counts as the live engine keeps them (SpecStats for the cache), summed over sequences."""

    kind: str
    k: int
    budget: int
    c: float
    temperature: float
    walks: int = 0  # sequences replayed, times the Monte Carlo passes
    rounds: int = 0
    new_tokens: int = 0  # tokens the rounds added (each sequence's first token comes from the prefill)
    drafted: int = 0
    accepted: int = 0
    unresolved: int = 0  # lookups the kept top-N could not decide (counted as misses)
    spec: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_round(self) -> float:
        """(generated - 1) / rounds, as launch/ssd_sweep.py reports it for live runs."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "kind": self.kind, "k": self.k, "budget": self.budget, "c": self.c,
            "temperature": self.temperature, "walks": self.walks, "rounds": self.rounds,
            "lookups": self.spec.lookups, "hits": self.spec.hits, "hit_rate": self.hit_rate,
            "hit_rate_by_k": self.hit_rate_by_k, "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "tokens_per_round_after_hit": self.tokens_per_round_after_hit,
            "tokens_per_round_after_miss": self.tokens_per_round_after_miss,
            "unresolved": self.unresolved,
        }


# ---------------------------------------------------------------------------
# One round, greedy or sampled


@dataclass
class RoundOutcome:
    k: int  # accepted drafts
    next_hit: bool  # whether (k, t*) is in the cache built during this round
    unresolved: bool = False


def _cache_hit(
    rank: int, excluded_above: bool, f: int, vocab: int, top_n: int, excludes: bool = True,
) -> tuple[bool, bool]:
    """(hit, unresolved): t* of draft rank `rank` against the cached guesses: the top
    min(F, V-1) where the drafted token s_{k+1} is excluded (k < K), min(F, V) at the bonus.

    excluded_above: the excluded token ranks above t*.
    """
    limit = min(f, vocab - 1 if excludes else vocab)
    if limit <= 0:
        return False, False
    if rank >= top_n:  # true rank >= top_n: the effective rank is at least top_n - 1
        floor = top_n - 1 if excluded_above else top_n
        return False, limit > floor
    return rank - (1 if excluded_above else 0) < limit, False


class GreedyRounds:
    """Exact rounds under greedy decoding (no randomness)."""

    def __init__(self, vocab: int, top_n: int) -> None:
        self.vocab, self.top_n = vocab, top_n

    def play(self, view: SequenceView, pos: int, window: int, big_k: int,
             saguaro: Sequence[int], fanout: Sequence[int]) -> RoundOutcome:
        k = 0
        while k < window and view.top1[pos + k]:
            k += 1
        j = pos + k
        if k == big_k:  # bonus token: nothing excluded
            hit, unresolved = _cache_hit(view.rank[j], False, fanout[k], self.vocab, self.top_n, excludes=False)
            return RoundOutcome(k, hit, unresolved)
        # For k < K the excluded token is the draft's argmax. If that is t* itself, t* is
        # excluded: only in a final, truncated round, which has no lookup.
        if view.top1[j]:
            return RoundOutcome(k, False)
        above = view.argmax_rank[j] < view.rank[j]
        hit, unresolved = _cache_hit(view.rank[j], above, fanout[k], self.vocab, self.top_n)
        return RoundOutcome(k, hit, unresolved)


class SampledRounds:
    """Rounds at T > 0, drawn given the trajectory (see the module docstring)."""

    def __init__(self, vocab: int, top_n: int, c: float, rng: random.Random) -> None:
        self.vocab, self.top_n, self.c, self.rng = vocab, top_n, c, rng

    def play(self, view: SequenceView, pos: int, window: int, big_k: int,
             saguaro: Sequence[int], fanout: Sequence[int]) -> RoundOutcome:
        for i in range(window):
            j = pos + i
            p = view.p_tok[j]
            if p > 0 and self.rng.random() * p >= self._q_prime(view, j, saguaro[i]):
                return self._rejected(view, j, i, saguaro[i], fanout[i])
        rank = view.rank[pos + window]
        hit, unresolved = _cache_hit(rank, False, fanout[window], self.vocab, self.top_n, excludes=window < big_k)
        return RoundOutcome(window, hit, unresolved)

    def _scale(self, view: SequenceView, j: int, f: int) -> tuple[int, float]:
        """(F actually rescaled, normaliser) of Saguaro's q' at position j; (0, 1) = q unchanged."""
        f = min(f, self.vocab, self.top_n)
        if self.c == 1.0 or f <= 0:
            return 0, 1.0
        norm = 1.0 - (1.0 - self.c) * float(view.q_cum[j, f - 1])
        return (f, norm) if norm > 0 else (0, 1.0)  # c = 0 with all mass on the top-F keeps q

    def _q_prime(self, view: SequenceView, j: int, f: int) -> float:
        f, norm = self._scale(view, j, f)
        return view.q_tok[j] * (self.c if view.rank[j] < f else 1.0) / norm

    def _rejected(self, view: SequenceView, j: int, k: int, f_sag: int, f_cache: int) -> RoundOutcome:
        """Rejected at acceptance length k (position j): t* = g_j; is it in the cache?"""
        rank = view.rank[j]
        limit = min(f_cache, self.vocab - 1)
        if limit <= 0:
            return RoundOutcome(k, False)
        if rank < limit:  # whichever token is excluded, t* stays inside the top-F
            return RoundOutcome(k, True)
        if rank == limit and rank < self.top_n:  # a hit iff the excluded x ranks above t*
            return RoundOutcome(k, self.rng.random() < self._excluded_above(view, j, rank, f_sag))
        hit, unresolved = _cache_hit(rank, True, f_cache, self.vocab, self.top_n)
        return RoundOutcome(k, hit, unresolved)

    def _excluded_above(self, view: SequenceView, j: int, rank: int, f_sag: int) -> float:
        """P(x ranks above t*) for x ~ norm(max(0, q' - p)) over the draft's kept rows."""
        f, norm = self._scale(view, j, f_sag)
        q = view.q_sorted[j].copy()
        q[:f] *= self.c
        q /= norm
        residual = np.maximum(q - view.p_at_q[j], 0.0)
        total = float(residual.sum())
        if total <= 0.0:  # rejection had ~zero probability; fall back to x ~ q'
            residual, total = q, float(q.sum())
        return float(residual[:rank].sum()) / total


# ---------------------------------------------------------------------------
# The walk


@dataclass
class _Pending:
    """The round just verified, waiting for its lookup in the next round."""

    after_hit: bool
    k: int
    fanout: list[int]
    hit: bool
    unresolved: bool
    speculated: int  # tokens the draft's speculation had (K; K - 1 from a folded bonus branch)


def replay(
    data: ReplayData, spec: SpeculationConfig, max_new_tokens: int | None = None,
    samples: int = 1, seed: int = 0, planner_factory: PlannerFactory = make_planner,
) -> ReplayResult:
    """Replay SSD with `spec` (fan-out kind, budget, K, Saguaro C, planner priors) on every sequence.

    max_new_tokens: the engine's limit (default and maximum: the recorded one).
    samples: Monte Carlo passes per trajectory at T > 0 (greedy replays once).
    planner_factory: how each sequence's planner is built (default: the speculator's).
    """
    limit = _check_replay_args(data, spec, max_new_tokens, samples)
    result = ReplayResult(spec.fanout.kind, spec.k, spec.fanout.budget, spec.saguaro_c, data.temperature)
    passes = 1 if data.greedy else samples
    for index, view in enumerate(data.sequences):
        for s in range(passes):
            rounds = (
                GreedyRounds(data.vocab_size, data.top_n) if data.greedy
                else SampledRounds(data.vocab_size, data.top_n, spec.saguaro_c, random.Random(f"{seed}/{index}/{s}"))
            )
            _walk(view, spec, limit, planner_factory(spec, data.vocab_size), rounds, result)
    return result


def _check_replay_args(data: ReplayData, spec: SpeculationConfig, max_new_tokens: int | None, samples: int) -> int:
    recorded = data.meta.max_new_tokens
    limit = recorded if max_new_tokens is None else max_new_tokens
    if not 1 <= limit <= recorded:
        raise ValueError(f"max_new_tokens must be in 1..{recorded} (the trace's), got {max_new_tokens}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if spec.backup_for(batch_size=1) != "neural":
        raise ValueError(f"replay models the neural backup only, got backup {spec.backup_for(1)!r}")
    cap = spec.fanout.batch_budget
    if cap is not None and cap < spec.fanout.budget:  # a batch of one spends min(budget, cap) live
        raise ValueError(f"replay models fanout.budget alone; batch_budget {cap} < budget {spec.fanout.budget}")
    return limit


def _walk(view: SequenceView, spec: SpeculationConfig, limit: int, planner: FanoutPlanner,
          rounds: GreedyRounds | SampledRounds, out: ReplayResult) -> None:
    """One sequence, round by round, in the speculator's order of operations."""
    n = min(view.n, limit)
    pos, pending, cached_saguaro = 1, None, None
    fold = spec.glue == "fold" and spec.k >= 2
    out.walks += 1
    out.new_tokens += n - 1
    while pos < n:
        hit, speculated = False, spec.k
        if pending is not None:
            hit = pending.hit
            planner.observe(pending.after_hit, pending.k, pending.fanout[pending.k], hit, pending.speculated)
            out.unresolved += pending.unresolved
            if hit and fold and pending.k == pending.speculated:  # a folded bonus branch drafted K - 1
                speculated = spec.k - 1
        saguaro = cached_saguaro if hit else planner.schedule(after_hit=False)
        fanout = fanout_for(planner.schedule(after_hit=hit), speculated)
        cached_saguaro = planner.schedule(after_hit=True)
        drafted = min(speculated, limit - pos - 1)
        outcome = rounds.play(view, pos, min(drafted, n - pos - 1), speculated, saguaro, fanout)
        out.spec.record(
            lookup_k=None if pending is None else pending.k, hit=hit, source="cache" if hit else "neural",
            tokens=outcome.k + 1, wait_s=0.0, verify_s=0.0, backup_s=0.0, build_s=0.0,
        )
        out.rounds += 1
        out.drafted += drafted
        out.accepted += outcome.k
        pending = _Pending(hit, outcome.k, fanout, outcome.next_hit, outcome.unresolved, speculated)
        pos += outcome.k + 1


# ---------------------------------------------------------------------------
# Studies built on replay


def ssd_spec(kind: str, k: int, budget: int, c: float = 1.0, base: SpeculationConfig | None = None) -> SpeculationConfig:
    """A mode-ssd SpeculationConfig: `base`'s planner priors and decoder with these knobs,
    building as replays model it: a fixed budget, the draft's entries only (no anytime
    cut, no free n-gram entries)."""
    base = base or SpeculationConfig(mode="ssd")
    fanout = dataclasses.replace(base.fanout, kind=kind, budget=budget, anytime=False)
    return dataclasses.replace(base, mode="ssd", k=k, saguaro_c=c, fanout=fanout, backup="neural", backup_policy={},
                               ngram_candidates=False)


@dataclass(frozen=True)
class MissPoint:
    fanout: int
    miss_rate: float
    lookups: int


def miss_vs_fanout(
    data: ReplayData, k: int, max_fanout: int, base: SpeculationConfig | None = None,
    samples: int = 1, seed: int = 0,
) -> list[MissPoint]:
    """Cache miss rate with the same F at every acceptance length, F = 1..max_fanout.

    F is capped at V - 1 (no more distinct guesses exist where a token is excluded).
    """
    if max_fanout < 1:
        raise ValueError(f"max_fanout must be >= 1, got {max_fanout}")
    points = []
    for f in range(1, min(max_fanout, data.vocab_size - 1) + 1):
        spec = ssd_spec("uniform", k, f * (k + 1), base.saguaro_c if base else 1.0, base)
        res = replay(data, spec, samples=samples, seed=seed)
        points.append(MissPoint(f, 1.0 - res.hit_rate, res.spec.lookups))
    return points


@dataclass(frozen=True)
class PowerLawFit:
    """miss(F) = c F^-r, fitted by least squares on log miss vs log F."""

    r: float
    c: float
    points: int  # (F, miss) pairs with 0 < miss that entered the fit

    def miss(self, f: float) -> float:
        return self.c * f ** -self.r


def fit_power_law(fanouts: Sequence[float], misses: Sequence[float]) -> PowerLawFit:
    """Ordinary least squares of log(miss) on log(F); points with miss <= 0 carry no log and are skipped."""
    if len(fanouts) != len(misses):
        raise ValueError(f"fanouts and misses differ in length ({len(fanouts)} vs {len(misses)})")
    pairs = [(math.log(f), math.log(m)) for f, m in zip(fanouts, misses) if f > 0 and m > 0]
    if len({x for x, _ in pairs}) < 2:
        raise ValueError("fit_power_law needs at least two distinct F with a miss rate > 0")
    xs, ys = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    slope, intercept = np.polyfit(xs, ys, 1)
    return PowerLawFit(r=float(-slope), c=float(math.exp(intercept)), points=len(pairs))


def compare_kinds(
    data: ReplayData, k: int, budgets: Sequence[int], c: float = 1.0,
    base: SpeculationConfig | None = None, samples: int = 1, seed: int = 0,
) -> list[dict]:
    """Geometric against uniform fan-out at equal budgets: one row per (budget, kind)."""
    rows = []
    for budget in budgets:
        for kind in ("uniform", "geometric"):
            res = replay(data, ssd_spec(kind, k, budget, c, base), samples=samples, seed=seed)
            rows.append(res.as_dict())
    return rows


def c_tradeoff(
    data: ReplayData, spec: SpeculationConfig, cs: Sequence[float], samples: int = 1, seed: int = 0,
) -> list[dict]:
    """Hit rate and acceptance as Saguaro C varies, other knobs as in `spec` (T > 0 traces)."""
    if data.greedy:
        raise ValueError("Saguaro C has no effect under greedy decoding: record the trace at temperature > 0")
    return [
        replay(data, dataclasses.replace(spec, saguaro_c=float(c)), samples=samples, seed=seed).as_dict()
        for c in cs
    ]
