"""The start-up plan: the K, fan-out budget and glue that make SSD fastest here.

Pure math over measured numbers (no model, no I/O): what one round costs on
this host (ssd.ablation.costs.Costs, one per glue kind) and how the draft
agrees with the target (`Agreement`). The speed model is the paper's
(Kumar, Dao, May: Speculative Speculative Decoding, arXiv 2603.03251) in
seconds, as ssd.ablation.speed writes it:

  SSD tokens/s = E / [p T_hit + (1 - p)(T_backup + T_hit)],  T_hit = max(T_verify, T_build)

with E the tokens a round yields under the capped geometric acceptance law
(sum_{i<=K} a^i) and p the chance that the verification outcome (k, t*) was
cached: P(k) times the chance that t* ranks within the draft's top F_k, read
off the measured ranks (`Agreement.hit`) rather than a fitted law. The
folded glue saves a draft forward but its bonus branches draft K - 1 tokens,
so a round after a bonus-branch hit yields E(K - 1): the plan weighs both.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from ssd.ablation.costs import Costs
from ssd.ablation.speed import ssd_speed_from
from ssd.saguaro.fanout import acceptance_lengths_pmf, geometric_fanout

DEFAULT_KS = tuple(range(1, 7))
DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16)


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

    @property
    def build_over_verify(self) -> float:
        return self.build_s / self.verify_s


@dataclass
class Plan:
    best: Prediction
    ranked: list[Prediction]  # best first
    sd_k: int
    sd_tokens_per_s: float
    ar_tokens_per_s: float
    agreement: Agreement
    meta: dict = field(default_factory=dict)

    @property
    def beats_sd(self) -> bool:
        return self.best.tokens_per_s > self.sd_tokens_per_s

    def summary(self) -> str:
        b = self.best
        return (
            f"SSD plan: K={b.k}, budget={b.budget}, glue={b.glue}: predicted {b.tokens_per_s:.2f} tok/s "
            f"(hit rate {b.hit_rate:.2f}, {b.tokens_per_round:.2f} tokens a round, build/verify "
            f"{b.build_s * 1e3:.0f}/{b.verify_s * 1e3:.0f} ms); SD at its best K={self.sd_k}: "
            f"{self.sd_tokens_per_s:.2f} tok/s, AR {self.ar_tokens_per_s:.2f} tok/s; acceptance a={self.agreement.a:.2f} "
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


def predict(costs: Costs, agreement: Agreement, k: int, budget: int, glue: str, r: float = 1.0) -> Prediction:
    """Modelled SSD speed at (K, budget, glue) with the geometric schedule the speculator starts from."""
    a = agreement.a
    fanout = geometric_fanout(a, r, k, budget)
    p = hit_rate(agreement, fanout)
    e = tokens_per_round(a, k)
    if glue == "fold" and k >= 2:  # a round after a bonus-branch hit verifies K - 1 drafts
        after_bonus = a**k * agreement.hit(fanout[-1], bonus=True)
        e = (1 - after_bonus) * e + after_bonus * tokens_per_round(a, k - 1)
    verify_s, build_s, backup_s = costs.verify(k), costs.build(k, budget), costs.backup(k)
    speed = ssd_speed_from(p, e, e, verify_s, backup_s, build_s, costs.ar_step_s)
    return Prediction(k, budget, glue, speed.tokens_per_s, p, e, verify_s, build_s, backup_s)


def choose(
    costs_by_glue: dict[str, Costs], agreement: Agreement, ks: Sequence[int] = DEFAULT_KS,
    budgets: Sequence[int] = DEFAULT_BUDGETS, r: float = 1.0,
) -> Plan:
    """Every (K, budget, glue) ranked by modelled tokens/s, against SD at its best K and AR."""
    if not costs_by_glue:
        raise ValueError("need the build costs of at least one glue kind")
    ranked = sorted(
        (predict(costs, agreement, k, b, glue, r) for glue, costs in costs_by_glue.items() for k in ks for b in budgets),
        key=lambda p: -p.tokens_per_s,
    )
    costs = next(iter(costs_by_glue.values()))
    sd = {k: tokens_per_round(agreement.a, k) / (costs.verify(k) + costs.backup(k)) for k in ks}
    sd_k = max(sd, key=sd.get)
    return Plan(ranked[0], ranked, sd_k, sd[sd_k], 1.0 / costs.ar_step_s, agreement)
