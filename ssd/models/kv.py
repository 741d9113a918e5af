"""One sequence's KV cache on one model: prefill, decode, score, roll back.

The cache always holds a prefix of the sequence's committed tokens, optionally
followed by uncommitted entries (branch decoding appends those and drops them
again). Engines feed whatever the cache lacks (`catch_up`), score several
tokens in one forward, and roll back to the accepted length after verification.

Two carriers behind one interface: the lean forward over a preallocated cache
(ssd.models.fast) for the Llama-layout models it supports (tensor-parallel
shards included), transformers' forward over a DynamicCache for every other
model.

On CUDA the lean carrier's cache is a slot of its model's shared KV store
(ssd.models.shared_kv), and its decode and all-rows forwards (verification,
the draft's glue pass and tree steps) replay CUDA graphs of its static-shape
twin (ssd.models.graphs), per (rows, capacity) bucket; the slot and its
graphs come from the model's pool and return to it with the sequence, so a
new request's sequence replays graphs an earlier one captured. A model the
pool refuses (ssd.models.graphs.graph_refusal), or whose capture failed,
runs the lean forward eagerly over the same cache.

`forward_rows` advances several sequences of one model at once (continuous
batching): one packed forward on the lean carrier, a loop over the rows on
the other (correct, not batched), behind one call. On CUDA a packed forward
whose feeds are all graph-shaped (decode, verification, tree steps) runs as
one batched static forward over the store (`_forward_batched`: one graph
per (slots, tokens per row, capacity) bucket, one attention call per layer
for the batch); others (a prefill chunk) run the lean packed forward over
the same slots.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache

from ssd.models.fast import FastForward, Segment, StaticKV, fast_supported
from ssd.models.graphs import GraphedForward, GraphPool, causal_mask, padded_mask, pool_for, use_cuda_graphs
from ssd.models.invariant import ROW_LIMIT
from ssd.models.shared_kv import SlotKV, power_of_two


class KVSequence:
    """A causal LM plus the KV cache of one sequence (batch size 1).

    One owner thread: the model may be shared, the cache may not (ssd.models).
    """

    def __init__(self, model: torch.nn.Module, fast: bool | None = None, slots: bool | None = None) -> None:
        """fast: the lean forward (None: wherever it supports the model); slots: the cache a slot of
        the model's shared store, with its graphs (None: on CUDA; elsewhere the static forwards run
        eagerly, as the CPU tests and timings want them)."""
        self.model = model
        use_fast = fast_supported(model) if fast is None else fast
        self._fast = FastForward(model) if use_fast else None
        if self._fast is None:
            _cache_name(type(model))  # refuse an unsupported transformers now, not at the first forward
        # On CUDA, decode, verification and tree steps replay CUDA graphs of
        # the static-shape forward (ssd.models.graphs; see _graph_shaped),
        # unless the model is refused for capture (its pool says why, once).
        slots = use_cuda_graphs(model.device) if slots is None else slots
        pool = pool_for(model) if self._fast is not None and slots else None
        self._static = pool is not None and pool.disabled is None
        # A cache with its graphs, from the model's pool and back to it when this sequence goes.
        self._graphed: GraphedForward | None = pool.attach(self, self._fast) if self._static else None
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

    @property
    def keeps_prefix(self) -> bool:
        """Whether this cache may wait, idle, for a later prompt (ssd.engine.prefix): not a slot
        of the model's graphed store (a batched forward covers every slot it holds), nor a
        sliding window (which cannot roll back to a prefix)."""
        return self._graphed is None and not self.sliding

    def reset(self) -> None:
        self._clear()

    def _clear(self) -> None:
        if self._graphed is not None:  # its slot of the model's store, with the slot's graphs
            self.cache = self._graphed.cache
            self.cache.reserve(0, keep=0)  # holds nothing now: the store may shrink below it
        else:
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

    @property
    def lean(self) -> bool:
        """Whether the lean forward carries this cache (branch entries can then be kept: `keep_branch`)."""
        return self._fast is not None

    def extend(
        self, ids: Sequence[int] | torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, commit: Sequence[int] = (),
    ) -> torch.Tensor:
        """Append entries at explicit positions; logits [len(commit) + len(ids), V].

        `commit`: tokens fed first, in sequence order, that become committed
        (the cache must hold no uncommitted entry then); `ids` follow as
        uncommitted entries, and may be a tensor on the model's device
        (sampled there: never read by the host). visible: bool
        [rows, cached + rows], True where a new row may attend (cached
        entries, then the new rows themselves).
        """
        if commit and self._extra:
            raise RuntimeError("committed tokens cannot follow uncommitted entries")
        rows: list[int] | torch.Tensor
        if isinstance(ids, torch.Tensor):
            rows = torch.cat([token_tensor(commit, ids.device), ids]) if commit else ids
        else:
            rows = list(commit) + list(ids)
        logits = self._run(rows, positions, visible, last_only=False)
        self.tokens.extend(commit)
        self._extra += len(ids)
        return logits

    def _store(self) -> contextlib.AbstractContextManager:
        """The model's shared store held for one operation on this cache (nothing to hold elsewhere)."""
        return self.cache.shared.use() if isinstance(self.cache, SlotKV) else contextlib.nullcontext()

    def keep_branch(self, length: int, indices: Sequence[int], tokens: Sequence[int]) -> None:
        """Keep the first `length` committed tokens, then commit the uncommitted
        entries at cache `indices` as `tokens` after them (a branch the tree
        decoder fed, ssd.saguaro.branches); every other uncommitted entry is
        dropped. Lean carrier only: its entries stay where they were written.
        """
        with self._store():
            self._keep_branch(length, indices, tokens)

    @torch.inference_mode()
    def _keep_branch(self, length: int, indices: Sequence[int], tokens: Sequence[int]) -> None:
        if self._fast is None:
            raise NotImplementedError("keeping a branch needs the lean carrier")
        if len(indices) != len(tokens):
            raise ValueError(f"{len(indices)} cache indices for {len(tokens)} tokens")
        if not all(self.length <= i < self.cached for i in indices):
            raise ValueError(f"indices {list(indices)} must be uncommitted entries in [{self.length}, {self.cached})")
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} of {self.length} tokens")
        index = torch.tensor(list(indices), dtype=torch.long, device=self.cache.keys[0].device)
        picked = [(k.index_select(1, index), v.index_select(1, index)) for k, v in zip(self.cache.keys, self.cache.values)]
        self.rollback(length)  # drops the other entries; the lean carrier only moves a length
        end = length + len(tokens)
        for (k, v), (store_k, store_v) in zip(picked, zip(self.cache.keys, self.cache.values)):
            store_k[:, length:end] = k
            store_v[:, length:end] = v
        self.tokens.extend(tokens)

    def drop_uncommitted(self) -> None:
        """Forget every entry past the committed tokens (also after a failed forward)."""
        if self._fast is None:
            for layer in self.cache.layers:  # per layer: a failed forward may have grown only some
                extra = layer.get_seq_length() - self.length
                if extra > 0:
                    layer.crop(-extra)  # transformers 5.24: a negative count of tokens to drop
        self._extra = 0

    def fork(self, length: int) -> "KVSequence":
        """A new sequence of the same model holding a copy of this one's first `length` entries
        (a cached prefix that another prompt shares: ssd.engine.prefix). Not from a graphed store."""
        if not self.keeps_prefix or not 0 <= length <= self.length:
            raise ValueError(f"cannot fork {length} of {self.length} tokens of this sequence")
        twin = KVSequence(self.model, fast=self._fast is not None, slots=False)
        if self._fast is not None:
            twin.cache.reserve(length, keep=0)
            for mine, theirs in ((self.cache.keys, twin.cache.keys), (self.cache.values, twin.cache.values)):
                for source, target in zip(mine, theirs):
                    target[:, :length] = source[:, :length]
        else:
            twin.cache = copy.deepcopy(self.cache)
            if length < self.cached:
                twin.cache.crop(length - self.cached)  # negative: tokens to remove
        twin.tokens = self.tokens[:length]
        return twin

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

    def _run(
        self, ids: list[int] | torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None, last_only: bool
    ) -> torch.Tensor:
        with self._store():
            return self._run_held(ids, positions, mask, last_only)

    @torch.inference_mode()
    def _run_held(
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
        # A failed capture turns the pool's graphs off: the lean forward then runs over the same cache.
        if self._static and self._graphed.pool.disabled is None and _graph_shaped(len(ids), last_only):
            logits = self._run_static(input_ids, positions.to(device), start, _on(mask, device), keep)
        elif self._fast is not None:
            logits = self._fast(self.cache, input_ids, positions.to(device), start, _on(mask, device), keep)
        else:
            logits = self.model(
                input_ids=input_ids[None], **cache_kwargs(self.model, self.cache), use_cache=True,
                position_ids=positions.to(device)[None],
                attention_mask=None if mask is None else hf_attention_mask(mask.to(device)[None, None], self.model),
                logits_to_keep=0 if keep is None else keep,
            ).logits[0]
        return logits  # on the model's device: sampling and verification run there

    def _run_static(
        self, ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor | None,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """The lean forward's result through the static-shape forward (a CUDA graph replay on CUDA)."""
        m = ids.shape[0]
        self.cache.reserve(start + m, keep=start)
        capacity, device = self.cache.capacity, ids.device
        full = causal_mask(start, m, capacity, device) if mask is None else padded_mask(mask, capacity)
        logits = self._graphed(ids, positions, torch.arange(start, start + m, device=device), full)
        return logits if keep is None else logits[keep]


def _graph_shaped(rows: int, last_only: bool) -> bool:
    """Whether a forward of `rows` rows goes through the static forward (CUDA graphs).

    Decode (one row) and the forwards that keep every row (verification,
    the draft's glue pass, tree steps) repeat a few shapes; a prefill
    (last_only, many rows) has the prompt's length, and capturing one graph
    per prompt length would cost more than it saves.
    """
    return rows == 1 or (not last_only and rows <= ROW_LIMIT)


@dataclass
class Feed:
    """Tokens for one sequence's cache, to run in one forward with other sequences' (`feed_rows`).

    The first `commit` ids become committed tokens (host ints), the rest
    uncommitted entries (KVSequence.extend). positions: None for consecutive
    positions after the cache; visible: bool [rows, cached + rows] or None
    for causal order; last_only: logits for the last row only.
    """

    kv: KVSequence
    ids: Sequence[int] | torch.Tensor
    commit: int
    positions: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    last_only: bool = False

    def run_alone(self) -> torch.Tensor:
        if self.commit == len(self.ids) and self.positions is None and self.visible is None:
            return self.kv.forward(list(self.ids), last_only=self.last_only)
        commit = [int(t) for t in self.ids[: self.commit]]
        logits = self.kv.extend(self.ids[self.commit :], self.positions, self.visible, commit=commit)
        return logits[-1:] if self.last_only else logits


def forward_rows(
    rows: Sequence[KVSequence], ids: Sequence[Sequence[int]], last_only: bool | Sequence[bool] = False
) -> list[torch.Tensor]:
    """`rows[i].forward(ids[i], last_only[i])` for every row, in one forward where the carrier allows.

    The rows are distinct sequences of one model. On the lean carrier their
    tokens are packed into one forward (ssd.models.fast: shared matmuls,
    per-row attention); a single row, transformers' carrier and KVSequence
    subclasses (which mirror operations elsewhere) run row by row.
    """
    flags = [last_only] * len(rows) if isinstance(last_only, bool) else list(last_only)
    if len(rows) != len(ids) or len(rows) != len(flags):
        raise ValueError(f"{len(rows)} rows, {len(ids)} id lists and {len(flags)} last_only flags")
    return feed_rows([Feed(row, list(x), len(x), last_only=flag) for row, x, flag in zip(rows, ids, flags)])


def feed_rows(feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """Each feed's logits, in one packed forward where the carrier allows, else one by one.

    Sequences on slots of their model's shared store (CUDA) run as one
    batched static forward (`_forward_batched`: a CUDA graph per bucket)
    when every feed is graph-shaped and the model's graphs are on; else the
    lean packed forward runs, over the same caches.
    """
    if len(feeds) <= 1 or not _packable([f.kv for f in feeds]):
        return [f.run_alone() for f in feeds]
    pool = _shared_pool(feeds)
    if pool is None:
        return _forward_packed(feeds)
    with pool.shared.use():
        if pool.disabled is None and all(_graph_shaped(len(f.ids), f.last_only) for f in feeds):
            return _forward_batched(feeds, pool)
        return _forward_packed(feeds)


def _packable(rows: Sequence[KVSequence]) -> bool:
    model = rows[0].model
    return all(
        type(row).forward is KVSequence.forward and row._fast is not None and row.model is model
        for row in rows
    ) and len({id(row) for row in rows}) == len(rows)


def _shared_pool(feeds: Sequence[Feed]) -> GraphPool | None:
    """The graph pool whose store holds every feed's cache, or None (caches of their own)."""
    if all(f.kv._graphed is not None for f in feeds):
        return feeds[0].kv._graphed.pool
    return None


@dataclass
class _Placed:
    """A feed checked for a packed forward: its rows start at cache entry `start`."""

    feed: Feed
    start: int
    positions: torch.Tensor  # [rows], on the CPU

    @property
    def rows(self) -> int:
        return len(self.feed.ids)

    @property
    def kept(self) -> int:
        """Logit rows it gets back."""
        return 1 if self.feed.last_only else self.rows


def _place(feeds: Sequence[Feed]) -> list[_Placed]:
    placed = []
    for f in feeds:
        if not len(f.ids):
            raise ValueError("forward needs at least one token")
        if f.commit and f.kv._extra:
            raise RuntimeError("drop the uncommitted entries before committing tokens")
        start = f.kv.cached
        positions = torch.arange(start, start + len(f.ids)) if f.positions is None else f.positions.cpu()
        placed.append(_Placed(f, start, positions))
    return placed


def _commit(placed: Sequence[_Placed], logits: torch.Tensor) -> list[torch.Tensor]:
    """Book the feeds' tokens into their sequences; the logits split per feed."""
    for p in placed:
        f = p.feed
        f.kv.tokens.extend(int(t) for t in f.ids[: f.commit])
        f.kv._extra += len(f.ids) - f.commit
    return list(logits.split([p.kept for p in placed]))


@torch.inference_mode()
def _forward_packed(feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """One packed forward; logits per feed as `Feed.run_alone` returns them."""
    device = feeds[0].kv.model.device
    placed, segments, keep, offset = _place(feeds), [], [], 0
    for p in placed:
        f = p.feed
        segments.append(Segment(f.kv.cache, p.start, p.rows, None if f.visible is None else f.visible.to(device)))
        keep.extend([offset + p.rows - 1] if f.last_only else range(offset, offset + p.rows))
        offset += p.rows
    flat = torch.cat([token_tensor(f.ids, device) for f in feeds])
    positions = torch.cat([p.positions for p in placed]).to(device)
    logits = feeds[0].kv._fast.packed(segments, flat, positions, torch.tensor(keep, device=device))
    return _commit(placed, logits)


@torch.inference_mode()
def _forward_batched(feeds: Sequence[Feed], pool: GraphPool) -> list[torch.Tensor]:
    """`_forward_packed`'s logits from one static-shape forward over the model's store (the store held).

    Laid out by slot ([slots, T]: T the longest feed's rows, to a power of
    two, at most ROW_LIMIT): slots not in the batch and rows past a feed's
    end are padding, which writes to the scratch row and sees entry 0 of its
    own slot (finite: slots are zeroed when handed out), so no attention row
    is fully masked (SDPA returns NaN for one) and no live entry is touched.
    """
    device = feeds[0].kv.model.device
    placed = _place(feeds)
    for p in placed:  # growth first: the layout below is for the store's final shape
        p.feed.kv.cache.reserve(p.start + p.rows, keep=p.start)
    slots, capacity = pool.shared.slots, pool.shared.capacity
    width = min(power_of_two(max(p.rows for p in placed)), ROW_LIMIT)
    ids = torch.zeros(slots, width, dtype=torch.long, device=device)  # ids may live there already
    positions = torch.zeros(slots, width, dtype=torch.long)
    rows, cols = torch.full((slots, width), slots), torch.zeros(slots, width, dtype=torch.long)
    mask = torch.zeros(slots, width, capacity, dtype=torch.bool)
    mask[:, :, 0] = True
    keep = []
    for p in placed:
        f, slot, m = p.feed, p.feed.kv.cache.slot, p.rows
        ids[slot, :m] = token_tensor(f.ids, device)
        positions[slot, :m] = p.positions
        rows[slot, :m] = slot
        cols[slot, :m] = torch.arange(p.start, p.start + m)
        mask[slot, :m] = causal_mask(p.start, m, capacity, "cpu") if f.visible is None else padded_mask(f.visible.cpu(), capacity)
        first = slot * width
        keep.extend([first + m - 1] if f.last_only else range(first, first + m))
    inputs = [ids, *(t.to(device) for t in (positions, rows, cols, mask))]
    logits = pool.batched(feeds[0].kv._fast, *inputs, keep=torch.tensor(keep, device=device))
    return _commit(placed, logits)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token takes in `model`'s cache: layers * 2 * kv heads * head dim * element size.

    The cache holds activations, so an int8 model's cache is in its embedding's dtype.
    """
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = model.get_input_embeddings().weight.element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * element


# The names transformers has given the forward's cache argument: `cache` in
# 5.24, `past_key_values` up to 5.17 at least. The forward takes **kwargs, so
# a name it does not know is swallowed without a word and the step decodes
# without its context: the name is read from the signature, never assumed.
CACHE_NAMES = ("cache", "past_key_values")


class UnsupportedModelError(RuntimeError):
    """The installed transformers' forward takes no cache argument we know."""


def cache_kwargs(model: torch.nn.Module, cache: object) -> dict[str, object]:
    """`cache` as the keyword argument `model`'s forward takes it."""
    return {_cache_name(type(model)): cache}


@functools.cache
def _cache_name(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    for name in CACHE_NAMES:
        if name in params:
            return name
    import transformers

    raise UnsupportedModelError(
        f"{cls.__name__}.forward (transformers {transformers.__version__}) takes none of {CACHE_NAMES}: "
        "this transformers version is not supported"
    )


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
