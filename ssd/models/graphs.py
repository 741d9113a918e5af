"""Static-shape forwards of the lean forward, captured as CUDA graphs on CUDA.

At batch 1 a GPU forward of a 1.5B model is launch-bound: some ten kernels
per layer, each launched from Python, cost more than they compute. A CUDA
graph replays a recorded forward with one launch, but records addresses and
shapes: every tensor it touches must keep both from one replay to the next.
The lean forward (ssd.models.fast) slices its cache by Python ints (its
`start`), so its shapes change at every step. `static_forward` computes the
same thing with fixed shapes: M new rows are written at cache slots given as
a tensor (index_copy_), and attention runs over the cache's whole capacity
under an [M, capacity] mask (False past the sequence, and wherever a row may
not look), in one SDPA call per layer.

`GraphedForward` runs it for one cache: on CUDA it captures one graph per
shape bucket (rows, capacity) the first time a bucket is seen and replays it
after copying the inputs into the graph's own buffers; elsewhere it runs the
very same function eagerly (`use_cuda_graphs` decides), which is how the CPU
tests check the static path against the lean forward. Buckets: the target's
decode (1 row) and verification (K + 1 rows), the draft's tree steps (one
row per branch), each at the cache's power-of-two capacity.

KVSequence runs its single-sequence forwards of up to ROW_LIMIT rows
through it on CUDA (decode, verification, tree steps; a long prefill and
packed rows keep the lean forward). A capture that fails falls back to the
static forward run eagerly, with a warning. `launch/gpu_smoke.py` times
eager against captured.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.models.fast import FastForward, StaticKV

log = logging.getLogger(__name__)

# One capture at a time in a process: a model is shared by threads (the
# server's drafting and the speculator's builds), and a capture must not
# record another thread's kernels.
_CAPTURE_LOCK = threading.Lock()


def use_cuda_graphs(device: torch.device | str) -> bool:
    """Whether forwards on `device` are captured as CUDA graphs (else the static path runs eagerly)."""
    return torch.device(device).type == "cuda"


def causal_mask(start: int, rows: int, capacity: int, device: torch.device | str) -> torch.Tensor:
    """[rows, capacity] bool: row i (at cache slot start + i) sees slots 0..start + i."""
    cols = torch.arange(capacity, device=device)[None, :]
    return cols <= torch.arange(start, start + rows, device=device)[:, None]


def padded_mask(visible: torch.Tensor, capacity: int) -> torch.Tensor:
    """An explicit [rows, n] mask (tree steps) widened to [rows, capacity] with False."""
    out = torch.zeros(visible.shape[0], capacity, dtype=torch.bool, device=visible.device)
    out[:, : visible.shape[1]] = visible
    return out


@torch.inference_mode()
def static_forward(
    fast: FastForward, cache: StaticKV, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Logits [M, V] after writing M rows at cache `slots`, every shape fixed by (M, capacity).

    ids, positions, slots: [M]; mask: bool [M, capacity]. The lean forward's
    modules and rotary function; attention as its one-call path (grouped
    query heads folded into rows), but over the whole capacity.
    """
    m = ids.shape[0]
    groups = fast.heads // fast.kv_heads
    attn_mask = mask.repeat(groups, 1)[None, None]
    x = fast.inner.embed_tokens(ids)[None]  # [1, M, H]
    cos, sin = fast.inner.rotary_emb(x, positions[None])
    for index, layer in enumerate(fast.inner.layers):
        attn = layer.self_attn
        q, k, v = fast.qkv(attn, layer.input_layernorm(x), cos, sin)
        cache.keys[index].index_copy_(1, slots, k[0])
        cache.values[index].index_copy_(1, slots, v[0])
        out = F.scaled_dot_product_attention(
            q.reshape(1, fast.kv_heads, groups * m, fast.head_dim),
            cache.keys[index][None], cache.values[index][None], attn_mask=attn_mask, scale=attn.scaling,
        ).reshape(1, fast.heads, m, fast.head_dim)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, m, fast.heads * fast.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return fast.model.lm_head(fast.inner.norm(x)[0])


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]  # ids, positions, slots, mask: the graph reads these buffers
    logits: torch.Tensor  # ... and writes this one


class GraphedForward:
    """`static_forward` over one cache: CUDA graphs per (rows, capacity) bucket on CUDA, eager elsewhere.

    The cache must not be reallocated behind a captured graph: `reserve`
    first (capacity is part of the bucket); a reallocated cache drops the
    graphs made over its old buffers. One owner thread, as for the cache.
    """

    WARMUP = 2  # eager runs on a side stream before capture (lazy inits, cuBLAS workspaces)

    def __init__(self, fast: FastForward, cache: StaticKV, graphs: bool | None = None) -> None:
        self.fast, self.cache = fast, cache
        self.graphs = use_cuda_graphs(cache.keys[0].device) if graphs is None else graphs
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._buffers = self._buffer_ids()

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.shape != (ids.shape[0], self.cache.capacity):
            raise ValueError(f"mask {tuple(mask.shape)}: expected [{ids.shape[0]}, {self.cache.capacity}] (rows, capacity)")
        if not self.graphs:
            return static_forward(self.fast, self.cache, ids, positions, slots, mask)
        if self._buffer_ids() != self._buffers:  # reserve() reallocated: old graphs point at freed memory
            self._captured.clear()
            self._buffers = self._buffer_ids()
        key = (ids.shape[0], self.cache.capacity)
        captured = self._captured.get(key)
        if captured is None:
            try:
                captured = self._capture(key, ids, positions, slots, mask)
            except Exception:  # noqa: BLE001 - an op that cannot be captured: the same forward, eagerly
                log.warning("capturing a CUDA graph failed; this sequence runs eagerly", exc_info=True)
                self.graphs = False
                return static_forward(self.fast, self.cache, ids, positions, slots, mask)
        for buffer, value in zip(captured.inputs, (ids, positions, slots, mask)):
            buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.logits.clone()  # the next replay overwrites the graph's output

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._captured)

    def _buffer_ids(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.cache.keys + self.cache.values)

    def _capture(self, key: tuple[int, int], *inputs: torch.Tensor) -> _Captured:
        """Record one bucket. The warm-up runs write the very rows the replay
        that follows writes again, so the cache ends as an eager run leaves it."""
        static = tuple(t.clone() for t in inputs)
        with _CAPTURE_LOCK:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.WARMUP):
                    static_forward(self.fast, self.cache, *static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls during the capture are theirs, not errors in it.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = static_forward(self.fast, self.cache, *static)
        log.info("captured a CUDA graph for %d rows at capacity %d", *key)
        self._captured[key] = _Captured(graph, static, logits)
        return self._captured[key]


class GraphPool:
    """A model's GraphedForwards (each a cache and its graphs) not in use by any sequence.

    The engines make a sequence per request; graphs bound to a sequence's own
    cache would be captured again for every request. A sequence takes a
    GraphedForward from its model's pool instead and gives it back when it is
    collected (`attach`), so the next request replays graphs already made.
    """

    def __init__(self) -> None:
        self._free: list[GraphedForward] = []
        self._lock = threading.Lock()

    def acquire(self, fast: FastForward) -> GraphedForward:
        with self._lock:
            if self._free:
                return self._free.pop()
        return GraphedForward(fast, fast.new_cache())

    def release(self, graphed: GraphedForward) -> None:
        with self._lock:
            self._free.append(graphed)

    def attach(self, owner: object, fast: FastForward) -> GraphedForward:
        """A GraphedForward for `owner`'s lifetime: back in the pool once `owner` is collected."""
        graphed = self.acquire(fast)
        weakref.finalize(owner, self.release, graphed)
        return graphed

    @property
    def free(self) -> int:
        return len(self._free)


_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, GraphPool]" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def pool_for(model: torch.nn.Module) -> GraphPool:
    """The model's one GraphPool (it goes with the model)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(model)
        if pool is None:
            pool = _POOLS[model] = GraphPool()
        return pool
