"""Speculative decoding for every row: K batched draft steps, one batched
target verification, and the shared verification routine accepts a prefix
per row."""

from __future__ import annotations

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.batch import BatchedEngine
from ssd.engine.proposers import Proposal
from ssd.engine.rows import Row, SequenceState, Verifier
from ssd.engine.drafting import Chain, draft_chains
from ssd.models.backend import Model, forward_rows
from ssd.models.tokenizer import Tokenizer
from ssd.verify import verify


class SDEngine(BatchedEngine):
    mode = "sd"

    def __init__(
        self,
        target: Model,
        draft: Model | None,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
    ) -> None:
        """`speculation`: the settings (K, k_policy) for requests that bring none of their own.
        `draft` None: no draft model; every round drafts nothing, and prompt lookup
        (speculation.prompt_lookup) is its only speculation."""
        super().__init__(target, tokenizer, speculation, batching, verifier, draft)

    def _round_cost(self, row: Row) -> int:
        return max(self._draft_length(row), self.lookup.room(row)) + 1

    def _draft_length(self, row: Row) -> int:
        """K for this row at the current batch size (speculation.k_policy; 0: a plain
        target step), never past max_new_tokens."""
        if self.draft_model is None:
            return 0
        k = row.state.speculation.k_for(len(self.scheduler.rows))
        return min(k, draft_length(row.state))

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        if self.draft_model is None:
            return
        forward_rows([row.draft for row, _ in chunks], [ids for _, ids in chunks], last_only=True)

    def _draft(self, rows: list[Row]) -> None:
        if self.draft_model is None:
            return
        for row in rows:
            state = row.state
            row.chain = Chain(row.draft, state.sequence, self._draft_length(row), state.sampling, state.gen,
                              processor=state.processor)
        draft_chains([row.chain for row in rows])
        for row in rows:
            row.error = row.chain.error

    def _proposal(self, row: Row) -> Proposal | None:
        return None if row.chain is None else Proposal(row.chain.tokens, row.chain.q_rows)


def draft_length(req: SequenceState) -> int:
    """Tokens to draft this round: never past max_new_tokens, since the round adds up to K + 1."""
    return min(req.speculation.k, req.output.remaining - 1)
