"""Exact target distributions of short continuations, and a chi-square test against them.

The distribution checks (the test suite's, the GPU smoke's) sample a tiny
model's continuations many times under fixed seeds and compare the counts
with the law the target and the sampling pipeline define, enumerated here.
The p-value needs no scipy (the GPU machine has none): chi2.sf(x, df) is
the regularized upper incomplete gamma function Q(df / 2, x / 2).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping

import torch

from ssd.config import SamplingConfig
from ssd.models.kv import cache_kwargs
from ssd.sampling import probs_from_logits


def _cache_of(out) -> object:
    """The returned cache: `cache` in transformers 5.24, `past_key_values` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    cache, probs = _cache_of(out), probs_from_logits(out.logits[:, -1], sampling).double().cpu()  # [1, V]
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # the live prefixes, one per row
    mass = torch.ones(1, dtype=torch.float64)  # their probabilities
    for _ in range(max(positions)):
        children = (mass.unsqueeze(1) * probs).flatten()  # row-major: parent, then token
        live = children.nonzero().squeeze(1)
        parent, token = live // probs.shape[-1], live % probs.shape[-1]
        prefixes = torch.cat([prefixes[parent], token.unsqueeze(1)], dim=1)
        mass = children[live]
        cache.batch_select_indices(parent.to(device))  # each child continues its parent's cache
        out = model(input_ids=token.unsqueeze(1).to(device), **cache_kwargs(model, cache), use_cache=True)
        cache, probs = _cache_of(out), probs_from_logits(out.logits[:, -1], sampling).double().cpu()
    joint = mass.unsqueeze(1) * probs  # [rows, V]: each prefix, then the last tested token
    marginal: dict[tuple[int, ...], float] = defaultdict(float)
    for row, masses in zip(prefixes.tolist(), joint.tolist()):
        for last, p in enumerate(masses):
            if p > 0:
                seq = [*row, last]
                marginal[tuple(seq[i] for i in positions)] += p
    return dict(marginal)


def exact_marginal_stepwise(
    next_logits: Callable[[list[int]], torch.Tensor], n: int, sampling: SamplingConfig, positions: list[int]
) -> dict[tuple[int, ...], float]:
    """exact_marginal for a model behind a function: `next_logits(prefix)` is the target's
    next-token logits [V] after the prompt and the generated tokens `prefix`.

    The tree is walked depth first, so a model that keeps one cache (a llama.cpp
    sequence, say) only rolls back to the parent between siblings; prefixes of
    probability 0 are pruned, and the last tested token's whole row is read off
    its prefix's logits, as in exact_marginal.
    """
    if not positions or max(positions) >= n:
        raise ValueError(f"positions {positions} must lie in 0..{n - 1}")
    marginal: dict[tuple[int, ...], float] = defaultdict(float)

    def visit(prefix: list[int], mass: float) -> None:
        probs = probs_from_logits(next_logits(prefix).unsqueeze(0), sampling)[0].double().tolist()
        for token, p in enumerate(probs):
            if p <= 0:
                continue
            seq = [*prefix, token]
            if len(seq) > max(positions):
                marginal[tuple(seq[i] for i in positions)] += mass * p
            else:
                visit(seq, mass * p)

    visit([], 1.0)
    return dict(marginal)


def chi_square_pvalue(samples: list[Hashable], expected: Mapping[Hashable, float]) -> float:
    """p-value of `samples` against the exact probabilities `expected`.

    Cells with an expected count below 5 are pooled into one cell, so the
    chi-square approximation holds. A sample outside the support of `expected`
    fails the test outright (p-value 0).
    """
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(x, 0.0) <= 0.0 for x in counts):
        return 0.0
    observed, predicted = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for cell, prob in expected.items():
        if n * prob >= 5:
            observed.append(counts.get(cell, 0))
            predicted.append(n * prob)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += n * prob
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    if len(observed) < 2:
        raise ValueError("too few cells for a chi-square test; draw more samples")
    scale = sum(observed) / sum(predicted)  # absorbs float drift in `expected`
    stat = sum((o - e * scale) ** 2 / (e * scale) for o, e in zip(observed, predicted))
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))
