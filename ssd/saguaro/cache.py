"""The speculation cache: verification outcome (k, t*) -> the next speculation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftWork:
    """The draft's forwards behind a proposal d_1..d_m that followed t (the
    last committed token), kept so that the next cache build need not redo
    them (ssd.saguaro.builder): `logits`, the m rows after t and after each
    of d_1..d_{m-1}; their keys and values sit at `indices`, uncommitted
    entries of the draft's cache (a tree branch), or, with None, the cache
    already holds ... t, d_1..d_{m-1} as committed tokens (a backup chain).
    Draft-side only: never sent to the target.
    """

    logits: list[torch.Tensor]  # m rows [V], on the draft's device
    indices: list[int] | None = None


@dataclass
class Proposal:
    """K proposed tokens and the exact distributions they were drawn from.

    q is None under greedy decoding and coupled sampling, where verification needs no q.
    """

    tokens: list[int]
    q: torch.Tensor | None  # [K, V]
    source: str  # "cache" or the backup that made it: "neural" | "ngram" | "random"
    work: DraftWork | None = field(default=None, repr=False, compare=False)


class SpeculationCache:
    """Per-sequence map (k, t*) -> Proposal; replaced whole every round."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], Proposal] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._entries

    def outcomes(self) -> list[tuple[int, int]]:
        """The (k, t*) outcomes prepared, in build order."""
        return list(self._entries)

    def lookup(self, k: int, token: int) -> Proposal | None:
        return self._entries.get((k, token))

    def replace(self, entries: dict[tuple[int, int], Proposal]) -> None:
        """Install the speculations built for the outcome now being verified."""
        self._entries = entries
