"""Speculative decoding: the draft proposes K tokens, the target verifies them
in one forward, and the shared verification routine accepts a prefix."""

from __future__ import annotations

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Engine, SequenceState, Verifier
from ssd.models.kv import KVSequence
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.speculation.drafting import draft_chain
from ssd.verify import verify


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
        # Never draft past max_new_tokens: the round adds up to K + 1 tokens.
        k = min(req.speculation.k, req.output.remaining - 1)
        drafted, q_rows = draft_chain(self.draft, req.sequence, k, req.sampling, req.gen)
        q = torch.stack(q_rows) if q_rows and not req.sampling.greedy else None  # greedy never reads q
        outcome = self._verify(req, drafted, q)
        # The draft never fed its last drafted token, so it may hold fewer.
        self.draft.rollback(min(self.draft.length, len(req.sequence) + outcome.k))
        return outcome.tokens(drafted)
