"""One sequence's KV cache on one model: prefill, decode, score, roll back.

The cache always holds a prefix of the sequence's committed tokens, optionally
followed by uncommitted entries (branch decoding appends those and drops them
again). Engines feed whatever the cache lacks (`catch_up`), score several
tokens in one forward, and roll back to the accepted length after verification.

Two carriers behind one interface: the lean forward over a preallocated cache
(ssd.models.fast) for the Llama-layout models it supports, transformers'
forward over a DynamicCache for every other model (and tensor-parallel shards).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from ssd.models.fast import FastForward, StaticKV, fast_supported


class KVSequence:
    """A causal LM plus the KV cache of one sequence (batch size 1)."""

    def __init__(self, model: torch.nn.Module, fast: bool | None = None) -> None:
        """fast: the lean forward (None: wherever it supports the model)."""
        self.model = model
        use_fast = fast_supported(model) if fast is None else fast
        self._fast = FastForward(model) if use_fast else None
        self._clear()

    @property
    def length(self) -> int:
        """Committed tokens in the cache."""
        return len(self.tokens)

    @property
    def cached(self) -> int:
        """Entries in the cache: the committed tokens plus any uncommitted ones."""
        return self.length + self._extra

    @property
    def sliding(self) -> bool:
        """Whether any layer keeps only a window of entries (transformers' carrier only)."""
        return self._fast is None and any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)

    def reset(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.cache: StaticKV | DynamicCache = (
            self._fast.new_cache() if self._fast else DynamicCache(config=self.model.config)
        )
        self.tokens: list[int] = []  # the ids whose keys and values are cached
        self._extra = 0

    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append `ids` to the cache; logits [len(ids), V] (or [1, V] if last_only).

        Row i is the next-token distribution after ids[i].
        """
        if not ids:
            raise ValueError("forward needs at least one token")
        if self._extra:
            raise RuntimeError("drop the uncommitted entries before committing tokens")
        logits = self._run(list(ids), positions=None, mask=None, last_only=last_only)
        self.tokens.extend(ids)
        return logits

    def extend(self, ids: Sequence[int] | torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append uncommitted entries at explicit positions; logits [len(ids), V].

        ids may be a tensor on the model's device (sampled there: never read
        by the host). visible: bool [len(ids), cached + len(ids)], True where
        a new row may attend (cached entries, then the new rows themselves).
        """
        logits = self._run(ids if isinstance(ids, torch.Tensor) else list(ids), positions, visible, last_only=False)
        self._extra += len(ids)
        return logits

    def drop_uncommitted(self) -> None:
        """Forget every entry past the committed tokens (also after a failed forward)."""
        if self._fast is None:
            for layer in self.cache.layers:  # per layer: a failed forward may have grown only some
                extra = layer.get_seq_length() - self.length
                if extra > 0:
                    layer.crop(-extra)  # transformers 5.24: a negative count of tokens to drop
        self._extra = 0

    def prefix_kv(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of the first `length` cached keys and values per layer, [1, kv heads, length, D]."""
        if self._fast is not None:
            return [(k[None, :, :length], v[None, :, :length]) for k, v in zip(self.cache.keys, self.cache.values)]
        return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in self.cache.layers]

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
        if self._extra:
            self.drop_uncommitted()
        if length < self.length:
            if self._fast is None:
                self.cache.crop(length - self.length)  # negative: tokens to remove
            del self.tokens[length:]

    @torch.inference_mode()
    def _run(
        self, ids: list[int] | torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None, last_only: bool
    ) -> torch.Tensor:
        device = self.model.device
        input_ids = token_tensor(ids, device)
        # An index tensor, not `1`: the int form slices a strided view of the
        # hidden states, and a bf16 Linear on that view takes a slow CPU
        # kernel (measured: 2.3 s for the 1.5B's head, against 25 ms).
        keep = torch.tensor([len(ids) - 1], device=device) if last_only else None
        start = self.cached
        if positions is None:
            positions = torch.arange(start, start + len(ids), device=device)
        if self._fast is not None:
            logits = self._fast(self.cache, input_ids, positions.to(device), start, _on(mask, device), keep)
        else:
            logits = self.model(
                input_ids=input_ids[None], cache=self.cache, use_cache=True,
                position_ids=positions.to(device)[None],
                attention_mask=None if mask is None else hf_attention_mask(mask.to(device)[None, None], self.model),
                logits_to_keep=0 if keep is None else keep,
            ).logits[0]
        return logits  # on the model's device: sampling and verification run there


def token_tensor(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids as a long tensor on `device` (a tensor already there is used as is)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long, non_blocking=True)
    return torch.tensor(ids, dtype=torch.long, device=device)


def hf_attention_mask(visible: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A custom mask (bool, True = may attend) in the form the model's attention takes it.

    transformers returns a 4D mask as-is and hands it straight to the
    attention function: SDPA (and our row attention) read bool as "True =
    attend", while eager attention *adds* the mask to the scores, so it needs
    0 / dtype-min floats.
    """
    if model.config._attn_implementation != "eager":
        return visible
    zero = torch.zeros((), dtype=model.dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(model.dtype).min)


def _on(mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if mask is None else mask.to(device)
