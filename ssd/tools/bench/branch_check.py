"""Tree-masked branch decoding against sequential decoding, under each SDPA backend.

SSD's cache build decodes B branches at once in one row of the draft's KV
cache, separated by a tree mask (ssd.saguaro.branches.TreeBranchDecoder).
The reference is the plain thing: for each branch, roll one KVSequence back
to the branch's prefix and decode its tokens one at a time. Both run under
one SDPA backend at a time (torch.nn.attention.sdpa_kernel), because the
fused kernels differ in which masks, dtypes and head layouts they take and
in how they round; a backend that cannot run our calls is reported as
skipped, with torch's reason.

The tree is teacher-forced with the reference's greedy tokens, so its logits
are comparable at every step: greedy tokens must agree exactly except at
near-ties (the reference's top two logits closer than the tolerance), and
logits must agree within a tolerance relative to their largest magnitude.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ssd.models.graphs import pool_for
from ssd.models.kv import KVSequence
from ssd.saguaro.branches import TreeBranchDecoder

log = logging.getLogger(__name__)

# By our name; a torch without one of them simply does not list it.
BACKENDS: dict[str, SDPBackend] = {
    name: getattr(SDPBackend, attr)
    for name, attr in (("math", "MATH"), ("efficient", "EFFICIENT_ATTENTION"),
                       ("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))
    if hasattr(SDPBackend, attr)
}
# Largest |tree - sequential| allowed, relative to the largest |logit|: fp32
# differs only by summation order; bf16 rounds every activation to 8 bits, and
# the tree's B-row matmuls round differently from one-row steps.
TOLERANCE = {torch.float32: 2e-3, torch.float64: 1e-9, torch.bfloat16: 0.1, torch.float16: 0.02}
# What torch says when the chosen backend cannot run a call (the wording changed across versions).
_NO_KERNEL = ("no available kernel", "no viable backend")


@dataclass(frozen=True)
class BranchCase:
    """B branches off one cached context: branch b keeps `prefix_lens[b]` entries, then feeds `first[b]`."""

    context: list[int]
    prefix_lens: list[int]
    first: list[int]
    steps: int  # tokens decoded per branch (the first included)


def branch_case(vocab: int, context_len: int, branches: int, steps: int, seed: int = 0) -> BranchCase:
    """Branches as a cache build makes them: with the last K context tokens as the drafted
    ones, prefixes end at every acceptance length 0..K."""
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(vocab, (context_len,), generator=gen).tolist()
    k = min(steps, context_len - 1)
    prefix_lens = [context_len - k + (b % (k + 1)) for b in range(branches)]
    first = torch.randint(vocab, (branches,), generator=gen).tolist()
    return BranchCase(context, prefix_lens, first, steps)


def sequential(model: torch.nn.Module, case: BranchCase) -> tuple[list[list[int]], torch.Tensor]:
    """Each branch decoded alone, greedily: tokens [B][steps] and logits [B, steps, V].

    One cache, rolled back to each branch's prefix; longest prefix first, so
    what a rollback keeps is always the context itself, with the very keys
    and values the tree's cache holds.
    """
    kv = KVSequence(model)
    kv.forward(case.context, last_only=True)
    tokens: list[list[int]] = [[] for _ in case.first]
    logits: list[torch.Tensor] = [torch.empty(0)] * len(case.first)
    for b in sorted(range(len(case.first)), key=lambda i: -case.prefix_lens[i]):
        kv.rollback(case.prefix_lens[b])
        fed, rows = case.first[b], []
        for _ in range(case.steps):
            rows.append(kv.forward([fed])[-1].float())
            fed = int(rows[-1].argmax())
            tokens[b].append(fed)
        logits[b] = torch.stack(rows)
    return tokens, torch.stack(logits)


def tree(model: torch.nn.Module, case: BranchCase, tokens: list[list[int]]) -> torch.Tensor:
    """All branches at once under the tree mask, fed the reference's tokens: logits [B, steps, V]."""
    kv = KVSequence(model)
    kv.forward(case.context, last_only=True)
    decoder = TreeBranchDecoder()
    rows = [decoder.start(kv, case.prefix_lens, case.first).float()]
    try:
        for step in range(1, case.steps):
            rows.append(decoder.step([row[step - 1] for row in tokens]).float())
    finally:
        decoder.finish()
    return torch.stack(rows, dim=1)


def compare(tokens: list[list[int]], ref: torch.Tensor, got: torch.Tensor, tolerance: float) -> dict[str, Any]:
    """Token agreement (ties allowed) and the largest relative logit difference."""
    ref, got = ref.cpu(), got.cpu()  # the tokens are host ints; a GPU run's logits come back to meet them
    scale = float(ref.abs().max())
    diff = float((got - ref).abs().max()) / scale
    top2 = ref.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]) / scale  # [B, steps]
    ref_tokens = torch.tensor(tokens)
    differ = got.argmax(dim=-1) != ref_tokens
    near_ties = int((differ & (gap <= 2 * tolerance)).sum())
    mismatches = int(differ.sum()) - near_ties
    return {
        "passed": mismatches == 0 and diff <= tolerance,
        "token_mismatches": mismatches, "near_tie_mismatches": near_ties,
        "max_rel_logit_diff": diff, "tolerance": tolerance,
    }


def run_under(backend: SDPBackend, model: torch.nn.Module, case: BranchCase) -> dict[str, Any]:
    """The comparison under one backend, or {"ran": False, "reason": ...} where it cannot run our calls.

    On a copy of `model`: a model's CUDA graphs keep the attention kernel
    they were captured with, and its pool would replay another backend's
    graphs here. The copy's graphs are captured under `backend`;
    `graph_replays` says how many of its forwards were replays (0: eager).
    """
    model = copy.deepcopy(model)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([backend]):
            warnings.simplefilter("always")
            tokens, ref = sequential(model, case)
            got = tree(model, case, tokens)
    except RuntimeError as exc:
        if not any(s in str(exc).lower() for s in _NO_KERNEL):
            # The backend took the call and then failed: default dispatch could pick it too.
            log.exception("branch decoding failed under %s", backend)
            return {"ran": True, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
        why = [str(w.message).splitlines()[0] for w in caught][:3]  # CUDA names the failed constraint
        return {"ran": False, "reason": "; ".join(why) or str(exc).splitlines()[0]}
    tol = TOLERANCE.get(next(model.parameters()).dtype, 0.1)
    return {"ran": True, **compare(tokens, ref, got, tol), "graph_replays": pool_for(model).replays}


def check_branches(
    models: dict[str, torch.nn.Module], case: BranchCase, backends: dict[str, SDPBackend] = BACKENDS,
) -> dict[str, Any]:
    """Every (dtype name, backend) pair; passes when math ran everywhere and every backend that ran agreed."""
    results: dict[str, dict[str, Any]] = {}
    for dtype_name, model in models.items():
        for name, backend in backends.items():
            result = run_under(backend, model, case)
            results[f"{dtype_name}/{name}"] = result
            log.info("branches %s/%s: %s", dtype_name, name, _line(result))
    ran = [key for key, r in results.items() if r["ran"]]
    math_ran = all(results[f"{d}/math"]["ran"] for d in models if "math" in backends)
    return {
        "passed": bool(ran) and math_ran and all(results[key]["passed"] for key in ran),
        "ran": ran, "skipped": [key for key in results if key not in ran],
        "branches": len(case.first), "steps": case.steps, "context": len(case.context),
        "results": results,
    }


def _line(result: dict[str, Any]) -> str:
    if not result["ran"]:
        return f"skipped ({result['reason']})"
    if "error" in result:
        return f"FAILED: {result['error']}"
    verdict = "ok" if result["passed"] else "FAILED"
    return (f"{verdict}: {result['token_mismatches']} token mismatches ({result['near_tie_mismatches']} near-ties), "
            f"max rel logit diff {result['max_rel_logit_diff']:.2e} (tolerance {result['tolerance']:.0e}), "
            f"{result['graph_replays']} graph replays")
