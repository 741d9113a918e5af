"""Exact target distributions of short continuations, by enumeration."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from ssd.config import SamplingConfig
from ssd.sampling import probs_from_logits

CHUNK_ROWS = 4096  # sequences per forward: bounds memory at V^n in the tens of thousands


@torch.no_grad()
def exact_marginal(
    model: torch.nn.Module, prompt: list[int], n: int, sampling: SamplingConfig, positions: list[int]
) -> dict[tuple[int, ...], float]:
    """P(tokens at `positions` | prompt), positions counted from the first generated token.

    Tokens after the last tested position do not change the marginal, so only
    the first max(positions) + 1 tokens are enumerated: every prefix of
    max(positions) tokens is scored in batched forwards (V^max(positions) rows,
    fine for a tiny vocabulary), and the last token's whole row is read off
    the prefix's final logits. A prefix's probability is the product of the
    sampling pipeline's conditionals. `n` (the tokens generated) only bounds
    the positions.
    """
    if not positions or max(positions) >= n:
        raise ValueError(f"positions {positions} must lie in 0..{n - 1}")
    vocab = model.config.vocab_size
    depth = max(positions)  # tokens before the last tested one
    marginal: dict[tuple[int, ...], float] = defaultdict(float)
    prefixes = list(itertools.product(range(vocab), repeat=depth))
    for start in range(0, len(prefixes), CHUNK_ROWS):
        rows = prefixes[start : start + CHUNK_ROWS]
        chunk = torch.tensor(rows, dtype=torch.long).reshape(len(rows), depth)
        seqs = torch.cat([torch.tensor(prompt).expand(len(chunk), -1), chunk], dim=1)
        probs = probs_from_logits(model(input_ids=seqs).logits[:, len(prompt) - 1 :], sampling)  # [R, depth+1, V]
        prefix_prob = torch.gather(probs[:, :-1], 2, chunk.unsqueeze(-1)).squeeze(-1).prod(dim=1)
        joint = prefix_prob.unsqueeze(1) * probs[:, -1]  # [R, V]: prefix, then the last token
        for row, masses in zip(chunk.tolist(), joint.tolist()):
            for last, p in enumerate(masses):
                if p > 0:
                    seq = row + [last]
                    marginal[tuple(seq[i] for i in positions)] += p
    return dict(marginal)
