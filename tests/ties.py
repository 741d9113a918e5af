"""Greedy outputs that may part only at near-ties of the target.

In a low precision (bf16) the target rounds a one-token forward and a
multi-token verification differently, so two exact decoding paths may pick
different tokens where the target's two best logits are within rounding of
each other. Anywhere else a difference is a bug. After the first difference
the two paths continue from different contexts, so nothing past it is
comparable.
"""

from __future__ import annotations

from typing import Sequence

import torch


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def assert_equal_up_to_near_tie(
    model: torch.nn.Module, prompt: Sequence[int], expected: Sequence[int], got: Sequence[int], tol: float
) -> None:
    """`got` equals `expected` (both continuations of `prompt`), or they part at
    a near-tie: at the first difference, the target's logits after the shared
    prefix (one fresh forward) put both parting tokens within `tol` of the
    largest logit, so in particular the top-2 logit gap is below `tol`."""
    i = first_difference(expected, got)
    if i is None:
        return
    assert i < min(len(expected), len(got)), f"one output stops at {i} where the other goes on"
    logits = model(input_ids=torch.tensor([list(prompt) + list(expected[:i])])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    behind = {t: float(top[0] - logits[t]) for t in (expected[i], got[i])}
    assert gap < tol and max(behind.values()) < tol, (
        f"outputs part at token {i} ({expected[i]} vs {got[i]}, {behind} behind the best logit; "
        f"top-2 gap {gap:.3f}), not a near-tie (tolerance {tol})"
    )
