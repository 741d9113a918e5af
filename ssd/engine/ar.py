"""Autoregressive decoding: one target forward per token. The reference."""

from __future__ import annotations

from ssd.engine.base import Engine, Request
from ssd.sampling import probs_from_logits, sample


class AREngine(Engine):
    mode = "ar"

    def _round(self, req: Request) -> list[int]:
        logits = self.target.catch_up(req.sequence)
        req.stats.record_round(drafted=0, accepted=0)
        return [sample(probs_from_logits(logits, req.sampling), req.gen)]
