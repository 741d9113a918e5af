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
through it on CUDA (decode, verification, tree steps; a long prefill keeps
the lean forward).

Packed rows of several sequences (continuous batching) have a twin too:
`batched_static_forward` runs a batch laid out by slot of the model's shared
KV store (ssd.models.shared_kv: every sequence of the model is a row of one
tensor per layer), [slots, T] tokens, with one SDPA call per layer for the
whole batch (batched over slots), and `BatchedForward` captures it per
(slots, T, capacity) bucket, checked and turned off exactly as
GraphedForward. `GraphPool` holds a model's store, its per-slot
GraphedForwards and its BatchedForward; all of a model's graphs capture into
one CUDA memory pool (`GraphPool.mempool` says why that is safe). On a CPU
both twins run eagerly (the batched one checked there eagerly and with
stand-in captures: tests/test_graphs_batch.py); launch/gpu_smoke.py checks
their replays on a GPU. Nothing here may go wrong silently:
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
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ssd.models.fast import FastForward, StaticKV, tp_size
from ssd.models.shared_kv import SharedKV, SlotKV

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


@torch.inference_mode()
def batched_static_forward(
    fast: FastForward, shared: SharedKV, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
    cols: torch.Tensor, mask: torch.Tensor,
) -> torch.Tensor:
    """Logits [S*T, V] of a packed batch laid out by slot: every shape fixed by (S, T, capacity).

    ids, positions, rows, cols: [S, T], slot s's tokens in row s (padding
    where a slot has fewer, or is not in the batch); token (s, t) writes its
    keys and values at slot rows[s, t], entry cols[s, t] (padding writes to
    the scratch row); mask: bool [S, T, capacity], what (s, t) sees of slot
    s. Attention is one SDPA call per layer for the whole batch, batched over
    slots, grouped query heads folded into rows as in `static_forward`.
    """
    s, t = ids.shape
    n, groups = s * t, fast.heads // fast.kv_heads
    attn_mask = mask.repeat(1, groups, 1)[:, None]  # [S, 1, G*T, C]: row g*T + t is token t of head group g
    flat_rows, flat_cols = rows.reshape(n), cols.reshape(n)
    x = fast.inner.embed_tokens(ids.reshape(1, n))  # [1, N, H]
    cos, sin = fast.inner.rotary_emb(x, positions.reshape(1, n))
    for index, layer in enumerate(fast.inner.layers):
        attn = layer.self_attn
        q, k, v = fast.qkv(attn, layer.input_layernorm(x), cos, sin)  # [1, heads or kv heads, N, D]
        shared.keys[index][flat_rows, :, flat_cols] = k[0].transpose(0, 1)
        shared.values[index][flat_rows, :, flat_cols] = v[0].transpose(0, 1)
        q = q[0].reshape(fast.kv_heads, groups, s, t, fast.head_dim).permute(2, 0, 1, 3, 4)
        out = F.scaled_dot_product_attention(
            q.reshape(s, fast.kv_heads, groups * t, fast.head_dim),
            shared.keys[index][:s], shared.values[index][:s], attn_mask=attn_mask, scale=attn.scaling,
        )  # [S, kv heads, G*T, D]
        out = out.reshape(s, fast.heads, t, fast.head_dim).transpose(1, 2).reshape(1, n, fast.heads * fast.head_dim)
        x = x + attn.o_proj(out)
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
    def __call__(self, *inputs: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `_forward(*inputs)` (ids, positions, slots, mask), rows `keep` only if given.

        The mask's shape is the bucket: one graph per shape.
        """
        self._check(*inputs)
        if not self.graphs:
            return _rows(self._eager(*inputs), keep)
        if self._buffer_ids() != self._buffers:  # the cache was reallocated: old graphs point at freed memory
            self._captured.clear()
            self._buffers = self._buffer_ids()
        key = tuple(inputs[-1].shape)
        captured = self._captured.get(key)
        if captured is None:
            try:
                captured = self._capture(key, *inputs)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: the same forward, eagerly
                self._fail(f"{type(exc).__name__}: {exc}")
                return _rows(self._eager(*inputs), keep)
        with _on(self._device()):
            for buffer, value in zip(captured.inputs, inputs):
                buffer.copy_(value, non_blocking=True)
            captured.graph.replay()
            self.replays += 1
            # A copy: the next replay (of this graph, or of another in the shared pool) overwrites the output.
            return captured.logits.clone() if keep is None else captured.logits.index_select(0, keep)

    def _check(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> None:
        if mask.shape != (ids.shape[0], self.cache.capacity):
            raise ValueError(f"mask {tuple(mask.shape)}: expected [{ids.shape[0]}, {self.cache.capacity}] (rows, capacity)")

    def _forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The static-shape forward captured and run eagerly: the same function either way."""
        return static_forward(self.fast, self.cache, *inputs)

    def _device(self) -> torch.device:
        return self.cache.keys[0].device

    def _eager(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.eager_runs += 1
        return self._forward(*inputs)

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

    def _mempool(self) -> object | None:
        return self.pool.mempool() if self.pool is not None else None

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
        device = self._device()
        with _CAPTURE_LOCK, torch.cuda.device(device):
            caller = torch.cuda.current_stream(device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for _ in range(self.WARMUP):
                    self._forward(*static)
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: other threads' CUDA calls during the capture are theirs, not errors in it.
                # One memory pool for all of a model's graphs (see GraphPool.mempool).
                with torch.cuda.graph(graph, pool=self._mempool(), stream=stream, capture_error_mode="thread_local"):
                    logits = self._forward(*static)
            except BaseException:
                _abandon_capture(graph, caller)
                raise
            captured = _Captured(graph, static, logits)
            check_replay(captured, self._forward, device)
        log.info("captured a CUDA graph for shape %s on %s", key, device)
        self._captured[key] = captured
        return captured


def _rows(logits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return logits if keep is None else logits.index_select(0, keep)


class BatchedForward(GraphedForward):
    """`batched_static_forward` over a model's SharedKV: one graph per (slots, tokens per row,
    capacity) bucket on CUDA, eager elsewhere; captured, checked and turned off like GraphedForward.

    Inputs: ids, positions, rows, cols [S, T] and mask [S, T, capacity], S the
    store's slots (`ssd.models.kv` lays a packed batch out). The store
    reallocates only between forwards (SharedKV.use), and a reallocation
    drops the graphs made over its old tensors.
    """

    def __init__(self, fast: FastForward | None, shared: SharedKV, graphs: bool | None = None,
                 pool: "GraphPool | None" = None) -> None:
        super().__init__(fast, shared, graphs, pool)  # type: ignore[arg-type] - the store is the "cache"

    def _check(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               mask: torch.Tensor) -> None:
        want = (self.cache.slots, ids.shape[1], self.cache.capacity)
        if ids.shape[0] != want[0] or mask.shape != want:
            raise ValueError(f"ids {tuple(ids.shape)}, mask {tuple(mask.shape)}: expected a mask of {want} (slots, T, capacity)")

    def _forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return batched_static_forward(self.fast, self.cache, *inputs)


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
    """A model's shared KV store (ssd.models.shared_kv) and the graphs over it.

    The engines make a sequence per request; graphs bound to a sequence's
    own cache would be captured again for every request. A sequence takes a
    slot of its model's store instead (`attach`), with that slot's
    GraphedForward (its single-sequence graphs), and gives both back when it
    is collected, so the next request on that slot replays graphs already
    made; packed forwards of several sequences run through the one
    BatchedForward (`batched`). Every graph of the model captures into one
    CUDA memory pool (`mempool`). A free runner holds no FastForward, and
    the batched one holds it only during a call, so the pool never keeps its
    model alive (it goes with the model: `pool_for`). `disabled`: why this
    model's forwards are not captured (refused up front, or a failed capture).
    """

    def __init__(self, disabled: str | None = None, name: str = "model") -> None:
        self._runners: dict[int, GraphedForward] = {}  # per slot, kept while the store has the slot
        self._batched: BatchedForward | None = None
        self._version = -1  # the store's version the runners' graphs were made over
        self._lock = threading.Lock()
        self._mempool: object | None = None
        self.shared: SharedKV | None = None
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

    def mempool(self) -> object:
        """The CUDA graph memory pool every graph of this model captures into.

        Sharing one pool bounds graph memory by the largest graph, not the
        sum (torch.cuda.graph's `pool`, "Graph memory management" in torch's
        CUDA semantics notes). It is safe here because a graph's only
        allocation that outlives its replay is its output, copied out right
        after the replay (`GraphedForward.__call__`), and the model's replays
        never overlap: they run under its store's lock (SharedKV.use), on the
        calling thread's current stream.
        """
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        return self._mempool

    def attach(self, owner: object, fast: FastForward) -> GraphedForward:
        """A slot and its GraphedForward for `owner`'s lifetime: both back once `owner` is collected."""
        with self._lock:
            if self.shared is None:
                self.shared = SharedKV(len(fast.inner.layers), fast.kv_heads, fast.head_dim,
                                       fast._activation_dtype(), fast.inner.embed_tokens.weight.device)
        slot = self.shared.acquire()
        with self._lock:
            self._prune()
            runner = self._runners.get(slot)
            if runner is None:
                runner = self._runners[slot] = GraphedForward(fast, SlotKV(self.shared, slot), pool=self)
            runner.fast = fast
        weakref.finalize(owner, self._release, slot)
        return runner

    def _release(self, slot: int) -> None:
        """From a garbage collection, any thread: no lock (SharedKV.release says why)."""
        runner = self._runners.get(slot)
        if runner is not None:
            runner.fast = None  # the model goes with its last user, not with the pool
        self.shared.release(slot)

    def batched(self, fast: FastForward, *inputs: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`batched_static_forward`'s logits (rows `keep`) through the model's BatchedForward.

        Call with the store held (`SharedKV.use`): the inputs are laid out for its current shape.
        """
        with self._lock:
            self._prune()
            if self._batched is None:
                self._batched = BatchedForward(None, self.shared, pool=self)
            runner = self._batched
        runner.fast = fast
        try:
            return runner(*inputs, keep=keep)
        finally:
            runner.fast = None

    def _prune(self) -> None:
        """After the store reallocated: drop every graph made over its old tensors (their memory
        goes back to the pool now, not at the runner's next call) and the runners of slots it lost."""
        if self.shared is None or self.shared.version == self._version:
            return
        self._version = self.shared.version
        for slot in list(self._runners):
            if slot >= self.shared.slots and self._runners[slot].fast is None:
                del self._runners[slot]
        for runner in [*self._runners.values(), *([self._batched] if self._batched else [])]:
            runner._captured.clear()

    @property
    def batched_runner(self) -> BatchedForward | None:
        return self._batched

    @property
    def replays(self) -> int:
        """Graph replays so far, over every runner of this model (single-sequence and batched)."""
        with self._lock:
            runners = [*self._runners.values(), *([self._batched] if self._batched else [])]
        return sum(runner.replays for runner in runners)

    @property
    def free(self) -> int:
        """Runners of slots no sequence holds (their graphs kept for the next one)."""
        return sum(runner.fast is None for runner in self._runners.values())


_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, GraphPool]" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def pool_for(model: torch.nn.Module) -> GraphPool:
    """The model's one GraphPool (it goes with the model); disabled up front where `graph_refusal` says so."""
    with _POOLS_LOCK:
        pool = _POOLS.get(model)
        if pool is None:
            pool = _POOLS[model] = GraphPool(graph_refusal(model), name=type(model).__name__)
        return pool
