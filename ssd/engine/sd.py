"""Speculative decoding: the draft proposes K tokens, the target verifies them
in one forward, and the shared verification routine accepts a prefix."""

from __future__ import annotations

from typing import Callable

import torch

from ssd.engine.base import Engine, Request
from ssd.engine.output import Tokenizer
from ssd.models.kv import KVSequence
from ssd.sampling import probs_from_logits, sample
from ssd.verify import Outcome, verify

Verifier = Callable[..., Outcome]


class SDEngine(Engine):
    mode = "sd"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        k: int,
        verifier: Verifier = verify,  # replaceable so tests can prove their power
    ) -> None:
        super().__init__(target, tokenizer)
        self.draft = KVSequence(draft)
        self._k = k
        self.verifier = verifier

    @property
    def k(self) -> int:
        return self._k

    def _start(self, req: Request) -> None:
        super()._start(req)
        self.draft.reset()

    def _round(self, req: Request) -> list[int]:
        # Never draft past max_new_tokens: the round adds up to K + 1 tokens.
        k = min(self._k, req.output.remaining - 1)
        drafted, q_rows = self._propose(req, k)
        scored = req.sequence + drafted
        logits = self.target.forward(scored[self.target.length :])[-(k + 1) :]
        p = probs_from_logits(logits, req.sampling)
        q = torch.stack(q_rows) if q_rows else p.new_zeros(0, p.shape[-1])
        outcome = self.verifier(drafted, q, p, req.gen, greedy=req.sampling.greedy)
        self._roll_back(len(req.sequence), k, outcome)
        req.stats.record_round(drafted=k, accepted=outcome.k)
        return outcome.tokens(drafted)

    def _propose(self, req: Request, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Draft k tokens autoregressively; return them and their q rows."""
        if k == 0:
            return [], []
        logits = self.draft.catch_up(req.sequence)
        drafted, rows = [], []
        for i in range(k):
            if i:
                logits = self.draft.forward([drafted[-1]])[-1]
            q = probs_from_logits(logits, req.sampling)
            drafted.append(sample(q, req.gen))
            rows.append(q)
        return drafted, rows

    def _roll_back(self, committed: int, k: int, outcome: Outcome) -> None:
        """Keep in each cache only tokens the accepted sequence still contains."""
        self.target.rollback(committed + outcome.k)
        # The draft never fed its last drafted token, so it may hold fewer.
        self.draft.rollback(min(self.draft.length, committed + outcome.k))
