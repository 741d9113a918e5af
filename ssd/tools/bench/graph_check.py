"""The GPU smoke's CUDA graph check: do captured forwards compute what the lean forward does?

On each device checked (the smoke's, plus another index on a machine with
several GPUs, while device 0 stays the thread's current one: the case where
a capture on the wrong device records an empty graph), a sequence decodes
and verifies through KVSequence (CUDA graph replays) next to the lean
forward on a cache of its own, step for step. It passes when every step's
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

from ssd.models.fast import FastForward
from ssd.models.graphs import pool_for, use_cuda_graphs
from ssd.models.kv import KVSequence
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


def check_graphs(spec: RandomModelSpec, device: str) -> dict[str, Any]:
    """{device: result} for every device of `devices_to_check`; passed when all pass."""
    results = {d: check_graphs_on(spec.with_dtype("fp32"), d) for d in devices_to_check(device)}
    return {"passed": all(r["passed"] for r in results.values()), "devices": results}


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
    worst, previous, repeated, start = 0.0, None, 0, 0
    for ids in steps:
        got = seq.forward(ids).float()
        want = fast(cache, torch.tensor(ids, device=dev), torch.arange(start, start + len(ids), device=dev), start)
        start += len(ids)
        worst = max(worst, float((got - want.float()).abs().max() / (want.float().abs().max() + 1e-6)))
        if previous is not None and got.shape == previous.shape and torch.equal(got, previous):
            repeated += 1
        previous = got
    graphed = seq._graphed
    replays = graphed.replays if graphed is not None else 0
    disabled = pool_for(model).disabled if use_cuda_graphs(dev) else None
    graphs_expected = use_cuda_graphs(dev)
    passed = worst <= REL_TOL and not repeated and (not graphs_expected or (replays > 0 and disabled is None))
    result = {"passed": passed, "max_rel_diff": worst, "repeated_outputs": repeated, "graph_replays": replays,
              "buckets": graphed.buckets if graphed is not None else [], "graphs_off": disabled,
              "current_device": torch.cuda.current_device() if dev.type == "cuda" else None}
    log.info("graph check on %s: %s", device, result)
    return result
