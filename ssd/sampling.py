"""The one sampling pipeline, shared by draft and target.

logits -> probabilities under temperature, top-k and top-p; temperature 0 is
greedy and yields a one-hot distribution on the argmax, so greedy decoding is
the same code path as sampling (a one-hot q or p verifies exactly like any
other distribution). Draws come from a per-request torch.Generator so a seed
fixes the output.
"""

from __future__ import annotations

import torch

from ssd.config import SamplingConfig


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingConfig) -> torch.Tensor:
    """Rows of logits [..., V] -> rows of probabilities [..., V] in float64.

    float64 keeps the ratio test and the residual max(0, p - q) free of
    rounding noise that could otherwise leave a tiny spurious residual.
    """
    logits = logits.to(torch.float64)
    if params.greedy:
        return one_hot_argmax(logits)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        logits = _mask_top_k(logits, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _mask_top_p(probs, params.top_p)
    return probs


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy as a distribution; ties go to the lowest id, as torch.argmax does."""
    out = torch.zeros_like(logits, dtype=torch.float64)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    # Ties with the k-th logit are kept, as in HF transformers' TopKLogitsWarper.
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p  # the first token always stays
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one token id from a probability row [V] (need not be normalised)."""
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    # right=True: the first index whose cdf exceeds u, never a zero-mass token.
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= probs.shape[-1]:  # u rounded up to the total: take the last live token
        token = int(torch.nonzero(probs)[-1])
    return token


def uniform(gen: torch.Generator) -> float:
    """One U[0, 1) draw from the request's generator."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def saguaro_rescale(q: torch.Tensor, top_ids: torch.Tensor, c: float) -> torch.Tensor:
    """Saguaro sampling: q' proportional to c*q on `top_ids` (the draft's cached
    guesses for this position) and q elsewhere, 0 <= c <= 1.

    Lower c moves proposal mass off the cached tokens, so after a rejection the
    residual max(0, p - q') leans toward them and the cache hits more often,
    at some cost in acceptance. Verification must use q' itself. When every
    token with mass is in `top_ids` and c == 0, q' would be 0/0: q is kept.
    """
    if c == 1.0 or top_ids.numel() == 0:
        return q
    out = q.clone()
    out[..., top_ids] *= c
    mass = out.sum(dim=-1, keepdim=True)
    if (mass <= 0).any():
        return q
    return out / mass


def top_ids(probs: torch.Tensor, f: int, exclude: int | None = None) -> torch.Tensor:
    """The f most likely token ids with nonzero mass, optionally skipping one id."""
    if f <= 0:
        return torch.empty(0, dtype=torch.long)
    probs = probs if exclude is None else probs.clone().index_fill_(-1, torch.tensor([exclude]), 0.0)
    values, ids = torch.topk(probs, min(f, probs.shape[-1]))
    return ids[values > 0]
