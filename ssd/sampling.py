"""The one sampling pipeline, shared by draft and target.

logits -> probabilities under temperature, top-k and top-p; temperature 0 is
greedy and yields a one-hot distribution on the argmax, so greedy decoding is
the same code path as sampling (a one-hot q or p verifies exactly like any
other distribution). Draws come from a per-request torch.Generator so a seed
fixes the output.

Devices: probabilities stay where the logits are (a GPU's, in the cluster);
the generator stays on the CPU, so a seed gives the same draws on any device.
The uniforms are drawn there, moved (a few bytes) to the probabilities'
device, and the inverse CDF runs beside the probabilities; only the chosen
ids come back to the host, once per call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ssd.config import SamplingConfig


# The dtype of the draft's q rows: the draft draws each token from the row
# rounded to this dtype and ships that very row, so verification (which reads
# q at the drafted tokens and in the residual, ssd.verify.draft_law) uses the
# law the token came from. float32 halves the bytes that cross the link
# (K rows of V per speculation: 4 x 128k x 8 B = 4 MB a reply in float64).
Q_DTYPE = torch.float32


def as_drawn(q: torch.Tensor) -> torch.Tensor:
    """The q rows a draft draws from and ships: `q` rounded to Q_DTYPE (see above)."""
    return q.to(Q_DTYPE)


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def probs_from_logits(
    logits: torch.Tensor, params: SamplingConfig, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of logits [..., V] -> rows of probabilities [..., V] in float64.

    float64 keeps the ratio test and the residual max(0, p - q) free of
    rounding noise that could otherwise leave a tiny spurious residual.
    `bias` [..., V]: a request's logits processing (ssd.engine.processing:
    logit_bias, penalties, a grammar's -inf mask), added before everything
    else, so greedy, temperature, top-k and top-p all see the processed logits.
    """
    logits = _biased(logits, bias)
    if params.greedy:
        return one_hot_argmax(logits)
    # Shift before scaling: (l - max) / T is <= 0, so a tiny T (even a subnormal
    # one) sends every non-maximal logit to -inf instead of overflowing the
    # maximum to +inf (inf - inf = nan). Tiny temperatures thus approach greedy
    # continuously: uniform over exact ties of the maximum, one-hot otherwise.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        logits = _mask_top_k(logits, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _mask_top_p(probs, params.top_p)
    return probs


def token_logprobs(
    logits: torch.Tensor, params: SamplingConfig, tokens: Sequence[int], top_n: int,
    bias: torch.Tensor | None = None,
) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each token i: (log p_i[token], the top_n (id, log p_i) pairs), p_i the
    distribution of logits row i [n, V] under `params`.

    Sampled requests get the log of exactly the distribution verification and
    sampling use (probs_from_logits); greedy ones the log-softmax at
    temperature 1, since their one-hot distribution carries no information.
    """
    if not tokens:
        return []
    rows = _biased(logits[: len(tokens)], None if bias is None else bias[: len(tokens)])
    if params.greedy:
        logp = torch.log_softmax(rows, dim=-1)
    else:
        logp = torch.log(probs_from_logits(rows, params))
    chosen = logp.gather(-1, torch.tensor(list(tokens), device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if top_n <= 0:
        return [(value, []) for value in chosen]
    values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return list(zip(chosen, tops))


def _biased(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = logits.to(torch.float64)
    return logits if bias is None else logits + bias.to(logits.device, torch.float64)


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


def sample_ids(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Token ids on probs' device: one per row of [..., V] (rows need not be normalised).

    One uniform per row from the CPU generator; nothing is read back to the host.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    # r <= 1 - 2**-53 (torch draws float64 uniforms as multiples of 2**-53), so
    # u = r * total stays strictly below total after rounding: some cdf entry exceeds it.
    u = uniforms(gen, (*probs.shape[:-1], 1)).to(cdf.device, non_blocking=True) * cdf[..., -1:]
    # right=True: the first index whose cdf exceeds u, never a zero-mass token.
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one token id from a probability row [V] (need not be normalised): one host read."""
    token = int(sample_ids(probs, gen))
    if token >= probs.shape[-1]:
        raise ValueError("cannot sample from a row without probability mass")
    return token


def sample_rows(probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One draw per row of [B, V]; the same inverse-CDF rule as `sample`, one host read."""
    tokens = sample_ids(probs, gen).tolist()
    if any(t >= probs.shape[-1] for t in tokens):
        raise ValueError("cannot sample from a row without probability mass")
    return tokens


def uniforms(gen: torch.Generator, shape: int | Sequence[int] = ()) -> torch.Tensor:
    """U[0, 1) draws in float64 from the request's generator, always on the CPU."""
    return torch.rand(shape, generator=gen, dtype=torch.float64)
