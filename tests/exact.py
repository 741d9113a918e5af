"""Exact target distributions of short continuations, by enumeration."""

from __future__ import annotations

from collections import defaultdict

import torch

from ssd.config import SamplingConfig
from ssd.sampling import probs_from_logits


@torch.no_grad()
def exact_marginal(
    model: torch.nn.Module, prompt: list[int], n: int, sampling: SamplingConfig, positions: list[int]
) -> dict[tuple[int, ...], float]:
    """P(tokens at `positions` | prompt), positions counted from the first generated token.

    Tokens after the last tested position do not change the marginal, so the
    enumeration stops there: the tree of continuations is expanded one token
    per level, every live prefix a row of one batched forward over the KV
    cache of its parent (at most V^max(positions) rows, fine for a tiny
    vocabulary), and prefixes of probability 0 (top-k, top-p) are pruned. The
    last tested token's whole row is read off its prefix's final logits. A
    prefix's probability is the product of the sampling pipeline's
    conditionals. `n` (the tokens generated) only bounds the positions.
    """
    if not positions or max(positions) >= n:
        raise ValueError(f"positions {positions} must lie in 0..{n - 1}")
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, probs = out.cache, probs_from_logits(out.logits[:, -1], sampling)  # [1, V]
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # the live prefixes, one per row
    mass = torch.ones(1, dtype=torch.float64)  # their probabilities
    for _ in range(max(positions)):
        children = (mass.unsqueeze(1) * probs).flatten()  # row-major: parent, then token
        live = children.nonzero().squeeze(1)
        parent, token = live // probs.shape[-1], live % probs.shape[-1]
        prefixes = torch.cat([prefixes[parent], token.unsqueeze(1)], dim=1)
        mass = children[live]
        cache.batch_select_indices(parent)  # each child continues its parent's cache
        out = model(input_ids=token.unsqueeze(1), cache=cache, use_cache=True)
        cache, probs = out.cache, probs_from_logits(out.logits[:, -1], sampling)
    joint = mass.unsqueeze(1) * probs  # [rows, V]: each prefix, then the last tested token
    marginal: dict[tuple[int, ...], float] = defaultdict(float)
    for row, masses in zip(prefixes.tolist(), joint.tolist()):
        for last, p in enumerate(masses):
            if p > 0:
                seq = [*row, last]
                marginal[tuple(seq[i] for i in positions)] += p
    return dict(marginal)
