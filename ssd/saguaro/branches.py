"""Decode many draft branches at once from one shared KV prefix.

While the target verifies s1..sK, the draft's cache (a KVSequence) holds the
committed context C followed by s1..sK. A branch b is a possible outcome
(k_b, t_b): it reuses the first `prefix_len_b = len(C) + k_b` cached entries
and continues with its own tokens t_b, d1, d2, ... All branches advance
together, one model forward per step; the caller samples the tokens.

Two implementations of one small protocol:
- TreeBranchDecoder: the B tokens of a step go in ONE row appended to the
  sequence's own cache, with a 4D mask that lets each token see only its
  prefix and its own branch. No cache copy; `finish` crops the tokens off.
- BatchedBranchDecoder: a batch-B copy of the cache, one row per branch,
  padding-masked past each branch's prefix. Never touches `kv`'s cache.

A decoder holds one build's state (its prefix, masks, step count) between
calls: one owner thread, like the KVSequence it decodes from.

Positions are explicit: branch b's i-th token sits at prefix_len_b + i,
whatever its index in the cache, and rotary embeddings only see positions.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import torch
from transformers import DynamicCache

from ssd.models.kv import KVSequence, cache_kwargs, hf_attention_mask, token_tensor

logger = logging.getLogger(__name__)

DEFAULT_MAX_STEPS = 8  # initial mask capacity in steps; grows by doubling past it


class BranchDecoder(Protocol):
    """Advance B branches off one cached prefix, one token per branch per call."""

    def start(self, kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> torch.Tensor:
        """Feed each branch's first token; logits [B, V] after it."""
        ...

    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one token per branch (ids, or a tensor of them on the model's device); logits [B, V] after it."""
        ...

    def finish(self) -> None:
        """Leave `kv` exactly as before `start` (same tokens, same cached keys and values)."""
        ...


def _check_start(kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> None:
    if not prefix_lens or len(prefix_lens) != len(first_tokens):
        raise ValueError(
            f"need one first token per branch and at least one branch "
            f"(got {len(prefix_lens)} prefix lengths, {len(first_tokens)} tokens)"
        )
    if not all(0 <= p <= kv.length for p in prefix_lens):
        raise ValueError(f"prefix lengths {list(prefix_lens)} must lie in [0, {kv.length}]")
    if kv.cached != kv.length:
        raise ValueError(f"KV cache holds {kv.cached} entries for {kv.length} tokens")
    if kv.sliding:
        # A sliding window drops old entries: prefix indices would no longer be positions.
        raise NotImplementedError("branch decoding needs full-attention cache layers")


def _glue_visibility(prefix: torch.Tensor, glue_len: int) -> torch.Tensor:
    """[B, glue_len] bool: branch b sees cached entry j iff j < prefix_len_b."""
    return torch.arange(glue_len)[None, :] < prefix[:, None]


class _Base:
    """Shared state and checks: one active set of branches at a time."""

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self._capacity = max_steps
        self._kv: KVSequence | None = None
        self._prefix = torch.empty(0, dtype=torch.long)
        self._glue = 0  # cached entries before the branch tokens
        self._mask: torch.Tensor | None = None  # visibility for `_capacity` steps
        self._steps = 0  # tokens fed per branch so far

    @property
    def active(self) -> bool:
        return self._kv is not None

    @property
    def num_branches(self) -> int:
        return self._prefix.numel()

    @torch.inference_mode()
    def start(self, kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> torch.Tensor:
        if self._kv is not None:
            raise RuntimeError("branches already active: call finish() first")
        _check_start(kv, prefix_lens, first_tokens)
        self._kv = kv
        self._prefix = torch.tensor(list(prefix_lens), dtype=torch.long)
        self._steps = 0
        try:
            self._prepare(kv)
        except BaseException:
            self.finish()
            raise
        return self.step(first_tokens)

    def _prepare(self, kv: KVSequence) -> None:
        """Set `_glue` and build the mask (and whatever cache the decoder needs)."""
        raise NotImplementedError

    def _build_mask(self) -> None:
        raise NotImplementedError

    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def _check_step(self, tokens: Sequence[int] | torch.Tensor) -> KVSequence:
        if self._kv is None:
            raise RuntimeError("no active branches: call start() first")
        if len(tokens) != self.num_branches:
            raise ValueError(f"need one token per branch ({self.num_branches}), got {len(tokens)}")
        if self._steps == self._capacity:
            self._capacity *= 2
            self._build_mask()
        return self._kv


class TreeBranchDecoder(_Base):
    """All branches in one row of the sequence's own cache, separated by a tree mask.

    Step i appends B tokens at cache indices L + i*B + b (L = cached length at
    start). Token (b, i) sees cached entries j < prefix_len_b and the tokens
    (b, i') with i' <= i: over the appended part that is the identity matrix
    repeated once per step, so the whole mask is built once per `start` and
    each step only takes a column slice of it.
    """

    def _prepare(self, kv: KVSequence) -> None:
        self._glue = kv.length
        self._build_mask()

    def _build_mask(self) -> None:
        n = self.num_branches
        own = torch.eye(n, dtype=torch.bool).repeat(1, self._capacity)
        self._mask = torch.cat([_glue_visibility(self._prefix, self._glue), own], dim=1)

    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        kv = self._check_step(tokens)
        width = self._glue + (self._steps + 1) * self.num_branches
        try:
            logits = kv.extend(tokens, self._prefix + self._steps, self._mask[:, :width])
        except BaseException:
            self.finish()  # a failed forward may have grown some layers only
            raise
        self._steps += 1
        return logits

    def finish(self) -> None:
        if self._kv is None:
            return
        self._kv.drop_uncommitted()  # kv.tokens were never touched: the committed cache is as before
        self._kv = None
        self._mask = None


class BatchedBranchDecoder(_Base):
    """One batch row per branch over a copy of the cached prefix.

    Rows are as long as the longest prefix; row b hides the glue entries
    j >= prefix_len_b with the mask. The copy is made once at `start`; `kv`'s
    own tensors are only read.
    """

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        super().__init__(max_steps)
        self._cache: DynamicCache | None = None

    def _prepare(self, kv: KVSequence) -> None:
        self._glue = int(self._prefix.max())  # rows need no entry past the longest prefix
        self._cache = _expanded_cache(kv, self._glue, self.num_branches)
        self._build_mask()

    def _build_mask(self) -> None:
        own = torch.ones(self.num_branches, self._capacity, dtype=torch.bool)
        visible = torch.cat([_glue_visibility(self._prefix, self._glue), own], dim=1)
        self._mask = hf_attention_mask(visible, self._kv.model)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        kv = self._check_step(tokens)
        width = self._glue + self._steps + 1
        try:
            device = kv.model.device
            out = kv.model(
                input_ids=token_tensor(tokens, device)[:, None],
                attention_mask=self._mask[:, None, None, :width].to(device),
                position_ids=(self._prefix + self._steps)[:, None].to(device),
                **cache_kwargs(kv.model, self._cache),
                use_cache=True,
            )
        except BaseException:
            self.finish()
            raise
        self._steps += 1
        return out.logits[:, -1]  # on the model's device: the builder samples there

    def finish(self) -> None:
        self._kv = None
        self._cache = None
        self._mask = None


def _expanded_cache(kv: KVSequence, length: int, batch: int) -> DynamicCache:
    """A new DynamicCache with `batch` rows, each the first `length` entries of kv's cache.

    `expand` is a view; DynamicLayer.update concatenates it onto an empty
    tensor, which materialises the copy without writing to kv's tensors.
    Either carrier of `kv` gives the same tensors, so the batched decoder
    always runs transformers' forward.
    """
    config = kv.model.config
    if length == 0:
        return DynamicCache(config=config)
    data = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in kv.prefix_kv(length)]
    return DynamicCache(data, config=config)


BRANCH_DECODERS: dict[str, type[_Base]] = {
    "tree": TreeBranchDecoder,
    "batched": BatchedBranchDecoder,
}


def make_branch_decoder(kind: str = "tree", max_steps: int = DEFAULT_MAX_STEPS) -> BranchDecoder:
    """A decoder by name: "tree" (default: fastest measured on CPU) or "batched"."""
    try:
        cls = BRANCH_DECODERS[kind]
    except KeyError:
        raise ValueError(f"branch decoder must be one of {sorted(BRANCH_DECODERS)}, got {kind!r}") from None
    return cls(max_steps)
