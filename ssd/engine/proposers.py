"""Prompt lookup as a proposer: on rounds that draft nothing (K 0 at this batch size, no draft,
a draft lost), a row proposes what its own text predicts (ssd.engine.lookup: the longest
recent n-gram match, vLLM's prompt lookup), verified like any speculation with a one-hot q.

How many tokens are worth proposing follows two measures: what one more scored token adds
to a forward (StepCost, from the engine's forwards) and how often lookups after a match of
each length are accepted (LookupOdds). The engine asks `room` and `propose` for each
decoding row whose drafter proposed nothing, and reports each verified lookup (`settled`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch

from ssd.engine.lookup import NGRAM_WINDOW, LookupOdds, StepCost, best_length, prompt_lookup
from ssd.engine.rows import Row


class Proposal(NamedTuple):
    """One row's speculation for a round, from any proposer (SD's chain, SSD's cached or
    backup proposal, a prompt lookup): its tokens and the proposer's q, one row per token
    (a tensor or a list of rows; None where the proposer has none)."""

    tokens: Sequence[int]
    q: torch.Tensor | Sequence[torch.Tensor] | None = None

    def stacked_q(self) -> torch.Tensor | None:
        if self.q is None or isinstance(self.q, torch.Tensor):
            return self.q
        return torch.stack(list(self.q)) if len(self.q) else None


class PromptLookup:
    """Rows' prompt lookups and what the engine has learned of their worth."""

    def __init__(self) -> None:
        self.step_cost = StepCost()  # seconds a scored token adds to a forward
        self.odds: dict[int, LookupOdds] = {}  # acceptance of lookups by match length

    @staticmethod
    def room(row: Row) -> int:
        """The most tokens the row's prompt lookup may propose in a round (0: it has none)."""
        spec = row.state.speculation
        if spec is None:
            return 0
        return max(0, min(spec.lookup_ceiling, row.state.output.remaining - 1, row.round_tokens - 1))

    def propose(self, row: Row, room: int, token_cost: float, rows: int) -> None:
        """The row's lookup: as many of the predicted tokens as lookups after a match of its
        length are accepted and a token's cost make worth it, with `rows` in the step."""
        spec = row.state.speculation.prompt_lookup
        # A prediction is searched whole, as text before the window of the text so far, however long
        # the text grows (0.25 ms a round for an 8k-token prediction, measured on this host).
        context = [*(row.state.request.prediction or ()), *row.state.sequence[-NGRAM_WINDOW:]]
        n, follow = prompt_lookup(context, room, spec.max_n, spec.min_n, window=len(context))
        if n:
            odds = self.odds.setdefault(n, LookupOdds.after_match(n))
            row.lookup, row.lookup_match = follow[: best_length(odds.rate, token_cost, len(follow), rows)], n

    def forget_unproposed(self, rows: Iterable[Row]) -> None:
        """Match lengths that proposed nothing this step forget toward their prior."""
        rows = list(rows)
        proposed = {row.lookup_match for row in rows if row.lookup}
        for n in {row.lookup_match for row in rows if row.lookup_match} - proposed:
            self.odds[n].record(0, 0)

    def settled(self, row: Row, accepted: int) -> None:
        """A verified lookup of the row: `accepted` of its tokens were kept."""
        self.odds[row.lookup_match].record(len(row.lookup), accepted)
