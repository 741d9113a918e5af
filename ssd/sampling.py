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


def sample_rows(probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One draw per row of [B, V]; the same inverse-CDF rule as `sample`, vectorised."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=gen, dtype=torch.float64) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1)
    over = tokens >= probs.shape[-1]
    if over.any():  # u rounded up to a row's total: take that row's last live token
        last_live = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        tokens = torch.where(over, last_live, tokens)
    return tokens.tolist()


def uniform(gen: torch.Generator) -> float:
    """One U[0, 1) draw from the request's generator."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def saguaro_rescale_rows(q: torch.Tensor, f: int, c: float) -> torch.Tensor:
    """Saguaro sampling: per row of q [B, V], q' proportional to c*q on the
    row's top-f tokens (the draft's cached guesses for that position) and q
    elsewhere, 0 <= c <= 1.

    Lower c moves proposal mass off the cached tokens, so after a rejection the
    residual max(0, p - q') leans toward them and the cache hits more often,
    at some cost in acceptance. Verification must use q' itself. A row whose
    whole mass sits on its top-f with c == 0 would be 0/0: it keeps q.
    """
    if c == 1.0 or f <= 0:
        return q
    values, ids = torch.topk(q, min(f, q.shape[-1]), dim=-1)
    scale = torch.ones_like(q).scatter_(-1, ids, torch.where(values > 0, c, 1.0).to(q.dtype))
    out = q * scale
    mass = out.sum(dim=-1, keepdim=True)
    # Rows whose whole mass sat on the top-f with c == 0 keep q.
    return torch.where(mass > 0, out / mass.clamp_min(torch.finfo(q.dtype).tiny), q)
