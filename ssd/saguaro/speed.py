"""Modelled decoding speed from round statistics and measured costs: the start-up
plan (ssd.saguaro.plan) and the ablations (ssd.tools.ablation) both use it.

The paper (Kumar, Dao, May: Speculative Speculative Decoding, arXiv 2603.03251),
in units of one verification:
  SD speedup over AR  = E_SD / (1 + T_SD)
  SSD speedup over AR = [p E_hit + (1-p) E_miss] / [p max(1, T_p) + (1-p)(1 + T_b)]
Here the same in seconds, which also covers a verification of K + 1 tokens
costing more than one AR step:
  AR  tokens/s = 1 / T_ar
  SD  tokens/s = E_SD / (T_verify(K) + T_backup(K))
  SSD tokens/s = [p E_hit + (1-p) E_miss] / [p T_hit + (1-p) T_miss]
  with T_hit = max(T_verify, T_build) (the draft builds while the target
  verifies) and T_miss = T_backup + max(T_verify, T_build). The paper writes
  T_miss = T_verify + T_backup, which is the same whenever the build fits in
  a verification; when it does not, the next round waits for the build
  after a miss too, and that wait is counted here.
p is the lookup hit rate; E_hit and E_miss are tokens per round after a hit
and after a miss (equal under greedy, apart from truncated last rounds).
"""

from __future__ import annotations

from dataclasses import dataclass

from ssd.saguaro.costs import Costs


@dataclass(frozen=True)
class Speed:
    tokens_per_s: float
    speedup_vs_ar: float
    round_s: float  # expected seconds per round


def ar_speed(costs: Costs) -> Speed:
    return Speed(1.0 / costs.ar_step_s, 1.0, costs.ar_step_s)


def sd_speed(tokens_per_round: float, k: int, costs: Costs) -> Speed:
    round_s = costs.verify(k) + costs.backup(k)
    tps = tokens_per_round / round_s
    return Speed(tps, tps * costs.ar_step_s, round_s)


def ssd_speed_from(
    p: float, e_hit: float, e_miss: float, verify_s: float, backup_s: float, build_s: float, ar_step_s: float,
) -> Speed:
    """The formula itself, on plain numbers (seconds)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"hit rate p must be in [0, 1], got {p}")
    hit_s = max(verify_s, build_s)
    miss_s = backup_s + hit_s
    round_s = p * hit_s + (1 - p) * miss_s
    tps = (p * e_hit + (1 - p) * e_miss) / round_s
    return Speed(tps, tps * ar_step_s, round_s)


def ssd_rows_speed(
    p: float, e: float, rows: int, verify_s: float, build_s: float, backup_s: float, ar_step_s: float,
) -> Speed:
    """SSD over `rows` rows in lockstep (ssd.saguaro.plan's SSD(b)): one packed verification and one
    packed build per round, and a backup chain (all rows' at once) whenever any row missed:
      tokens/s = rows E / [max(T_verify(b), T_build(K, b F)) + (1 - p^b) T_backup(b)]
    with every time the batched one; `ar_step_s` is AR's step at the same rows."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"hit rate p must be in [0, 1], got {p}")
    round_s = max(verify_s, build_s) + (1 - p**rows) * backup_s
    tps = rows * e / round_s
    return Speed(tps, tps * ar_step_s / rows, round_s)
