"""Exact target distributions of short continuations, by enumeration."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from ssd.config import SamplingConfig
from ssd.sampling import probs_from_logits


@torch.no_grad()
def exact_marginal(
    model: torch.nn.Module, prompt: list[int], n: int, sampling: SamplingConfig, positions: list[int]
) -> dict[tuple[int, ...], float]:
    """P(tokens at `positions` | prompt) over the first n generated tokens.

    Every continuation of length n is scored in one batched forward (V^n rows,
    fine for a tiny vocabulary); its probability is the product of the
    sampling pipeline's conditionals.
    """
    vocab = model.config.vocab_size
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(vocab), repeat=n)])
    logits = model(input_ids=seqs).logits[:, len(prompt) - 1 : -1]  # [V^n, n, V]
    probs = probs_from_logits(logits, sampling)
    gen_tokens = seqs[:, len(prompt) :]
    joint = torch.gather(probs, 2, gen_tokens.unsqueeze(-1)).squeeze(-1).prod(dim=1)
    marginal: dict[tuple[int, ...], float] = defaultdict(float)
    for row, p in zip(gen_tokens[:, positions].tolist(), joint.tolist()):
        if p > 0:
            marginal[tuple(row)] += p
    return dict(marginal)
