"""Batch-aware speculation policy from measured costs (pure: no model, no I/O).

At batch size b, one round of SSD verifies every row together. A round whose
rows all hit the cache takes max(verify, cache build); a round where any row
misses waits for that row's backup as well, so the whole batch stalls. With
hit rate p per row, no row misses with probability p^b, which falls fast as
b grows: at large batches almost every round pays for a backup, and a fast
low-quality backup (n-gram, random) can beat the neural one. In units of one
verification at batch b (T_p: cache build, T_b: backup, both / verify time):

    speedup(b) = [p E_hit + (1-p) E_miss] / [p^b max(1, T_p) + (1 - p^b)(1 + T_b)]

E_hit, E_miss: expected tokens per row per round after a hit or a miss (the
latter depends on the backup). The critical batch size b* is the smallest b
at which the fast backup's speedup reaches the neural backup's; past it the
fast backup is the better choice, and `backup_policy` turns b* into the
speculation.backup_policy setting.

Separately, speculation itself stops paying at large batches, where the
verification becomes compute bound and K + 1 tokens per row cost nearly
K + 1 times one token: `choose_k` picks the draft length (0: plain AR) with
the most tokens per second from a measured verify-cost curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

BatchCost = Callable[[int], float]  # batch size -> seconds
VerifyCost = Callable[[int, int], float]  # (batch size, tokens per row) -> seconds
DraftCost = Callable[[int, int], float]  # (batch size, K) -> seconds to draft K tokens per row


@dataclass(frozen=True)
class BackupProfile:
    """What one backup kind costs and yields, as measured."""

    kind: str  # "neural" | "ngram" | "random"
    seconds: BatchCost  # its time per round at batch size b (the missed rows' drafting)
    e_miss: float  # expected tokens per row per round when a miss is served by it


@dataclass(frozen=True)
class SSDProfile:
    """Measured SSD costs that do not depend on the backup."""

    k: int  # drafted tokens per round: a verification scores K + 1 tokens per row
    verify_s: VerifyCost
    build_s: BatchCost  # cache build time per round at batch size b
    hit_rate: float  # p: chance a row's outcome is in its cache
    e_hit: float  # expected tokens per row per round after a hit


def batch_speedup(p: float, e_hit: float, e_miss: float, t_p: float, t_b: float, b: int) -> float:
    """The batch formula above; t_p and t_b in units of one verification."""
    _check_prob(p)
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got {b}")
    no_miss = p**b
    tokens = p * e_hit + (1.0 - p) * e_miss
    return tokens / (no_miss * max(1.0, t_p) + (1.0 - no_miss) * (1.0 + t_b))


def speedup_at(profile: SSDProfile, backup: BackupProfile, b: int) -> float:
    """speedup(b) with the measured costs expressed in verifications at batch b."""
    verify = profile.verify_s(b, profile.k + 1)
    return batch_speedup(
        profile.hit_rate, profile.e_hit, backup.e_miss,
        profile.build_s(b) / verify, backup.seconds(b) / verify, b,
    )


def critical_batch_size(
    profile: SSDProfile, fast: BackupProfile, neural: BackupProfile, max_batch: int
) -> int | None:
    """b*: the smallest b <= max_batch where the fast backup's speedup reaches
    the neural backup's, or None if it never does there.

    With p = 1 no row ever misses, both speedups are equal and b* = 1 (the
    backup never runs, so the cheaper one may as well be chosen).
    """
    for b in range(1, max_batch + 1):
        fast_s, neural_s = speedup_at(profile, fast, b), speedup_at(profile, neural, b)
        if fast_s >= neural_s or math.isclose(fast_s, neural_s, rel_tol=1e-12):
            return b
    return None


def backup_policy(b_star: int | None, fast: str = "ngram", neural: str = "neural") -> dict[int, str]:
    """speculation.backup_policy for a critical batch size: neural below b*,
    fast from b* on; neural always when there is no b*. The neural rule is
    explicit so the policy does not depend on speculation.backup."""
    if b_star is None:
        return {1: neural}
    if b_star < 1:
        raise ValueError(f"b* must be >= 1, got {b_star}")
    return {1: fast} if b_star == 1 else {1: neural, b_star: fast}


def expected_tokens_sd(a: float, k: int) -> float:
    """E_SD = (1 - a^(K+1)) / (1 - a): tokens per row per SD round (K + 1 at a = 1)."""
    _check_prob(a)
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def sd_throughput(verify_s: VerifyCost, draft_s: DraftCost, a: float, b: int, k: int) -> float:
    """Tokens per second of the whole batch with draft length K (K = 0: AR, no draft)."""
    cost = verify_s(b, k + 1) + (draft_s(b, k) if k else 0.0)
    return b * expected_tokens_sd(a, k) / cost


def choose_k(verify_s: VerifyCost, draft_s: DraftCost, a: float, b: int, k_max: int) -> int:
    """The draft length with the most tokens per second at batch size b; 0 turns
    speculation off (plain AR). AR is a candidate, so the choice never has less
    throughput than AR; ties go to the smaller K (less work for the same speed)."""
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    rates = [sd_throughput(verify_s, draft_s, a, b, k) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


def k_by_batch(
    verify_s: VerifyCost, draft_s: DraftCost, a: float, batch_sizes: list[int], k_max: int
) -> dict[int, int]:
    """choose_k for each batch size: the draft length to run at that size."""
    return {b: choose_k(verify_s, draft_s, a, b, k_max) for b in batch_sizes}


def _check_prob(x: float) -> None:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {x!r}")
