"""Forced acceptance for benchmarks (vLLM's synthetic acceptance rate, in our verifier slot).

A draft with random weights almost never agrees with a random target, so
its acceptance says nothing; a benchmark of speculation's *costs* at a given
acceptance forces it instead. `ForcedAcceptance` is a verifier
(ssd.engine.rows.Verifier) the bench hands to an engine in place of
ssd.verify.verify: it first runs the real routine on the round (so the
round's device work and host reads are the production ones), then replaces
its outcome: position i of the draft is accepted with probability
`rate` (independently, until the first rejection, as vLLM's
synthetic_acceptance_rate does), and t* is the target's own choice at the
stopping position (greedy: its argmax; sampled: a draw from its p row).

It lives only here: the production verifier has no flag for it, so nothing
on the serving path can turn it on, and its cost there is nil. A forced
round costs the production round plus, where the forced outcome differs
from the real one, one argmax or draw on the stopping row and one read of
its id. Outputs under
forcing are not the target's law (drafted tokens are kept whatever p says);
a forced run is timed, never checked for exactness.

`ForcedRanks` does for SSD's cache hits what `ForcedAcceptance` does for
acceptance: a draft with random weights guesses t* no better than chance,
so the draft side (a Speculator the bench serves in place of the real one)
replaces each round's t* by its own rank-r guess at the round's k, r drawn
from a rank law (the real pair's, ssd.tools.bench.rank_law): a hit when its
build prepared that guess, a miss (a backup) when not. The two sides then
hold different tokens at that position, which only the forced run's timing
sees: the lengths, and so every cost, stay the target's.

The forced law has its own seeded generator, so a forced run's acceptance is
reproducible and independent of the requests' sampling streams.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Sequence

import torch

from ssd.sampling import Draws
from ssd.saguaro.plan import Agreement
from ssd.saguaro.speculator import DraftSequence, Speculator
from ssd.transport.channel import Channel
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)


class ForcedAcceptance:
    """A verifier whose acceptance is Bernoulli(`rate`) per drafted position."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"forced acceptance rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.gen = torch.Generator().manual_seed(seed)
        self.drafted = 0  # positions offered for the law (up to and including the first rejection)
        self.accepted = 0

    def __call__(self, drafted: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, gen: Draws,
                 greedy: bool = False) -> Outcome:
        real = verify(drafted, q, p, gen, greedy=greedy)  # the production work stays on the round
        k = self.forced_k(len(drafted))
        if k == real.k:
            return real
        return Outcome(k, target_choice(p[k], greedy))

    def forced_k(self, n: int) -> int:
        """Accepted positions of `n` drafted: the first failure of Bernoulli(rate) trials."""
        if n == 0:
            return 0
        passed = torch.rand(n, generator=self.gen) < self.rate
        k = n if bool(passed.all()) else int(passed.to(torch.int8).argmin())
        self.drafted += min(k + 1, n)
        self.accepted += k
        return k

    @property
    def measured_rate(self) -> float:
        """accepted / positions tried: an estimate of `rate` (a rejection's position counts as tried)."""
        return self.accepted / self.drafted if self.drafted else math.nan


def target_choice(p_row: torch.Tensor, greedy: bool) -> int:
    """The target's token from its distribution row: its argmax, or one draw from it, made where the
    row is (a GPU row is not copied to the host: at a 152k vocabulary that copy would cost a
    forced round more than the production one), then one read of the id."""
    if greedy:
        return int(p_row.argmax())
    return int(torch.multinomial(p_row.float().clamp(min=0.0), 1))


def honoured(measured: float, rate: float, positions: int, sigmas: float = 4.0) -> bool:
    """Whether a measured per-position acceptance is the forced `rate` within `sigmas` binomial
    standard errors over `positions` tried (a forcing that does not hold fails this)."""
    if positions <= 0 or math.isnan(measured):
        return False
    return abs(measured - rate) <= sigmas * math.sqrt(rate * (1 - rate) / positions)


class ForcedRanks(Speculator):
    """A Speculator whose rounds' t* is its own guess of the law's rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, channel: Channel, law: Agreement, seed: int = 0) -> None:
        if not law.ranks_rejected or not law.ranks_bonus:
            raise ValueError("a rank law needs ranks after rejections and after full acceptance")
        super().__init__(model, channel)
        self.law = law
        self.rng = random.Random(seed)  # the speculator's thread alone draws from it

    def _commit(self, seq: DraftSequence, k: int, token: int):
        if seq.in_flight is not None:  # the first round follows the prefill: no guesses were built
            token = self.forced_token(seq, k, token)
        return super()._commit(seq, k, token)

    def forced_token(self, seq: DraftSequence, k: int, token: int) -> int:
        """The draft's rank-r guess of t* at acceptance length k, r from the law; where the build did
        not prepare that rank, a token it did not prepare (so the lookup misses)."""
        bonus = k == len(seq.in_flight.tokens)
        rank = self.rng.choice(self.law.ranks_bonus if bonus else self.law.ranks_rejected)
        built = [t for kk, t in seq.cache.outcomes() if kk == k and seq.cache.lookup(kk, t).source == "cache"]
        if rank < len(built):  # the build's guesses at k are in the draft's rank order
            return built[rank]
        held = {t for kk, t in seq.cache.outcomes() if kk == k}
        if token not in held:
            return token
        return next(t for t in range(self.vocab_size) if t not in held and (bonus or t != seq.in_flight.tokens[k]))
