"""K follows the measured round: the target picks each round's draft length.

A fixed K (the config's or the start-up plan's) is right for one round time
and one acceptance rate; both move within a request (code vs prose, a busy
core) and across requests. This controller keeps, from the rounds the target
has verified:
- a: the per-token acceptance, the maximum-likelihood rate of the capped
  geometric law (a round accepting k of K drafts counts k successes and,
  when k < K, one failure), with old rounds decaying (DECAY per round);
- t(K): the seconds of a round at each K tried (the target's wait for the
  proposal plus its verification: a miss's backup and a build that overran
  show up there), an exponential average per K.
A round at K yields E[tokens] = (1 - a^(K+1)) / (1 - a) (the accepted drafts
and the target's own token; Leviathan et al. 2023), so its rate is
E[tokens](K) / t(K). Every `every` rounds it compares K with K - 1 and K + 1
and moves to the best of them only when that is better by `margin`
(hysteresis). A K not yet timed is predicted from the nearest timed one,
each extra drafted token costing `token_share` of a round of K (verification
of K + 1 tokens; and the draft's build that must fit beside it).

Exactness: K is chosen before a round from past rounds' outcomes only, so a
round's drafts and their verification are those of a fixed-K round (tests:
test_adaptive_k). Pure Python, no model and no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.97  # weight of the past per observed round: about the last 30 rounds count
TIME_WEIGHT = 0.2  # exponential average of a K's round time


@dataclass
class KController:
    """The draft length for the next rounds, within [1, max_k]. One per target engine."""

    k: int
    max_k: int
    every: int = 8  # rounds between decisions
    margin: float = 0.03  # a neighbour must be this much faster to move to it
    token_share: float = 0.15  # an untimed K's extra token: this share of a timed round
    prior_a: float = 0.7
    _successes: float = field(default=0.0, init=False)
    _failures: float = field(default=0.0, init=False)
    _round_s: dict[int, float] = field(default_factory=dict, init=False)
    _since: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.max_k:
            raise ValueError(f"need 1 <= k <= max_k, got k={self.k}, max_k={self.max_k}")
        self._successes, self._failures = 2 * self.prior_a, 2 * (1 - self.prior_a)

    @property
    def a(self) -> float:
        return self._successes / (self._successes + self._failures)

    def next_k(self) -> int:
        """The K of the next round."""
        return self.k

    def observe(self, drafted: int, accepted: int, round_s: float) -> None:
        """One verified round: `accepted` of `drafted` drafts passed, the round took `round_s`."""
        if drafted <= 0:
            return
        self._successes = self._successes * DECAY + accepted
        self._failures = self._failures * DECAY + (1 if accepted < drafted else 0)
        if round_s > 0:
            old = self._round_s.get(drafted)
            self._round_s[drafted] = round_s if old is None else old + TIME_WEIGHT * (round_s - old)
        self._since += 1
        if self._since >= self.every and self.k in self._round_s:
            self._since = 0
            self.k = self._best()

    def rate(self, k: int) -> float:
        """Predicted tokens per second at K = k."""
        return expected_tokens(self.a, k) / self.round_s(k)

    def round_s(self, k: int) -> float:
        """A round's seconds at K = k: measured, else from the nearest timed K."""
        if k in self._round_s:
            return self._round_s[k]
        nearest = min(self._round_s, key=lambda timed: (abs(timed - k), timed))
        base = self._round_s[nearest]
        return max(base * (1 + self.token_share * (k - nearest)), 1e-9)

    def _best(self) -> int:
        here = self.rate(self.k)
        candidates = [k for k in (self.k - 1, self.k + 1) if 1 <= k <= self.max_k]
        best = max(candidates, key=self.rate, default=self.k)
        return best if self.rate(best) > here * (1 + self.margin) else self.k


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round of k drafts adds at per-token acceptance a: (1 - a^(k+1)) / (1 - a)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)
