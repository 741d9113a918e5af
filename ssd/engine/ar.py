"""Autoregressive decoding, one target forward per token for every row: the reference."""

from __future__ import annotations

from ssd.config import BatchingConfig
from ssd.engine.batch import BatchedEngine
from ssd.models.backend import Model
from ssd.models.tokenizer import Tokenizer


class AREngine(BatchedEngine):
    mode = "ar"

    def __init__(
        self, target: Model, tokenizer: Tokenizer, batching: BatchingConfig | None = None,
    ) -> None:
        super().__init__(target, tokenizer, batching=batching)
