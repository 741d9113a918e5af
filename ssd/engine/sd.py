"""Speculative decoding for every row: K batched draft steps, one batched
target verification, and the shared verification routine accepts a prefix
per row."""

from __future__ import annotations

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.batch import BatchedEngine, Row, SequenceState, Verifier
from ssd.engine.drafting import Chain, draft_chains
from ssd.models.backend import Model, forward_rows
from ssd.models.kv import KVSequence
from ssd.models.tokenizer import Tokenizer
from ssd.verify import verify


class SDEngine(BatchedEngine):
    mode = "sd"

    def __init__(
        self,
        target: Model | KVSequence,
        draft: Model,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
    ) -> None:
        """`speculation`: the settings (K, k_policy) for requests that bring none of their own."""
        super().__init__(target, tokenizer, speculation, batching, verifier, draft)

    def _round_cost(self, row: Row) -> int:
        return self._draft_length(row) + 1

    def _draft_length(self, row: Row) -> int:
        """K for this row at the current batch size (speculation.k_policy; 0: a plain
        target step), never past max_new_tokens."""
        k = row.state.speculation.k_for(len(self._rows))
        return min(k, draft_length(row.state))

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        forward_rows([row.draft for row, _ in chunks], [ids for _, ids in chunks], last_only=True)

    def _draft(self, rows: list[Row]) -> None:
        for row in rows:
            state = row.state
            row.chain = Chain(row.draft, state.sequence, self._draft_length(row), state.sampling, state.gen,
                              processor=state.processor)
        draft_chains([row.chain for row in rows])
        for row in rows:
            row.error = row.chain.error

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        chain, state = row.chain, row.state
        # greedy and coupled verification never read q
        q = torch.stack(chain.q_rows) if chain.q_rows and state.sampling.needs_q else None
        self._settle_speculation(row, chain.tokens, q, logits, forward_s)


def draft_length(req: SequenceState) -> int:
    """Tokens to draft this round: never past max_new_tokens, since the round adds up to K + 1."""
    return min(req.speculation.k, req.output.remaining - 1)
