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
packed rows keep the lean forward). Nothing here may go wrong silently:
capture and replay run on the model's device whatever the thread's current
device; a model whose forward syncs with the host is refused up front
(`graph_refusal`); a capture is replayed on its inputs and on other token
ids and checked against the eager forward before use (an empty or stale
graph is an error); a failed capture restores
the caller's stream and turns graphs off for the model, logged once, and
its sequences run the lean forward from then on. `launch/gpu_smoke.py`
times eager against captured and says whether a graph replayed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ssd.models.fast import FastForward, StaticKV, tp_size

log = logging.getLogger(__name__)

# One capture at a time in a process: a model is shared by threads (the
# server's drafting and the speculator's builds), and a capture must not
# record another thread's kernels.
_CAPTURE_LOCK = threading.Lock()
REPLAY_TOL = 5e-2  # of the largest logit: how far a checked replay may sit from the eager forward


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


class EmptyGraphError(RuntimeError):
    """A capture recorded no kernels that write the logits (they ran outside it): replays would
    return the capture-time logits whatever the inputs."""


def rope_type(model: torch.nn.Module) -> str:
    """The model's RoPE variant, as transformers names it ("default", "linear", "dynamic", ...)."""
    found = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", None)
    if found:
        return str(found)
    config = getattr(model, "config", None)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


def graph_refusal(model: torch.nn.Module) -> str | None:
    """Why `model`'s forwards are never captured as CUDA graphs, or None.

    Refused up front, before any capture: a forward that syncs with the host
    (dynamic RoPE variants recompute their frequencies from the positions'
    maximum, read on the host, as transformers' `dynamic_rope_update` does) and
    tensor-parallel shards (their all-reduces run in transformers' DTensor
    hooks, never checked under capture). Both run the lean forward eagerly.
    """
    if tp_size(model) > 1:
        return f"tensor-parallel over {tp_size(model)} ranks (collectives in transformers' hooks)"
    rope = rope_type(model)
    if "dynamic" in rope or rope == "longrope":
        return f"rope type {rope!r} reads the positions on the host during the forward"
    return None


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the current CUDA device (nothing to do elsewhere: the CPU tests' stand-in graphs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class GraphedForward:
    """`static_forward` over one cache: CUDA graphs per (rows, capacity) bucket on CUDA, eager elsewhere.

    The cache must not be reallocated behind a captured graph: `reserve`
    first (capacity is part of the bucket); a reallocated cache drops the
    graphs made over its old buffers. Capture and replay run with the
    cache's device current, on streams of that device, whatever the calling
    thread's current device is. A capture that fails (or records an empty
    graph) turns graphs off for the whole pool (the model), logged once; the
    forward then runs eagerly. `replays` and `eager_runs` count what ran.
    One owner thread, as for the cache.
    """

    WARMUP = 2  # eager runs on a side stream before capture (lazy inits, cuBLAS workspaces)

    def __init__(self, fast: FastForward | None, cache: StaticKV, graphs: bool | None = None,
                 pool: "GraphPool | None" = None) -> None:
        self.fast, self.cache, self.pool = fast, cache, pool
        self._graphs = use_cuda_graphs(cache.keys[0].device) if graphs is None else graphs
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._buffers = self._buffer_ids()
        self.replays = self.eager_runs = 0
        self.failure: str | None = None  # why this runner's capture failed, if it did

    @property
    def graphs(self) -> bool:
        """Whether forwards are captured and replayed (False once a capture failed, here or in the pool)."""
        return self._graphs and self.failure is None and (self.pool is None or self.pool.disabled is None)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.shape != (ids.shape[0], self.cache.capacity):
            raise ValueError(f"mask {tuple(mask.shape)}: expected [{ids.shape[0]}, {self.cache.capacity}] (rows, capacity)")
        if not self.graphs:
            return self._eager(ids, positions, slots, mask)
        if self._buffer_ids() != self._buffers:  # reserve() reallocated: old graphs point at freed memory
            self._captured.clear()
            self._buffers = self._buffer_ids()
        key = (ids.shape[0], self.cache.capacity)
        captured = self._captured.get(key)
        if captured is None:
            try:
                captured = self._capture(key, ids, positions, slots, mask)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: the same forward, eagerly
                self._fail(f"{type(exc).__name__}: {exc}")
                return self._eager(ids, positions, slots, mask)
        with _on(self.cache.keys[0].device):
            for buffer, value in zip(captured.inputs, (ids, positions, slots, mask)):
                buffer.copy_(value, non_blocking=True)
            captured.graph.replay()
            self.replays += 1
            return captured.logits.clone()  # the next replay overwrites the graph's output

    def _eager(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.eager_runs += 1
        return static_forward(self.fast, self.cache, *inputs)

    def _fail(self, why: str) -> None:
        self.failure = why
        self._captured.clear()
        if self.pool is not None:
            self.pool.disable(f"capturing a CUDA graph failed: {why}")
        else:
            log.warning("capturing a CUDA graph failed; this cache runs eagerly: %s", why)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._captured)

    def _buffer_ids(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.cache.keys + self.cache.values)

    def _capture(self, key: tuple[int, int], *inputs: torch.Tensor) -> _Captured:
        """Record one bucket on the cache's device, then check its replays (`check_replay`).

        The warm-up runs and the checks write the very rows (slots) the
        replay that follows writes again, so the cache ends as an eager run
        leaves it. A capture that
        raises leaves the calling stream current and no capture under way
        (torch's `graph.__exit__` restores the stream only when capture_end
        succeeds).
        """
        static = tuple(t.clone() for t in inputs)
        device = self.cache.keys[0].device
        with _CAPTURE_LOCK, torch.cuda.device(device):
            caller = torch.cuda.current_stream(device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for _ in range(self.WARMUP):
                    static_forward(self.fast, self.cache, *static)
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: other threads' CUDA calls during the capture are theirs, not errors in it.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    logits = static_forward(self.fast, self.cache, *static)
            except BaseException:
                _abandon_capture(graph, caller)
                raise
            captured = _Captured(graph, static, logits)
            check_replay(captured, functools.partial(static_forward, self.fast, self.cache), device)
        log.info("captured a CUDA graph for %d rows at capacity %d on %s", *key, device)
        self._captured[key] = captured
        return captured


def _abandon_capture(graph: "torch.cuda.CUDAGraph", caller: "torch.cuda.Stream") -> None:
    """After a capture that raised: end it if it is still under way, make `caller` current again."""
    if torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - an invalidated capture ends with an error; ended is what counts
            log.debug("ending a failed capture raised", exc_info=True)
    torch.cuda.set_stream(caller)
    try:
        graph.reset()
    except Exception:  # noqa: BLE001 - nothing was instantiated: nothing to free
        log.debug("resetting a failed capture raised", exc_info=True)


def check_replay(captured: _Captured, eager: Callable[..., torch.Tensor], device: torch.device) -> None:
    """Replay on the capture's own inputs, then on them with every token id changed: each time
    the logits, poisoned with NaN first, must be rewritten with what `eager(*inputs)` computes.

    A graph whose kernels ran outside the capture (on another device's
    stream, say) leaves the output NaN; one that returns its capture-time
    logits whatever the inputs fails the second replay. Both raise
    EmptyGraphError. The graph's input buffers end holding the capture's inputs.
    """
    original = tuple(t.clone() for t in captured.inputs)
    other = ((original[0] + 1) % captured.logits.shape[-1], *original[1:])
    try:
        for inputs in (original, other):
            for buffer, value in zip(captured.inputs, inputs):
                buffer.copy_(value)
            captured.logits.fill_(float("nan"))
            with _on(device):
                captured.graph.replay()
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
            _expect_rewritten(captured.logits, eager(*inputs), device)
    finally:
        for buffer, value in zip(captured.inputs, original):
            buffer.copy_(value)


def _expect_rewritten(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> None:
    if bool(torch.isnan(got).all()) and not bool(torch.isnan(want).all()):
        raise EmptyGraphError(f"the captured graph left its logits unwritten on {device}")
    # Loose: bf16 kernels may round apart by a few ulps; a stale or empty graph is off by O(1).
    atol = REPLAY_TOL * (float(want.float().abs().max()) + 1.0)
    if not torch.allclose(got.float(), want.float(), rtol=0, atol=atol, equal_nan=True):
        raise EmptyGraphError(f"the captured graph's replay differs from the eager forward on {device}")


class GraphPool:
    """A model's GraphedForwards (each a cache and its graphs) not in use by any sequence.

    The engines make a sequence per request; graphs bound to a sequence's own
    cache would be captured again for every request. A sequence takes a
    GraphedForward from its model's pool instead and gives it back when it is
    collected (`attach`), so the next request replays graphs already made.
    A free GraphedForward holds no FastForward, so the pool never keeps its
    model alive (it goes with the model: `pool_for`). `disabled`: why this
    model's forwards are not captured (refused up front, or a failed capture).
    """

    def __init__(self, disabled: str | None = None, name: str = "model") -> None:
        self._free: list[GraphedForward] = []
        self._lock = threading.Lock()
        self.name = name
        self.disabled: str | None = None
        if disabled is not None:
            self.disable(disabled)

    def disable(self, why: str) -> None:
        """Turn graphs off for this model (logged once: the first reason is kept)."""
        with self._lock:
            if self.disabled is not None:
                return
            self.disabled = why
        log.warning("CUDA graphs off for %s; its forwards run eagerly: %s", self.name, why)

    def acquire(self, fast: FastForward) -> GraphedForward:
        with self._lock:
            graphed = self._free.pop() if self._free else None
        if graphed is None:
            return GraphedForward(fast, fast.new_cache(), pool=self)
        graphed.fast = fast
        return graphed

    def release(self, graphed: GraphedForward) -> None:
        graphed.fast = None  # the model goes with its last user, not with the pool
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
    """The model's one GraphPool (it goes with the model); disabled up front where `graph_refusal` says so."""
    with _POOLS_LOCK:
        pool = _POOLS.get(model)
        if pool is None:
            pool = _POOLS[model] = GraphPool(graph_refusal(model), name=type(model).__name__)
        return pool
