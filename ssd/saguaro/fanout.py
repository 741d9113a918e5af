"""Fan-out schedules for the speculation cache, and the online estimates they need.

SSD drafts K tokens per round; verification accepts k of them (0..K) and the
target adds one token t*. While the target verifies, the draft fills a cache
keyed by (k, t*): for each k it keeps its top-F_k guesses of t*. The budget of
branches is B = sum_k F_k, so the question is how to split B over k.

Model (Saguaro, Kumar/Dao/May 2026):
- acceptance is capped geometric: P(k) = (1-a) a^k for k < K, P(K) = a^K;
- a position with F guesses misses t* with probability miss(F) = c F^-r.
Minimising sum_k P(k) c F_k^-r under sum_k F_k = B (Lagrange) gives
F_k proportional to P(k)^(1/(1+r)): r -> inf is uniform, r -> 0 follows P(k).

Everything here is pure Python (no model, no torch, no I/O): integer
allocation with exact budgets, the closed-form schedules, and small online
estimators of a and r so the schedule can track the workload.
"""

from __future__ import annotations

import math
import operator
from typing import Literal, Sequence

from ssd.config import SpeculationConfig

# Fractional parts closer than this count as equal, so that ties that are
# exact in real arithmetic but not in floats still break "lower k first".
_TIE_EPS = 1e-9

R_MIN, R_MAX = 0.05, 20.0


# ---------------------------------------------------------------------------
# Validation helpers


def _as_int(name: str, value: object, minimum: int = 0) -> int:
    """An integer >= minimum; bools and non-integral numbers are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _as_prob(name: str, value: float) -> float:
    x = float(value)
    if not 0.0 <= x <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return x


def _as_exponent(name: str, value: float) -> float:
    """r >= 0; +inf is allowed and means 'uniform'."""
    x = float(value)
    if not x >= 0.0:  # refuses NaN and negatives
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def _check_weights(weights: Sequence[float]) -> list[float]:
    out = [float(w) for w in weights]
    if not out:
        raise ValueError("weights must not be empty")
    for i, w in enumerate(out):
        if not (math.isfinite(w) and w >= 0.0):
            raise ValueError(f"weights[{i}] must be finite and >= 0, got {weights[i]!r}")
    return out


def _check_caps(caps: Sequence[int] | None, n: int) -> list[int] | None:
    if caps is None:
        return None
    if len(caps) != n:
        raise ValueError(f"caps has {len(caps)} entries, expected {n}")
    return [_as_int(f"caps[{i}]", c) for i, c in enumerate(caps)]


# ---------------------------------------------------------------------------
# Acceptance law


def acceptance_lengths_pmf(a: float, k: int) -> list[float]:
    """P(0..K) of the capped geometric acceptance law; `k` is the draft length K.

    Each draft is accepted with probability a independently until the first
    rejection; after K acceptances drafting stops, so P(K) = a^K collects the
    tail. The list sums to 1.
    """
    a = _as_prob("a", a)
    big_k = _as_int("k", k)
    pmf = [(1.0 - a) * a**i for i in range(big_k)]
    pmf.append(a**big_k)
    return pmf


# ---------------------------------------------------------------------------
# Integer allocation


def _capped_quotas(weights: list[float], total: int, caps: list[float]) -> list[float]:
    """Real shares summing to `total`, proportional to weights, none above its cap.

    Water-filling: a position whose share would exceed its cap is fixed at
    the cap and the rest is re-split proportionally among the others. When
    every positive-weight position is full, what remains is spread evenly
    over the zero-weight ones (the budget must be spent).
    """
    n = len(weights)
    quota = [0.0] * n
    free = [i for i in range(n) if caps[i] > 0]
    remaining = float(total)
    while remaining > 0 and free:
        active = [i for i in free if weights[i] > 0] or free
        w = {i: (weights[i] if weights[i] > 0 else 1.0) for i in active}
        total_w = sum(w.values())
        over = [i for i in active if remaining * w[i] / total_w >= caps[i]]
        if not over:
            for i in active:
                quota[i] = remaining * w[i] / total_w
            break
        for i in over:
            quota[i] = float(caps[i])
            remaining -= caps[i]
            free.remove(i)
    return quota


def _round_largest_remainder(quota: list[float], total: int, caps: list[float]) -> list[int]:
    """Integers within 1 of each quota that sum to `total` (Hamilton's method).

    Floors first, then one extra unit to the largest fractional parts; equal
    fractions go to the lower index, so the result is deterministic.
    """
    out = [int(math.floor(q)) for q in quota]  # quotas never exceed caps
    left = total - sum(out)
    order = sorted(range(len(quota)), key=lambda i: (-round((quota[i] - out[i]) / _TIE_EPS), i))
    while left > 0:  # normally one pass; the loop only guards float edge cases
        for i in order:
            if left == 0:
                break
            if out[i] < caps[i]:
                out[i] += 1
                left -= 1
    return out


def allocate(
    weights: Sequence[float], budget: int, caps: Sequence[int] | None = None
) -> list[int]:
    """Split an integer budget proportionally to weights, respecting caps.

    Returns integers summing to exactly min(budget, sum(caps)) (budget when no
    caps). Without caps every entry is within 1 of budget * w_i / sum(w).
    A capped position gives what it cannot take to the others in proportion
    to their weights. Zero-weight positions get 0 unless the budget cannot be
    spent otherwise; then the remainder is spread evenly over them.
    Rounding is largest-remainder; ties go to the lower index.
    """
    w = _check_weights(weights)
    budget = _as_int("budget", budget)
    int_caps = _check_caps(caps, len(w))
    total = budget if int_caps is None else min(budget, sum(int_caps))
    top = max(w)
    if top > 0:
        w = [x / top for x in w]  # keeps sums finite for weights near float max
    fcaps = [math.inf] * len(w) if int_caps is None else [float(c) for c in int_caps]
    quota = _capped_quotas(w, total, fcaps)
    return _round_largest_remainder(quota, total, fcaps)


# ---------------------------------------------------------------------------
# Schedules


def uniform_fanout(k: int, budget: int, caps: Sequence[int] | None = None) -> list[int]:
    """K+1 fan-outs as even as possible (lower k gets the odd units).

    The reference implementation's default: K=7, budget 24 gives F=3 each.
    """
    big_k = _as_int("k", k)
    return allocate([1.0] * (big_k + 1), budget, caps)


def geometric_weights(a: float, r: float, k: int) -> list[float]:
    """P(k)^(1/(1+r)): the optimal shares under the capped-geometric/power-law model."""
    r = _as_exponent("r", r)
    pmf = acceptance_lengths_pmf(a, k)
    if math.isinf(r):
        return [1.0] * len(pmf)  # the r -> inf limit, including P(k) = 0 terms
    return [p ** (1.0 / (1.0 + r)) for p in pmf]


def geometric_fanout(
    a: float, r: float, k: int, budget: int, caps: Sequence[int] | None = None
) -> list[int]:
    """The integer split of `budget` closest to F_k ∝ P(k)^(1/(1+r)).

    k is the draft length K; the list has K+1 entries. F_k is non-increasing
    over k < K when a < 1, while F_K can exceed F_{K-1} because P(K) = a^K
    holds the whole tail.
    """
    return allocate(geometric_weights(a, r, k), budget, caps)


def expected_hit_rate(fanout: Sequence[int], a: float, r: float, c: float = 1.0) -> float:
    """sum_k P(k) (1 - min(1, c F_k^-r)); F_k = 0 always misses.

    The planner's objective, for comparing schedules; len(fanout) = K+1.
    """
    if not fanout:
        raise ValueError("fanout must not be empty")
    fs = [_as_int(f"fanout[{i}]", f) for i, f in enumerate(fanout)]
    r = _as_exponent("r", r)
    if not (math.isfinite(c) and c >= 0.0):
        raise ValueError(f"c must be finite and >= 0, got {c!r}")
    pmf = acceptance_lengths_pmf(a, len(fs) - 1)
    return sum(p * (1.0 - min(1.0, c * f**-r)) for p, f in zip(pmf, fs) if f >= 1)


# ---------------------------------------------------------------------------
# Online estimators


class AcceptanceEstimator:
    """Maximum-likelihood a of the capped geometric law, with a weak prior.

    A round with k accepted out of K contributes k successes and, if k < K,
    one failure (the rejection); a capped round (k = K) says nothing about
    the next draft. The MLE is successes / (successes + failures). The prior
    adds prior_weight pseudo-trials at rate prior_a so a is defined (and
    not extreme) before data arrives.
    """

    def __init__(self, prior_a: float = 0.7, prior_weight: float = 4.0) -> None:
        self._prior_a = _as_prob("prior_a", prior_a)
        if not (math.isfinite(prior_weight) and prior_weight >= 0.0):
            raise ValueError(f"prior_weight must be finite and >= 0, got {prior_weight!r}")
        self.successes = self._prior_a * prior_weight
        self.failures = (1.0 - self._prior_a) * prior_weight
        self.rounds = 0

    def update(self, k: int, big_k: int) -> None:
        """Record one round: k drafts accepted out of big_k drafted."""
        big_k = _as_int("K", big_k)
        k = _as_int("k", k)
        if k > big_k:
            raise ValueError(f"accepted length k={k} exceeds K={big_k}")
        self.successes += k
        self.failures += 1 if k < big_k else 0
        self.rounds += 1

    @property
    def a(self) -> float:
        trials = self.successes + self.failures
        return self._prior_a if trials == 0 else self.successes / trials


class PowerLawEstimator:
    """Fits miss(F) = c F^-r from (F, hit) observations.

    Per distinct F it counts trials and misses; the fit is weighted least
    squares of log(miss rate) on log F with delta-method weights
    n p / (1 - p) (the inverse variance of log p_hat). Only F values with both
    hits and misses enter (log 0 is undefined); with fewer than two such F
    the priors are returned. r is clamped to [r_min, r_max] because a
    schedule from a wild r (from noise or a single odd F) can starve positions.
    """

    def __init__(
        self,
        prior_r: float = 1.0,
        prior_c: float = 1.0,
        r_min: float = R_MIN,
        r_max: float = R_MAX,
    ) -> None:
        if not 0.0 < r_min <= r_max < math.inf:
            raise ValueError(f"need 0 < r_min <= r_max < inf, got {r_min!r}, {r_max!r}")
        self.r_min, self.r_max = float(r_min), float(r_max)
        self.prior_r = min(max(_as_exponent("prior_r", prior_r), self.r_min), self.r_max)
        if not (math.isfinite(prior_c) and prior_c > 0.0):
            raise ValueError(f"prior_c must be finite and > 0, got {prior_c!r}")
        self.prior_c = float(prior_c)
        self._trials: dict[int, int] = {}
        self._misses: dict[int, int] = {}
        self._fit: tuple[float, float] | None = None  # cached (r, c); None = stale

    def update(self, fanout: int, hit: bool) -> None:
        """Record whether a cache position with `fanout` >= 1 guesses held t*."""
        f = _as_int("fanout", fanout, minimum=1)
        self._trials[f] = self._trials.get(f, 0) + 1
        self._misses[f] = self._misses.get(f, 0) + (0 if hit else 1)
        self._fit = None

    @property
    def observations(self) -> int:
        return sum(self._trials.values())

    @property
    def fitted(self) -> bool:
        """Whether r and c come from data (>= 2 usable distinct F) rather than the prior."""
        return len(self._usable()) >= 2

    @property
    def r(self) -> float:
        return self._estimate()[0]

    @property
    def c(self) -> float:
        return self._estimate()[1]

    def _usable(self) -> list[int]:
        return [f for f, n in self._trials.items() if 0 < self._misses[f] < n]

    def _estimate(self) -> tuple[float, float]:
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        fs = self._usable()
        if len(fs) < 2:
            return self.prior_r, self.prior_c
        xs, ys, ws = [], [], []
        for f in fs:
            n, m = self._trials[f], self._misses[f]
            xs.append(math.log(f))
            ys.append(math.log(m / n))
            ws.append(m * n / (n - m))
        slope, intercept = _weighted_line(xs, ys, ws)
        r = min(max(-slope, self.r_min), self.r_max)
        return r, math.exp(intercept)


def _weighted_line(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the weighted least-squares line y = slope x + intercept."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    slope = sxy / sxx  # sxx > 0: the xs are logs of >= 2 distinct F
    return slope, my - slope * mx


# ---------------------------------------------------------------------------
# Planner


class FanoutPlanner:
    """Holds the current fan-out schedules and keeps them fitted to the workload.

    Rounds are split by where the speculation under verification came from:
    a cache hit (drafted ahead, down a predicted branch) or a miss (the backup
    drafted it on the spot). The two see different acceptance, so each has
    its own a estimate and its own schedule; r (how misses fall with F) is a
    property of the draft's top-F ranking and is shared. The schedule for a
    round is the one the cache built during that round's verification used,
    so its outcome (k, hit) is evidence about exactly that schedule.
    Schedules change only every `refresh_every` observations so the cache
    builder sees a stable shape and refreshes cost nothing per round.
    """

    def __init__(
        self,
        kind: Literal["uniform", "geometric"],
        k: int,
        budget: int,
        caps: Sequence[int] | None = None,
        refresh_every: int = 16,
        prior_a: float = 0.7,
        prior_r: float = 1.0,
    ) -> None:
        if kind not in ("uniform", "geometric"):
            raise ValueError(f"kind must be 'uniform' or 'geometric', got {kind!r}")
        self.kind = kind
        self.k = _as_int("k", k)
        self.budget = _as_int("budget", budget)
        self.caps = _check_caps(caps, self.k + 1)
        self.refresh_every = _as_int("refresh_every", refresh_every, minimum=1)
        self._acc = {h: AcceptanceEstimator(prior_a) for h in (True, False)}
        self._power = PowerLawEstimator(prior_r)
        self.observations = 0
        self.refreshes = 0
        self._weights: dict[bool, list[float]] = {}
        self._schedules: dict[bool, list[int]] = {}
        self._rebuild()

    def schedule(self, after_hit: bool, budget: int | None = None) -> list[int]:
        """F_0..F_K for the cache built while verifying a hit (True) or miss round.

        budget: spend this many branches instead (a batch sharing one branch
        cap scales each row down; an anytime build may grow it); the shape is the same
        as the planner's schedule, from the estimates of the last refresh, so
        a scaled row stays geometric and stable between refreshes.
        """
        own = self._schedules[bool(after_hit)]
        if budget is None or budget == sum(own):
            return list(own)
        return allocate(self._weights[bool(after_hit)], budget, self.caps)

    def observe(self, after_hit: bool, k: int, fanout_at_k: int, hit: bool | None, drafted: int | None = None) -> None:
        """Record one verified round.

        after_hit: the verified speculation came from a cache hit.
        k: accepted length; fanout_at_k: F_k of the schedule the cache was
        built with; hit: whether (k, t*) was in that cache, None if unknown;
        drafted: tokens the speculation had (default K; a bonus branch's has fewer).
        """
        k = _as_int("k", k)
        drafted = self.k if drafted is None else _as_int("drafted", drafted)
        if k > drafted:
            raise ValueError(f"accepted length k={k} exceeds the {drafted} drafted tokens")
        f = _as_int("fanout_at_k", fanout_at_k)
        if hit and f == 0:
            raise ValueError("a cache hit needs fanout_at_k >= 1")
        self._acc[bool(after_hit)].update(k, drafted)
        if hit is not None and f >= 1:  # F = 0 is a certain miss: no evidence on r
            self._power.update(f, bool(hit))
        self.observations += 1
        if self.observations % self.refresh_every == 0:
            self.refresh()

    def refresh(self) -> None:
        """Recompute both schedules from the current estimates now."""
        self._rebuild()
        self.refreshes += 1

    def a(self, after_hit: bool) -> float:
        return self._acc[bool(after_hit)].a

    @property
    def r(self) -> float:
        return self._power.r

    @property
    def c(self) -> float:
        return self._power.c

    def _rebuild(self) -> None:
        for h in (True, False):
            if self.kind == "uniform":
                self._weights[h] = [1.0] * (self.k + 1)
            else:
                self._weights[h] = geometric_weights(self.a(h), self.r, self.k)
            self._schedules[h] = allocate(self._weights[h], self.budget, self.caps)


def fanout_for(fanout: Sequence[int], drafted: int) -> list[int]:
    """The schedule F_0..F_K cut to a speculation of `drafted` tokens: its
    last outcome (all accepted) takes the rest of the budget, as it takes the
    rest of the acceptance law's mass."""
    return [*fanout[:drafted], sum(fanout[drafted:])]


def share_budget(budgets: Sequence[int], cap: int | None) -> list[int]:
    """Each row's branch budget when a batch shares at most `cap` branches.

    Rows whose budgets fit under the cap keep them; otherwise every row keeps
    one branch (a row with none would always miss, and one miss stalls the
    whole batch) and the rest of the cap is split in proportion to what each
    row asked for beyond that one. The result sums to exactly `cap` when
    len(budgets) <= cap <= sum(budgets); a cap below the number of rows still
    gives every row with a budget one branch, so it is exceeded then.
    """
    asked = [_as_int(f"budgets[{i}]", b) for i, b in enumerate(budgets)]
    if cap is None or sum(asked) <= _as_int("cap", cap):
        return asked
    floor = [min(1, b) for b in asked]
    extra = [b - f for b, f in zip(asked, floor)]
    if not extra or sum(extra) == 0 or cap <= sum(floor):
        return floor
    shares = allocate([float(e) for e in extra], cap - sum(floor), caps=extra)
    return [f + s for f, s in zip(floor, shares)]


def make_planner(speculation: SpeculationConfig, vocab_size: int) -> FanoutPlanner:
    """The fan-out planner of one sequence, shared by the speculator and the
    trace replay (ssd.tools.ablation), which must plan exactly as the speculator does.

    Caps: at most V-1 guesses where the drafted token is excluded, V at k = K.
    K: the longest speculation a round may have (speculation.k_ceiling: with
    adaptive K, shorter ones take their schedule's head, `fanout_for`).
    """
    fanout = speculation.fanout
    k = speculation.k_ceiling
    return FanoutPlanner(
        fanout.kind, k, fanout.budget, caps=[vocab_size - 1] * k + [vocab_size],
        refresh_every=fanout.refresh_every, prior_a=fanout.initial_a, prior_r=fanout.initial_r,
    )
