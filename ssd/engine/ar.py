"""Autoregressive decoding, one target forward per token for every row: the reference."""

from __future__ import annotations

import torch

from ssd.config import BatchingConfig
from ssd.engine.batch import BatchedEngine, Row
from ssd.models.backend import Model
from ssd.models.kv import KVSequence
from ssd.models.tokenizer import Tokenizer


class AREngine(BatchedEngine):
    mode = "ar"

    def __init__(
        self, target: Model | KVSequence, tokenizer: Tokenizer, batching: BatchingConfig | None = None,
    ) -> None:
        super().__init__(target, tokenizer, batching=batching)

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        self._plain_step(row, logits, forward_s)
