"""Timings of the GPU hot path's variants (launch/gpu_smoke.py): attention per
row against one call per layer, and the static-shape forward eager against
replayed as a CUDA graph.

Each forward writes its rows at the same cache slots after `prefix` context
tokens, so every repeat times the same shape. Variants:
- target decode (1 row) and verification (K + 1 rows), causal:
  per_row, one_call (ssd.models.fast), static (ssd.models.graphs, eager) and,
  on CUDA, graph (the static forward replayed; labelled "graph failed: eager"
  when the capture failed and what was timed ran eagerly);
- a draft tree step of B rows under a tree mask: lean (the lean forward: one
  call with a mask on every device), static and, on CUDA, graph;
- a decode step of a batch of sequences (`time_batches`): packed (the lean
  packed forward: attention per sequence) against batched (the batched rows'
  static forward over the model's shared store, one attention call for the
  batch), labelled "batched graph" on CUDA when every step replayed a graph,
  "batched graph failed: eager" when not, "batched static" (eager) elsewhere.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ssd.models.fast import FastForward
from ssd.models.graphs import GraphedForward, causal_mask, padded_mask, pool_for, use_cuda_graphs
from ssd.models.kv import Feed, KVSequence, feed_rows


def _median_s(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `run()` after one untimed warm-up (a graph's capture happens there)."""
    times = []
    for rep in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _cache_after(fast: FastForward, prefix: int, rows: int, device: torch.device):
    cache = fast.new_cache()
    cache.reserve(prefix + rows, keep=0)
    ids = torch.arange(prefix, device=device) % fast.model.config.vocab_size
    fast(cache, ids, torch.arange(prefix, device=device), 0)
    return cache


def time_rows(model: torch.nn.Module, rows: int, prefix: int, repeats: int, tree: bool = False) -> dict[str, float]:
    """Seconds per forward of `rows` rows after `prefix` tokens, per variant (see the module docstring)."""
    device = model.model.embed_tokens.weight.device
    ids = torch.arange(1, rows + 1, device=device) % model.config.vocab_size
    slots = torch.arange(prefix, prefix + rows, device=device)
    if tree:  # B branches off the full prefix, each seeing itself: a tree step's shape
        visible = torch.cat([torch.ones(rows, prefix, dtype=torch.bool, device=device),
                             torch.eye(rows, dtype=torch.bool, device=device)], dim=1)
        positions, mask = torch.full((rows,), prefix, device=device), visible
        lean = {"lean": FastForward(model)}
    else:
        positions, mask = slots, None
        lean = {"per_row": FastForward(model, one_call=False), "one_call": FastForward(model, one_call=True)}
    out = {}
    for name, fast in lean.items():
        cache = _cache_after(fast, prefix, rows, device)
        out[name] = _median_s(lambda: fast(cache, ids, positions, prefix, mask), device, repeats)
    fast = next(iter(lean.values()))
    variants = {"static": False} | ({"graph": True} if use_cuda_graphs(device) else {})
    for name, graphs in variants.items():
        cache = _cache_after(fast, prefix, rows, device)
        full = causal_mask(prefix, rows, cache.capacity, device) if mask is None else padded_mask(mask, cache.capacity)
        runner = GraphedForward(fast, cache, graphs=graphs)
        seconds = _median_s(lambda: runner(ids, positions, slots, full), device, repeats)
        out[variant_label(name, runner)] = seconds
    return out


FAILED_GRAPH = "graph failed: eager"


def variant_label(name: str, runner: GraphedForward) -> str:
    """`name`, except for a "graph" variant whose forwards did not all replay a graph
    (its capture failed: what was timed ran eagerly) -- labelled FAILED_GRAPH."""
    if name == "graph" and (not runner.replays or runner.eager_runs):
        return FAILED_GRAPH
    return name


def time_hot_path(target: torch.nn.Module, draft: torch.nn.Module, k: int, budgets: tuple[int, ...],
                  prefix: int, repeats: int) -> dict[str, dict[str, float]]:
    """{"target decode": {variant: s}, "target verify K=k": ..., "draft tree step B=b": ...}."""
    out = {
        "target decode": time_rows(target, 1, prefix, repeats),
        f"target verify K={k}": time_rows(target, k + 1, prefix, repeats),
    }
    for budget in budgets:
        out[f"draft tree step B={budget}"] = time_rows(draft, budget, prefix, repeats, tree=True)
    return out


def time_batches(model: torch.nn.Module, sizes: tuple[int, ...], prefix: int,
                 repeats: int) -> dict[str, dict[str, float]]:
    """{"target decode batch of N": {variant: s}} per N in `sizes` (see the module docstring)."""
    return {f"target decode batch of {rows}": time_batch(model, rows, prefix, repeats) for rows in sizes}


def time_batch(model: torch.nn.Module, rows: int, prefix: int, repeats: int) -> dict[str, float]:
    """Seconds per decode step of `rows` sequences after `prefix` tokens each, rolled back after
    every step so that each repeat runs the same shapes."""
    device = model.model.embed_tokens.weight.device
    context = [(7 * i) % model.config.vocab_size for i in range(prefix)]
    out = {}
    for name, slots in (("packed", False), ("batched", True)):
        seqs = [KVSequence(model, slots=slots) for _ in range(rows)]
        for kv in seqs:
            kv.forward(context, last_only=True)

        def step() -> None:
            feed_rows([Feed(kv, [i % model.config.vocab_size], 1) for i, kv in enumerate(seqs)])
            for kv in seqs:
                kv.rollback(prefix)

        seconds = _median_s(step, device, repeats)
        out[name if not slots else batch_label(model, device)] = seconds
    return out


def batch_label(model: torch.nn.Module, device: torch.device) -> str:
    """What the batched variant ran: graphs on CUDA (FAILED_BATCH_GRAPH if any step did not replay one)."""
    if not use_cuda_graphs(device):
        return "batched static"
    runner = pool_for(model).batched_runner
    return "batched graph" if runner is not None and runner.replays and not runner.eager_runs else FAILED_BATCH_GRAPH


FAILED_BATCH_GRAPH = "batched graph failed: eager"
