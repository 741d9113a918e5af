"""Drafting a chain of K tokens with the draft model: plain SD's proposer and
SSD's neural backup, written once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.kv import KVSequence
from ssd.sampling import probs_from_logits, sample, saguaro_rescale_rows


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


def draft_chain(
    kv: KVSequence,
    sequence: Sequence[int],
    k: int,
    sampling: SamplingConfig,
    gen: torch.Generator,
    saguaro: Saguaro | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Draft k tokens after `sequence`; return them and the exact q rows they were drawn from.

    Whatever `kv` holds beyond its longest common prefix with `sequence` is
    dropped; afterwards it holds sequence + the first k-1 drafted tokens (the
    last is never fed). The q rows stay on the draft's device; each drafted
    id is read by the host once, since the next forward needs it.
    """
    if k == 0:
        return [], []
    kv.trim_to_prefix_of(sequence)
    logits = kv.catch_up(sequence)
    drafted: list[int] = []
    rows: list[torch.Tensor] = []
    for i in range(k):
        if i:
            logits = kv.forward([drafted[-1]])[-1]
        q = probs_from_logits(logits, sampling)
        if saguaro is not None and not sampling.greedy:
            q = saguaro.apply(q, i)
        drafted.append(sample(q, gen))
        rows.append(q)
    return drafted, rows
