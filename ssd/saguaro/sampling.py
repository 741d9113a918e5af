"""Saguaro sampling: the draft's proposal reshaped so the target's corrections
land on cached outcomes more often. Pure math on probability rows; verification
stays exact because every speculation ships the q' its tokens were drawn from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Saguaro:
    """Saguaro sampling settings: rescale the top-F_j tokens at position j by c."""

    c: float
    fanout: Sequence[int]  # F_j for the position each drafted token fills

    def apply(self, q: torch.Tensor, position: int) -> torch.Tensor:
        """q' for one row [V]."""
        return self.apply_rows(q.unsqueeze(0), position)[0]

    def apply_rows(self, q: torch.Tensor, position: int) -> torch.Tensor:
        """q' for each row of [B, V], each on its own top-F tokens."""
        if self.c == 1.0 or position >= len(self.fanout):
            return q
        return saguaro_rescale_rows(q, self.fanout[position], self.c)


def saguaro_rescale_rows(q: torch.Tensor, f: int, c: float) -> torch.Tensor:
    """Saguaro sampling: per row of q [B, V], q' proportional to c*q on the
    row's top-f tokens (the draft's cached guesses for that position) and q
    elsewhere, 0 <= c <= 1.

    Lower c moves proposal mass off the cached tokens, so after a rejection the
    residual max(0, p - q') leans toward them and the cache hits more often,
    at some cost in acceptance. Verification must use q' itself. A row whose
    whole mass sits on its top-f with c == 0 would be 0/0: it keeps q.
    """
    if c == 1.0 or f <= 0:
        return q
    values, ids = torch.topk(q, min(f, q.shape[-1]), dim=-1)
    scale = torch.ones_like(q).scatter_(-1, ids, torch.where(values > 0, c, 1.0).to(q.dtype))
    out = q * scale
    mass = out.sum(dim=-1, keepdim=True)
    # Rows whose whole mass sat on the top-f with c == 0 keep q.
    return torch.where(mass > 0, out / mass.clamp_min(torch.finfo(q.dtype).tiny), q)
