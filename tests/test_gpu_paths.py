"""The GPU hot path's choices, checked on the CPU by forcing them.

On CUDA the lean forward runs each segment's attention as one SDPA call
(ssd.models.fast.one_call_attention); on the CPU it keeps one call per row.
Forced on the CPU, the one-call path must give the per-row path's logits up
to floating-point summation order, for every shape the engines use.
"""

from __future__ import annotations

import pytest
import torch

from ssd.models.fast import FastForward, one_call_attention
from ssd.models.kv import KVSequence, forward_rows

TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: only the order of a softmax's sums may differ


def sequence(model, one_call: bool) -> KVSequence:
    kv = KVSequence(model, fast=True)
    kv._fast = FastForward(model, one_call=one_call)
    kv.reset()
    return kv


def script(kv: KVSequence) -> list[torch.Tensor]:
    """Prefill, decode, verification-sized forwards, a long prefill, tree-masked rows."""
    out = [kv.forward([1, 2, 3, 4, 5, 6, 7])]
    out += [kv.forward([t], last_only=True) for t in (8, 9)]
    out.append(kv.forward([10, 11, 12, 13, 14]))  # verify K = 4
    kv.rollback(3)
    out.append(kv.forward([(5 * i) % 16 for i in range(80)]))  # past ROW_LIMIT: a causal mask either way
    n = kv.cached
    visible = torch.ones(3, n + 3, dtype=torch.bool)
    visible[:, n:] = torch.eye(3, dtype=torch.bool)  # three branches that see the prefix and themselves
    visible[1, n - 5 : n] = False
    out.append(kv.extend([1, 2, 3], torch.tensor([n, n, n - 5]), visible))
    return out


def test_attention_is_one_call_on_cuda_and_per_row_elsewhere():
    assert one_call_attention(torch.device("cuda", 0)) and one_call_attention("cuda")
    assert not one_call_attention(torch.device("cpu"))


def test_the_one_call_path_equals_the_per_row_path(tiny_models):
    target, _ = tiny_models  # 4 query heads over 2 kv heads: the grouped fold is exercised
    assert target.config.num_attention_heads != target.config.num_key_value_heads
    for got, want in zip(script(sequence(target, True)), script(sequence(target, False)), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_packed_rows_agree_on_both_paths(tiny_models):
    target, _ = tiny_models
    ids = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    results = []
    for one_call in (True, False):
        rows = [sequence(target, one_call) for _ in ids]
        for row, prefix in zip(rows, ([3, 3], [1, 2, 3, 4, 5], [7])):
            row.forward(prefix)
        results.append(forward_rows(rows, ids))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **TOL)
