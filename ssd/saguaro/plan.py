"""The start-up plan: the K, fan-out budget and glue that make SSD fastest here.

Pure math over measured numbers (no model, no I/O): what one round costs on
this host (ssd.saguaro.costs.Costs, one per glue kind) and how the draft
agrees with the target (`Agreement`). The speed model is the paper's
(Kumar, Dao, May: Speculative Speculative Decoding, arXiv 2603.03251) in
seconds, as ssd.saguaro.speed writes it:

  SSD tokens/s = E / [p T_hit + (1 - p)(T_backup + T_hit)],  T_hit = max(T_verify, T_build)

with E the tokens a round yields under the capped geometric acceptance law
(sum_{i<=K} a^i) and p the chance that the verification outcome (k, t*) was
cached: P(k) times the chance that t* ranks within the draft's top F_k, read
off the measured ranks (`Agreement.hit`) rather than a fitted law. The
folded glue saves a draft forward but its bonus branches draft K - 1 tokens,
so a round after a bonus-branch hit yields E(K - 1): the plan weighs both.

At b rows a round verifies every row in one packed forward and builds every
row's cache in the same lockstep steps, so its build costs what one row's
build over b x F branches costs; a row that misses stalls the batch for a
backup chain (ssd.saguaro.batch_policy):

  SSD(b) = b E / [max(T_verify(b), T_build(K, b F)) + (1 - p^b) T_backup(b)],  AR(b) = b / T_step(b)

`plan_rows` gives each batch size its per-row budget and says where
speculation stops paying (the speculation.k_policy entry that turns it off).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from ssd.saguaro.costs import Costs
from ssd.saguaro.speed import ssd_rows_speed, ssd_speed_from
from ssd.saguaro.fanout import acceptance_lengths_pmf, geometric_fanout

DEFAULT_KS = tuple(range(1, 7))
DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16)
DEFAULT_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Agreement:
    """How the draft agrees with the target, from teacher-forced positions.

    a: per-token acceptance (greedy: how often the draft's top token is the
    target's). ranks_rejected: where a rejection's t* ranks among the draft's
    tokens other than the rejected draft (0 = the draft's second choice);
    ranks_bonus: where the target's next token ranks among all the draft's.
    """

    a: float
    ranks_rejected: Sequence[int]
    ranks_bonus: Sequence[int]
    positions: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.a < 1.0:
            raise ValueError(f"acceptance a must be in [0, 1), got {self.a}")
        object.__setattr__(self, "ranks_rejected", sorted(self.ranks_rejected))
        object.__setattr__(self, "ranks_bonus", sorted(self.ranks_bonus))

    def hit(self, fanout: int, bonus: bool) -> float:
        """P(t* within the draft's top `fanout` guesses) at a rejection or after all K accepted."""
        ranks = self.ranks_bonus if bonus else self.ranks_rejected
        if not ranks or fanout <= 0:
            return 0.0
        return bisect.bisect_left(ranks, fanout) / len(ranks)

    def to_json(self) -> dict:
        return {"a": self.a, "ranks_rejected": list(self.ranks_rejected), "ranks_bonus": list(self.ranks_bonus),
                "positions": self.positions}

    @classmethod
    def from_json(cls, data: dict) -> "Agreement":
        return cls(float(data["a"]), list(data["ranks_rejected"]), list(data["ranks_bonus"]), int(data["positions"]))


@dataclass(frozen=True)
class Prediction:
    k: int
    budget: int
    glue: str
    tokens_per_s: float
    hit_rate: float
    tokens_per_round: float
    verify_s: float
    build_s: float
    backup_s: float
    link_s: float = 0.0  # the target-draft link's round trip, on every round

    @property
    def build_over_verify(self) -> float:
        return self.build_s / self.verify_s


@dataclass(frozen=True)
class RowCosts:
    """Seconds of a batched round at b rows, as measured at a few points:
    verify[(b, n)] one packed target forward of n tokens a row, chain[(b, k)]
    a backup chain of k draft tokens a row. The rest is interpolated, linear
    in n (or k) and then in b, and extrapolated from the last two points."""

    verify: dict[tuple[int, int], float]
    chain: dict[tuple[int, int], float]

    def verify_s(self, rows: int, tokens: int) -> float:
        return _bilinear(self.verify, rows, tokens)

    def chain_s(self, rows: int, k: int) -> float:
        return _bilinear(self.chain, rows, k)

    def to_json(self) -> dict:
        return {"verify": [[b, n, s] for (b, n), s in sorted(self.verify.items())],
                "chain": [[b, k, s] for (b, k), s in sorted(self.chain.items())]}

    @classmethod
    def from_json(cls, data: dict) -> "RowCosts":
        return cls({(int(b), int(n)): float(s) for b, n, s in data["verify"]},
                   {(int(b), int(k)): float(s) for b, k, s in data["chain"]})


@dataclass(frozen=True)
class RowsChoice:
    """The plan at one batch size: each row's branch budget and the modelled speeds."""

    rows: int
    budget: int
    ssd_tokens_per_s: float
    ar_tokens_per_s: float

    @property
    def speculates(self) -> bool:
        return self.ssd_tokens_per_s > self.ar_tokens_per_s


@dataclass
class Plan:
    best: Prediction
    ranked: list[Prediction]  # best first
    sd_k: int
    sd_tokens_per_s: float
    ar_tokens_per_s: float
    agreement: Agreement
    meta: dict = field(default_factory=dict)
    rows: list[RowsChoice] = field(default_factory=list)  # by batch size; empty when not measured
    batch_budget: int | None = None  # fanout.batch_budget: the branches a batch shares (None: no cap)
    # AR at one row on the target's cores plus the draft's, lent while speculation is off (a lone
    # cluster target, CPU mode); None where no core is lent
    ar_wide_tokens_per_s: float | None = None

    @property
    def beats_sd(self) -> bool:
        return self.best.tokens_per_s > self.sd_tokens_per_s

    @property
    def one_row_ssd_tokens_per_s(self) -> float:
        return self.rows[0].ssd_tokens_per_s if self.rows else self.best.tokens_per_s

    @property
    def lends_draft_core(self) -> bool:
        """Whether AR on the target's and the draft's cores beats SSD on one core each at one
        row: the draft's core is then worth more to the target than the draft's speculation."""
        return bool(self.ar_wide_tokens_per_s) and self.ar_wide_tokens_per_s > self.one_row_ssd_tokens_per_s

    def off_reason(self) -> str | None:
        """Why the plan turns speculation off for a lone request (`lends_draft_core`), in
        words a result line can quote; None where one row speculates."""
        if not self.lends_draft_core:
            return None
        return (f"AR on the target's cores and the draft's is predicted faster than SSD on one core each "
                f"({self.ar_wide_tokens_per_s:.2f} vs {self.one_row_ssd_tokens_per_s:.2f} tok/s at one row)")

    @property
    def k_policy(self) -> dict[int, int]:
        """speculation.k_policy: speculation off (K 0) from the first batch size where AR is
        faster. At one row only against AR on the draft's core too (`lends_draft_core`): on
        the target's core alone, one row keeps the mode asked for (the start-up report warns)."""
        if self.lends_draft_core:
            return {1: 0}
        off = next((c.rows for c in self.rows if c.rows > 1 and not c.speculates), None)
        return {} if off is None else {off: 0}

    def _link(self) -> str:
        b = self.best
        if not b.link_s:
            return ""
        share = b.link_s / (b.tokens_per_round / b.tokens_per_s)
        return f", link round trip {b.link_s * 1e3:.2f} ms: {100 * share:.1f}% of a round"

    def _wide(self) -> str:
        return "" if self.ar_wide_tokens_per_s is None else f" ({self.ar_wide_tokens_per_s:.2f} on the draft's core too)"

    def rows_summary(self) -> str:
        cells = [f"{c.rows} rows: SSD {c.ssd_tokens_per_s:.2f} (budget {c.budget}) vs AR {c.ar_tokens_per_s:.2f}"
                 for c in self.rows]
        cap = "no cap" if self.batch_budget is None else f"{self.batch_budget} branches a batch"
        return f"SSD plan by batch size ({cap}; tok/s): " + "; ".join(cells)

    def summary(self) -> str:
        b = self.best
        return (
            f"SSD plan: K={b.k}, budget={b.budget}, glue={b.glue}: predicted {b.tokens_per_s:.2f} tok/s "
            f"(hit rate {b.hit_rate:.2f}, {b.tokens_per_round:.2f} tokens a round, build/verify "
            f"{b.build_s * 1e3:.0f}/{b.verify_s * 1e3:.0f} ms{self._link()}); SD at its best K={self.sd_k}: "
            f"{self.sd_tokens_per_s:.2f} tok/s, AR {self.ar_tokens_per_s:.2f} tok/s{self._wide()}; acceptance a={self.agreement.a:.2f} "
            f"over {self.agreement.positions} positions"
        )


def tokens_per_round(a: float, k: int) -> float:
    """E[accepted + 1] under the capped geometric law: sum_{i=0..K} a^i."""
    return sum(a**i for i in range(k + 1))


def hit_rate(agreement: Agreement, fanout: Sequence[int]) -> float:
    """P(the outcome is cached) for the schedule F_0..F_K."""
    k = len(fanout) - 1
    pmf = acceptance_lengths_pmf(agreement.a, k)
    return sum(p * agreement.hit(f, bonus=i == k) for i, (p, f) in enumerate(zip(pmf, fanout)))


def predict(costs: Costs, agreement: Agreement, k: int, budget: int, glue: str, r: float = 1.0,
            link_s: float = 0.0) -> Prediction:
    """Modelled SSD speed at (K, budget, glue) with the geometric schedule the speculator starts from;
    `link_s`: the link's round trip, which every round adds (the outcome out, the next proposal back)."""
    p, e = _hits_and_tokens(agreement, k, budget, glue, r)
    verify_s, build_s, backup_s = costs.verify(k), costs.build(k, budget), costs.backup(k)
    speed = ssd_speed_from(p, e, e, verify_s, backup_s, build_s, costs.ar_step_s)
    return Prediction(k, budget, glue, e / (speed.round_s + link_s), p, e, verify_s, build_s, backup_s, link_s)


def _hits_and_tokens(agreement: Agreement, k: int, budget: int, glue: str, r: float) -> tuple[float, float]:
    """(hit rate, tokens a round) for the geometric schedule the speculator starts from."""
    a = agreement.a
    fanout = geometric_fanout(a, r, k, budget)
    e = tokens_per_round(a, k)
    if glue == "fold" and k >= 2:  # a round after a bonus-branch hit verifies K - 1 drafts
        after_bonus = a**k * agreement.hit(fanout[-1], bonus=True)
        e = (1 - after_bonus) * e + after_bonus * tokens_per_round(a, k - 1)
    return hit_rate(agreement, fanout), e


def predict_rows(costs: Costs, rows_costs: RowCosts, agreement: Agreement, k: int, budget: int, glue: str,
                 rows: int, r: float = 1.0, link_s: float = 0.0) -> float:
    """Modelled SSD tokens/s of `rows` rows at (K, per-row budget, glue): the module's SSD(b)."""
    p, e = _hits_and_tokens(agreement, k, budget, glue, r)
    build = costs.build(k, rows * budget)  # a lockstep step packs every row's branches into one forward
    speed = ssd_rows_speed(p, e, rows, rows_costs.verify_s(rows, k + 1), build, rows_costs.chain_s(rows, k),
                           rows_costs.verify_s(rows, 1))
    return rows * e / (speed.round_s + link_s)


def plan_rows(costs: Costs, rows_costs: RowCosts, agreement: Agreement, best: Prediction,
              sizes: Sequence[int] = DEFAULT_ROWS, r: float = 1.0) -> tuple[list[RowsChoice], int | None]:
    """The branches a batch shares (fanout.batch_budget: None, or a cap that leaves each of b
    rows about cap / b) that serves every batch size best, and each size's speed under it.

    One cap for all sizes, as the speculator applies it: the one whose speeds, each over
    the best that size could reach with any per-row budget, sum highest (ties: no cap)."""
    budgets = [b for b in DEFAULT_BUDGETS if b < best.budget] + [best.budget]
    speed = {(rows, b): predict_rows(costs, rows_costs, agreement, best.k, b, best.glue, rows, r, best.link_s)
             for rows in sizes for b in budgets}
    top = {rows: max(speed[(rows, b)] for b in budgets) for rows in sizes}

    def under(cap: int | None, rows: int) -> int:
        return best.budget if cap is None else min(best.budget, max(1, cap // rows))

    # a cap below the single-row budget would undo the single-row plan
    caps = [None] + sorted({rows * b for rows in sizes for b in budgets if best.budget <= rows * b < rows * best.budget})
    cap = max(caps, key=lambda c: sum(speed[(rows, under(c, rows))] / top[rows] for rows in sizes))
    return [RowsChoice(rows, under(cap, rows), speed[(rows, under(cap, rows))], rows / rows_costs.verify_s(rows, 1))
            for rows in sizes], cap


def _lerp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, extrapolated from the end pairs."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0]  # one point: proportional
    i = min(max(bisect.bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _bilinear(table: dict[tuple[int, int], float], rows: int, n: int) -> float:
    if (rows, n) in table:
        return table[(rows, n)]
    sizes = sorted({b for b, _ in table})
    at_n = [(b, _lerp(sorted((m, s) for (bb, m), s in table.items() if bb == b), n)) for b in sizes]
    return max(_lerp(at_n, rows), min(table.values()) / 2)


def choose(
    costs_by_glue: dict[str, Costs], agreement: Agreement, ks: Sequence[int] = DEFAULT_KS,
    budgets: Sequence[int] = DEFAULT_BUDGETS, r: float = 1.0, rows_costs: RowCosts | None = None,
    sizes: Sequence[int] = DEFAULT_ROWS, link_s: float = 0.0,
) -> Plan:
    """Every (K, budget, glue) ranked by modelled tokens/s, against SD at its best K and AR."""
    if not costs_by_glue:
        raise ValueError("need the build costs of at least one glue kind")
    ranked = sorted(
        (predict(costs, agreement, k, b, glue, r, link_s) for glue, costs in costs_by_glue.items() for k in ks for b in budgets),
        key=lambda p: -p.tokens_per_s,
    )
    costs = next(iter(costs_by_glue.values()))
    sd = {k: tokens_per_round(agreement.a, k) / (costs.verify(k) + costs.backup(k)) for k in ks}
    sd_k = max(sd, key=sd.get)
    best = ranked[0]
    rows, cap = ([], None) if rows_costs is None else plan_rows(
        costs_by_glue[best.glue], rows_costs, agreement, best, sizes, r)
    return Plan(best, ranked, sd_k, sd[sd_k], 1.0 / costs.ar_step_s, agreement, rows=rows, batch_budget=cap)
