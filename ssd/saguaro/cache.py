"""The speculation cache: verification outcome (k, t*) -> the next speculation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """K proposed tokens and the exact distributions they were drawn from.

    q is None under greedy decoding, where verification needs no q.
    """

    tokens: list[int]
    q: torch.Tensor | None  # [K, V]
    source: str  # "cache" or the backup that made it: "neural" | "ngram" | "random"


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
