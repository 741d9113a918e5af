"""The one verification routine, used by SD and SSD alike.

Given K drafted tokens, the draft distributions q they were drawn from and the
target distributions p at the K+1 positions (after the sampling pipeline), it
returns the outcome (k, t*): k accepted tokens and the one token the target
adds — a correction drawn from norm(max(0, p - q)) after a rejection, or a
bonus token drawn from p at position K+1 when every draft passed. The output is
distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).

Coupled sampling (a GumbelNoise in place of the generator) needs no ratio
test: the target's token at every position is its Gumbel-max under the
request's keyed noise, so a drafted token is accepted iff it is that token,
and t* is the target's token at the first mismatch (or the bonus). The
outcome is then the one AR sampling with the seed produces, whatever the
draft proposed (docs/exactness.md).

It runs where p is (the target's device): the K ratio tests are one gather
and one comparison, the first rejection one reduction, and the host reads
two small results per round, the stopping position and the drawn token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ssd.sampling import Draws, GumbelNoise, coupled_ids, sample, uniforms

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
    gen: Draws,
    greedy: bool = False,
) -> Outcome:
    """Outcome of verifying `drafted` (K ids) with q [K, V] and p [K+1, V].

    greedy: p rows are one-hot argmaxes; accept while the draft matches them.
    gen a GumbelNoise (coupled sampling, for the K + 1 positions of p's
    rows): accept while the draft matches the target's Gumbel-max tokens. In
    both, q is not needed (None is allowed, nor is its device looked at), and
    no generator is drawn from. Otherwise q must be on p's device.
    """
    if greedy:
        _check_shapes(drafted, q, p)
        return _verify_choices(drafted, p.argmax(dim=-1).tolist())
    if isinstance(gen, GumbelNoise):
        _check_shapes(drafted, q, p)
        best = coupled_ids(p, gen).tolist()
        if max(best) >= p.shape[-1]:
            raise ValueError("cannot verify against a row of p without probability mass")
        return _verify_choices(drafted, best)
    if q is None:
        raise ValueError("stochastic verification needs the draft distributions q")
    _check_shapes(drafted, q, p)
    if q.device != p.device:
        raise ValueError(f"q is on {q.device} but p is on {p.device}; move q to p's device")
    q = draft_law(q)
    k = _first_stop(drafted, q, p, gen)
    if k == len(drafted):
        return Outcome(k, sample(p[-1], gen))
    return Outcome(k, sample(_residual_weights(p[k], q[k]), gen))


def draft_law(q: torch.Tensor) -> torch.Tensor:
    """The distributions the drafted tokens were drawn from, in float64.

    A draft draws from its q rows as shipped (ssd.sampling.as_drawn:
    bfloat16), upcast to float64 (exact) and divided by the row's own sum
    (sampling's inverse CDF scales its uniform by the last CDF entry). A
    rounded row sums to 1 only up to its rounding (~2^-9 in bfloat16), so
    dividing by that sum here too is what makes the ratio test and the
    residual use the draft's law itself: the same upcast values over the
    same sum, to float64 rounding (~1e-16). float64 rows (made by the
    caller, not shipped) are taken as they are.
    """
    if q.dtype == torch.float64:
        return q
    q = q.to(torch.float64)
    return q / q.sum(dim=-1, keepdim=True)


def _first_stop(drafted: Sequence[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> int:
    """The first position whose draft is rejected (K if none is), in one host read.

    Position i accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)). All
    K uniforms are drawn at once; a position past the first rejection never
    counts, so neither its draw nor its q matters. A q_i(x_i) <= 0 at a
    reached position is a proposer bug (ProposerError); past the first
    rejection it is not looked at.
    """
    k = len(drafted)
    if k == 0:
        return 0
    ids = torch.tensor(drafted, dtype=torch.long).to(p.device, non_blocking=True)[:, None]
    qx, px = q.gather(1, ids)[:, 0], p[:k].gather(1, ids)[:, 0]
    u = uniforms(gen, k).to(p.device, non_blocking=True)
    q_ok = ~(qx <= 0)
    passed = q_ok & (u * qx < px)
    # Leading runs (cumprod of 0/1): the accepted prefix, and the prefix with q > 0.
    accepted, q_ok_run = torch.stack([passed, q_ok]).to(torch.uint8).cumprod(1).sum(1).tolist()
    if accepted < k and q_ok_run == accepted:  # the stop came from q <= 0, not a rejection
        x = drafted[accepted]
        raise ProposerError(f"drafted token {x} at position {accepted} has q = {float(q[accepted, x])}")
    return accepted


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), falling back to p when the residual is rounding noise.

    Rows of [..., V]; computed where p and q are, without a host read.
    """
    r = (p - q).clamp_(min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, r.div_(mass), p)  # a row's 0/0 is never picked


def _residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """One row's residual up to its normalisation, which sampling does anyway."""
    r = (p - q).clamp_(min=0.0)
    mass = r.sum()
    if r.device.type == "cpu":  # the host reads its own memory without a sync: no select pass
        return r if float(mass) > RESIDUAL_EPS else p
    return torch.where(mass > RESIDUAL_EPS, r, p)


def _verify_choices(drafted: Sequence[int], best: list[int]) -> Outcome:
    """Accept while the draft matches the target's own K + 1 choices `best`
    (greedy: argmax; coupled: Gumbel-max), then take the target's choice.
    One argmax where p is and one host read of its K + 1 ids (the caller's);
    comparing them with the (host) drafted ids needs no upload of the draft."""
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
