"""The GPU smoke's CUDA graph check: do captured forwards compute what the lean forward does?

On each device checked (the smoke's, plus another index on a machine with
several GPUs, while device 0 stays the thread's current one: the case where
a capture on the wrong device records an empty graph), a sequence decodes
and verifies through KVSequence (CUDA graph replays) next to the lean
forward on a cache of its own, step for step. On the smoke's device, 2 and
batching.max_rows sequences likewise prefill, decode and verify as packed
batches (`check_batched_on`: the batched rows' graphs, ssd.models.graphs.BatchedForward)
next to the lean packed forward. It passes when every step's
logits agree (up to summation order: the static forward attends over the
whole capacity), consecutive steps' logits differ (a stale graph output
would repeat), and, on CUDA, graphs did replay and the model's pool was
not turned off. On a CPU it runs the same comparison without graphs, so the
check itself cannot rot.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ssd.config import BatchingConfig
from ssd.models.fast import FastForward, Segment
from ssd.models.graphs import pool_for, use_cuda_graphs
from ssd.models.kv import Feed, KVSequence, feed_rows
from ssd.models.shapes import RandomModelSpec, build_random_model

log = logging.getLogger(__name__)

PROMPT_LEN = 24
DECODE_STEPS = 6
VERIFY_ROWS = 5
REL_TOL = 1e-3  # fp32; a wrong or stale graph is off by O(1)


def devices_to_check(device: str) -> list[str]:
    """`device`, plus another CUDA index when the machine has more than one GPU."""
    out = [device]
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        index = torch.device(device).index or 0
        out.append(f"cuda:{(index + 1) % torch.cuda.device_count()}")
    return out


def batch_sizes() -> tuple[int, ...]:
    """Rows of the batched check: two, and the default batch limit (batching.max_rows)."""
    return tuple(sorted({2, BatchingConfig().max_rows}))


def check_graphs(spec: RandomModelSpec, device: str) -> dict[str, Any]:
    """{device: result} for every device of `devices_to_check`, and the batched rows' graphs
    on `device` ({rows: result}); passed when all pass."""
    fp32 = spec.with_dtype("fp32")
    results = {d: check_graphs_on(fp32, d) for d in devices_to_check(device)}
    batched = {rows: check_batched_on(fp32, device, rows) for rows in batch_sizes()}
    passed = all(r["passed"] for r in [*results.values(), *batched.values()])
    return {"passed": passed, "devices": results, "batched": batched}


class _Tally:
    """The largest relative difference from the lean forward, and outputs equal to the previous step's."""

    def __init__(self) -> None:
        self.worst, self.repeated, self._previous = 0.0, 0, None

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.float(), want.float()
        self.worst = max(self.worst, float((got - want).abs().max() / (want.abs().max() + 1e-6)))
        if self._previous is not None and got.shape == self._previous.shape and torch.equal(got, self._previous):
            self.repeated += 1  # a stale graph output would repeat
        self._previous = got


@torch.inference_mode()
def check_graphs_on(spec: RandomModelSpec, device: str) -> dict[str, Any]:
    model = build_random_model(spec, device)
    dev = torch.device(device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(spec.seed)
    tokens = torch.randint(vocab, (PROMPT_LEN + DECODE_STEPS + VERIFY_ROWS,), generator=gen).tolist()
    seq, fast = KVSequence(model), FastForward(model)
    cache = fast.new_cache()
    steps = [tokens[:PROMPT_LEN]] + [[t] for t in tokens[PROMPT_LEN:-VERIFY_ROWS]] + [tokens[-VERIFY_ROWS:]]
    tally, start = _Tally(), 0
    for ids in steps:
        want = fast(cache, torch.tensor(ids, device=dev), torch.arange(start, start + len(ids), device=dev), start)
        tally.add(seq.forward(ids), want)
        start += len(ids)
    result = _verdict(model, dev, tally, seq._graphed)
    result["current_device"] = torch.cuda.current_device() if dev.type == "cuda" else None
    log.info("graph check on %s: %s", device, result)
    return result


@torch.inference_mode()
def check_batched_on(spec: RandomModelSpec, device: str, rows: int) -> dict[str, Any]:
    """`rows` sequences prefilled with prompts of different lengths, then decoded and verified
    (ragged) as packed batches (ssd.models.kv.feed_rows: the batched graphs on CUDA), step for
    step against the lean packed forward over caches of their own."""
    model = build_random_model(spec, device)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(spec.seed + rows)

    def draw(n: int) -> list[int]:
        return torch.randint(model.config.vocab_size, (n,), generator=gen).tolist()

    seqs, fast = [KVSequence(model) for _ in range(rows)], FastForward(model)
    caches, starts = [fast.new_cache() for _ in range(rows)], [0] * rows
    rounds = [[draw(PROMPT_LEN - 3 * (i % 4)) for i in range(rows)]]
    rounds += [[draw(1) for _ in range(rows)] for _ in range(DECODE_STEPS)]
    rounds.append([draw(VERIFY_ROWS - i % 3) for i in range(rows)])  # verification of ragged lengths
    tally = _Tally()
    for ids in rounds:
        got = feed_rows([Feed(kv, x, len(x)) for kv, x in zip(seqs, ids)])
        segments = [Segment(c, st, len(x)) for c, st, x in zip(caches, starts, ids)]
        positions = torch.cat([torch.arange(st, st + len(x)) for st, x in zip(starts, ids)]).to(dev)
        want = fast.packed(segments, torch.tensor(sum(ids, []), device=dev), positions)
        tally.add(torch.cat(got), want)
        starts = [st + len(x) for st, x in zip(starts, ids)]
    result = _verdict(model, dev, tally, pool_for(model).batched_runner if use_cuda_graphs(dev) else None)
    log.info("batched graph check on %s, %d rows: %s", device, rows, result)
    return result


def _verdict(model: torch.nn.Module, dev: torch.device, tally: _Tally, runner: Any) -> dict[str, Any]:
    """Passed: close to the lean forward, no repeated output, and on CUDA graphs replayed and stayed on."""
    replays = runner.replays if runner is not None else 0
    disabled = pool_for(model).disabled if use_cuda_graphs(dev) else None
    graphs_expected = use_cuda_graphs(dev)
    ok = tally.worst <= REL_TOL and not tally.repeated
    passed = ok and (not graphs_expected or (replays > 0 and disabled is None))
    return {"passed": passed, "max_rel_diff": tally.worst, "repeated_outputs": tally.repeated,
            "graph_replays": replays, "buckets": runner.buckets if runner is not None else [], "graphs_off": disabled}
