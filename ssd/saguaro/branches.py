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

from ssd.models import backend
from ssd.models.branching import check_prefixes, check_start
from ssd.models.kv import Feed, KVSequence, cache_kwargs, feed_rows, hf_attention_mask, token_tensor

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


def _check_start(active: bool, kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> None:
    check_start(active, kv.length, prefix_lens, first_tokens)  # what llama.cpp's branches check too
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
        _check_start(self._kv is not None, kv, prefix_lens, first_tokens)
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


class TreeBranchDecoder:
    """All branches in the sequence's own cache, one step after another, under a mask.

    Each step appends one token per branch, in branch order, after the
    entries of earlier steps. A branch's token sees the cached entries before
    its prefix length and its own branch's earlier tokens; the mask is built
    per step from each appended entry's owner (a few hundred booleans a row).
    No cache copy; `finish` crops the tokens off.

    Two extensions let the builder fold its glue pass into the first step
    (ssd.saguaro.builder):
    - `start(..., lead=t)`: the first step also commits the sequence's next
      token t, fed before the branches (logits row 0); branches started now
      cannot see it, branches that `join` later can;
    - `join(prefix_lens, first_tokens)`: branches whose first token goes into
      the next step, after the others';
    and `detach` ends a build keeping the branches' entries, so that the next
    round can commit the branch the target confirmed (KVSequence.keep_branch)
    instead of feeding its tokens again.
    """

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if max_steps < 1:  # kept for the factory's signature: the mask is built per step
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self._kv: KVSequence | None = None
        self._prefix: list[int] = []
        self._fed: list[list[int]] = []  # per branch: cache indices of its tokens
        self._joining: tuple[list[int], list[int]] = ([], [])
        self._first = 0  # cache index of the prepared step's first branch token

    @property
    def active(self) -> bool:
        return self._kv is not None

    @property
    def num_branches(self) -> int:
        return len(self._prefix)

    @torch.inference_mode()
    def start(
        self, kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int], lead: int | None = None,
    ) -> torch.Tensor:
        return self.run(self.open(kv, prefix_lens, first_tokens, lead))

    def open(
        self, kv: KVSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int], lead: int | None = None,
    ) -> Feed:
        """`start`'s forward, prepared and not run: run it (`run`), or with other
        sequences' feeds (ssd.models.kv.feed_rows) and then call `fed`."""
        _check_start(self._kv is not None, kv, prefix_lens, first_tokens)
        self._kv, self._prefix, self._fed = kv, [], []
        self._joining = (list(prefix_lens), [])
        return self._feed(list(first_tokens), [] if lead is None else [lead])

    def join(self, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> None:
        """Branches that start at the next step; their logits follow the others'."""
        kv = self._require()
        if len(prefix_lens) != len(first_tokens):
            raise ValueError(f"need one first token per branch (got {len(prefix_lens)} and {len(first_tokens)})")
        check_prefixes(prefix_lens, kv.length)
        self._joining = (self._joining[0] + list(prefix_lens), self._joining[1] + list(first_tokens))

    @torch.inference_mode()
    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return self.run(self.next(tokens))

    def next(self, tokens: Sequence[int] | torch.Tensor) -> Feed:
        """`step`'s forward, prepared and not run (see `open`)."""
        self._require()
        if len(tokens) != self.num_branches:
            raise ValueError(f"need one token per branch ({self.num_branches}), got {len(tokens)}")
        joining = self._joining[1]
        if joining:
            device = self._kv.model.device
            tokens = torch.cat([token_tensor(tokens, device), token_tensor(joining, device)])
        return self._feed(tokens, [])

    def run(self, feed: Feed) -> torch.Tensor:
        """Run a prepared step alone; its logits."""
        try:
            logits = feed_rows([feed])[0]
        except BaseException:
            self.finish()
            raise
        self.fed()
        return logits

    def fed(self) -> None:
        """The prepared step ran: its tokens are in the cache."""
        for b, fed in enumerate(self._fed):
            fed.append(self._first + b)

    def _feed(self, tokens: Sequence[int] | torch.Tensor, commit: list[int]) -> Feed:
        kv = self._kv
        self._prefix += self._joining[0]
        self._fed += [[] for _ in self._joining[0]]
        self._joining = ([], [])
        self._first = kv.cached + len(commit)  # cache index of this step's first branch token
        positions = [kv.cached + i for i in range(len(commit))] + [p + len(f) for p, f in zip(self._prefix, self._fed)]
        if commit:
            tokens = torch.cat([token_tensor(commit, kv.model.device), token_tensor(tokens, kv.model.device)])
        return Feed(kv, tokens, len(commit), torch.tensor(positions), self._visible(len(commit)))

    def _visible(self, leads: int) -> torch.Tensor:
        """[leads + B, width]: a lead sees everything before it; branch b its prefix and its own tokens."""
        kv, n = self._kv, self.num_branches
        width = kv.cached + leads + n
        owner = torch.full((width,), -1, dtype=torch.long)
        for b, fed in enumerate(self._fed):
            owner[fed] = b
        owner[width - n :] = torch.arange(n)
        column = torch.arange(width)
        lead_rows = column[None, :] <= torch.arange(kv.cached, kv.cached + leads)[:, None]
        prefix = torch.tensor(self._prefix, dtype=torch.long)
        branch_rows = (column[None, :] < prefix[:, None]) | (owner[None, :] == torch.arange(n)[:, None])
        return torch.cat([lead_rows, branch_rows])

    def fed_indices(self) -> list[list[int]]:
        """Per branch, the cache indices of the tokens fed so far."""
        return [list(f) for f in self._fed]

    def detach(self) -> None:
        """End the build, keeping the branches' entries (uncommitted) in the cache."""
        self._kv = None

    def finish(self) -> None:
        if self._kv is None:
            return
        self._kv.drop_uncommitted()  # kv.tokens were never touched: the committed cache is as before
        self._kv = None

    def _require(self) -> KVSequence:
        if self._kv is None:
            raise RuntimeError("no active branches: call start() first")
        return self._kv


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


BRANCH_DECODERS: dict[str, type] = {
    "tree": TreeBranchDecoder,
    "batched": BatchedBranchDecoder,
}


def make_branch_decoder(kind: str = "tree", max_steps: int = DEFAULT_MAX_STEPS, sequence: object = None) -> BranchDecoder:
    """A decoder by name: "tree" (default: fastest measured on CPU) or "batched".

    Given the `sequence` it will decode from, a backend with a decoder of its
    own gets that one whatever the name (llama.cpp: a sequence slot per
    branch, ssd.models.backend.branch_decoder).
    """
    if sequence is not None and (own := backend.branch_decoder(sequence)) is not None:
        return own
    try:
        cls = BRANCH_DECODERS[kind]
    except KeyError:
        raise ValueError(f"branch decoder must be one of {sorted(BRANCH_DECODERS)}, got {kind!r}") from None
    return cls(max_steps)
