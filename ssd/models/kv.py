"""One sequence's KV cache on one model: prefill, decode, score, roll back.

The cache always holds a prefix of the sequence's committed tokens. Engines
feed whatever the cache lacks (`catch_up`), score several tokens in one
forward, and roll back to the accepted length after verification.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache


class KVSequence:
    """A causal LM plus the KV cache of one sequence (batch size 1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # the ids whose keys and values are cached

    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.tokens = []

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append `ids` to the cache; logits [len(ids), V] (or [1, V] if last_only).

        Row i is the next-token distribution after ids[i].
        """
        if not ids:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        # An index tensor, not `1`: the int form slices a strided view of the
        # hidden states, and a bf16 Linear on that view takes a slow CPU
        # kernel (measured: 2.3 s for the 1.5B's head, against 25 ms).
        keep = torch.tensor([len(ids) - 1], device=self.model.device) if last_only else 0
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=keep)
        self.tokens.extend(ids)
        return out.logits[0].cpu()  # sampling and verification run on the CPU generator

    def catch_up(self, sequence: Sequence[int]) -> torch.Tensor:
        """Feed the tail of `sequence` the cache lacks; logits after its last token.

        The cache must hold a prefix of `sequence` and lack at least one token.
        """
        n = self.length
        if list(sequence[:n]) != self.tokens or n >= len(sequence):
            raise ValueError("KV cache is not a strict prefix of the sequence")
        return self.forward(sequence[n:], last_only=True)[-1]

    def trim_to_prefix_of(self, sequence: Sequence[int]) -> None:
        """Roll back to the longest cached prefix of `sequence` that leaves at
        least its last token unfed, so `catch_up(sequence)` can run."""
        n = min(self.length, len(sequence) - 1)
        shared = next((i for i in range(n) if self.tokens[i] != sequence[i]), n)
        self.rollback(shared)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} of {self.length} tokens")
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove
            del self.tokens[length:]
