"""Speculative decoding: the draft proposes K tokens, the target verifies them
in one forward, and the shared verification routine accepts a prefix."""

from __future__ import annotations

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Engine, SequenceState, Verifier
from ssd.models.kv import KVSequence
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.engine.drafting import draft_chain
from ssd.verify import Outcome, verify


class SDEngine(Engine):
    mode = "sd"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        k: int = 4,
        verifier: Verifier = verify,
    ) -> None:
        """`k`: drafted tokens per round for requests that bring no speculation settings."""
        super().__init__(target, tokenizer, verifier, SpeculationConfig(mode="sd", k=k))
        self.draft = KVSequence(draft)
        self.precision += f", draft {precision_of(draft)}"

    def _start(self, req: SequenceState) -> None:
        super()._start(req)
        self.draft.reset()

    def _round(self, req: SequenceState) -> list[int]:
        drafted, q_rows = draft_chain(self.draft, req.sequence, draft_length(req), req.sampling, req.gen)
        outcome = self._verify(req, drafted, q_matrix(q_rows, req))
        settle_draft(self.draft, req, outcome)
        return outcome.tokens(drafted)


def draft_length(req: SequenceState) -> int:
    """Tokens to draft this round: never past max_new_tokens, since the round adds up to K + 1."""
    return min(req.speculation.k, req.output.remaining - 1)


def q_matrix(q_rows: list[torch.Tensor], req: SequenceState) -> torch.Tensor | None:
    """The drafted positions' q [K, V] for verification (None where it is never read: greedy, K = 0)."""
    return torch.stack(q_rows) if q_rows and not req.sampling.greedy else None


def settle_draft(draft: KVSequence, req: SequenceState, outcome: Outcome) -> None:
    """Roll the draft back to the accepted tokens (req.sequence not yet extended by this round).

    The draft never fed its last drafted token, so it may hold fewer.
    """
    draft.rollback(min(draft.length, len(req.sequence) + outcome.k))
