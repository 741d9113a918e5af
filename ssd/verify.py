"""The one verification routine, used by SD and SSD alike.

Given K drafted tokens, the draft distributions q they were drawn from and the
target distributions p at the K+1 positions (after the sampling pipeline), it
returns the outcome (k, t*): k accepted tokens and the one token the target
adds — a correction drawn from norm(max(0, p - q)) after a rejection, or a
bonus token drawn from p at position K+1 when every draft passed. The output is
distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ssd.sampling import sample, uniform

# A residual with less mass than this is rounding noise: it only arises when
# p <= q everywhere, i.e. p == q up to rounding, where rejection has
# probability ~0 and the exact conditional law of the correction is p itself.
RESIDUAL_EPS = 1e-12


class ProposerError(RuntimeError):
    """A drafted token had zero probability under the q it was said to come from."""


@dataclass(frozen=True)
class Outcome:
    k: int  # number of drafted tokens accepted, 0..K
    token: int  # correction (k < K) or bonus (k == K) token from the target

    def tokens(self, drafted: Sequence[int]) -> list[int]:
        """The tokens this round appends: the accepted prefix, then t*."""
        return [*drafted[: self.k], self.token]


def verify(
    drafted: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    gen: torch.Generator,
    greedy: bool = False,
) -> Outcome:
    """Outcome of verifying `drafted` (K ids) with q [K, V] and p [K+1, V].

    greedy: p rows are one-hot argmaxes; accept while the draft matches them.
    q is then not needed (None is allowed), and no random numbers are drawn.
    """
    if greedy:
        _check_shapes(drafted, q, p)
        return _verify_greedy(drafted, p)
    if q is None:
        raise ValueError("stochastic verification needs the draft distributions q")
    _check_shapes(drafted, q, p)
    for i, x in enumerate(drafted):
        qx, px = float(q[i, x]), float(p[i, x])
        if qx <= 0.0:
            raise ProposerError(f"drafted token {x} at position {i} has q = {qx}")
        if uniform(gen) * qx < px:  # accept with probability min(1, p/q)
            continue
        return Outcome(i, sample(residual(p[i], q[i]), gen))
    return Outcome(len(drafted), sample(p[-1], gen))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), falling back to p when the residual is rounding noise."""
    r = torch.clamp(p - q, min=0.0)
    mass = float(r.sum())
    return r / mass if mass > RESIDUAL_EPS else p


def _verify_greedy(drafted: Sequence[int], p: torch.Tensor) -> Outcome:
    best = p.argmax(dim=-1).tolist()
    for i, x in enumerate(drafted):
        if x != best[i]:
            return Outcome(i, best[i])
    return Outcome(len(drafted), best[-1])


def _check_shapes(drafted: Sequence[int], q: torch.Tensor | None, p: torch.Tensor) -> None:
    k = len(drafted)
    q_ok = q is None or (q.shape[0] == k and q.shape[-1] == p.shape[-1])
    if not q_ok or p.shape[0] != k + 1:
        raise ValueError(
            f"verify expects q [K, V] and p [K+1, V] for K={k}, "
            f"got q {None if q is None else tuple(q.shape)} and p {tuple(p.shape)}"
        )
