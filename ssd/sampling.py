"""The one sampling pipeline, shared by draft and target.

logits -> probabilities under temperature, min-p, top-k and top-p; temperature 0 is
greedy and yields a one-hot distribution on the argmax, so greedy decoding is
the same code path as sampling (a one-hot q or p verifies exactly like any
other distribution). Draws come from a per-request torch.Generator so a seed
fixes the output; under coupled sampling (`sampling.coupling: gumbel`) from
noise keyed by (seed, position, token) instead, so a seed fixes the output of
AR, SD and SSD alike (see "Coupled sampling" below and docs/exactness.md).

Devices: probabilities stay where the logits are (a GPU's, in the cluster);
the generator stays on the CPU, so a seed gives the same draws on any device.
The uniforms are drawn there, moved (a few bytes) to the probabilities'
device, and the inverse CDF runs beside the probabilities; only the chosen
ids come back to the host, once per call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ssd.config import SamplingConfig


# The dtype of the draft's q rows: the draft draws each token from the row
# rounded to this dtype and ships that very row, so verification (which reads
# q at the drafted tokens and in the residual, ssd.verify.draft_law) uses the
# law the token came from: the upcast rounded row over its own sum, on both
# sides (every bfloat16 value is exact in float64, on any device). Exactness
# needs only that both sides see the same row, so the dtype is chosen for the
# link: K rows of V a reply (7 x 152k x 4 B = 4.3 MB in float32) halve in
# bfloat16. bfloat16, not float16: float32's exponent range, so no probability
# above 1e-38 rounds to 0. Each entry moves by at most 2^-8 of itself, the row's
# law by < 0.1 % in total variation over the real vocabulary (0.4 % at worst),
# which bounds what the draft's acceptance can lose (docs/cluster.md).
Q_DTYPE = torch.bfloat16


def as_drawn(q: torch.Tensor) -> torch.Tensor:
    """The q rows a draft draws from and ships: `q` rounded to Q_DTYPE (see above)."""
    return q.to(Q_DTYPE)


@dataclass(frozen=True)
class Bias:
    """A request's logits processing at one position [V] or several [n, V]
    (ssd.engine.processing): logits -> penalise(logits) + add.

    `add`: logit_bias, penalties and -inf masks (a grammar's, allowed ids, bad words,
    min_tokens), one additive term.
    `repeated` (bool, add's shape): the tokens the repetition penalty scales
    (Keskar et al. 2019, "CTRL"; HF's and vLLM's definition): a positive logit
    is divided by `repetition` (the request's penalty), a negative one multiplied, before the
    additive term, as HF orders its processors.
    """

    add: torch.Tensor
    repeated: torch.Tensor | None = None
    repetition: float = 1.0

    def __getitem__(self, index: int | slice) -> "Bias":
        repeated = None if self.repeated is None else self.repeated[index]
        return Bias(self.add[index], repeated, self.repetition)

    @staticmethod
    def stack(rows: Sequence["Bias"]) -> "Bias":
        repeated = None if rows[0].repeated is None else torch.stack([r.repeated for r in rows])
        return Bias(torch.stack([r.add for r in rows]), repeated, rows[0].repetition)

    def forbids(self, token: int) -> bool:
        """The token cannot be drawn here (its additive term is -inf, or it is out of range)."""
        return token >= self.add.shape[-1] or not bool(self.add[token] > float("-inf"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (float64, logits' device)."""
        if self.repeated is not None:
            penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.repeated.to(logits.device), penalised, logits)
        return logits + self.add.to(logits.device, torch.float64)


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def probs_from_logits(
    logits: torch.Tensor, params: SamplingConfig, bias: Bias | None = None
) -> torch.Tensor:
    """Rows of logits [..., V] -> rows of probabilities [..., V] in float64.

    float64 keeps the ratio test and the residual max(0, p - q) free of
    rounding noise that could otherwise leave a tiny spurious residual.
    `bias` [..., V]: a request's logits processing (ssd.engine.processing:
    repetition penalty, logit_bias, penalties, a grammar's -inf mask), applied before everything
    else, so greedy, temperature, min-p, top-k and top-p all see the processed logits.
    Filters in vLLM's order: min-p on the tempered law, then top-k, then top-p
    (min-p and top-k commute; top-p renormalises what they keep).
    """
    logits = _biased(logits, bias)
    if params.greedy:
        return one_hot_argmax(logits)
    # Shift before scaling: (l - max) / T is <= 0, so a tiny T (even a subnormal
    # one) sends every non-maximal logit to -inf instead of overflowing the
    # maximum to +inf (inf - inf = nan). Tiny temperatures thus approach greedy
    # continuously: uniform over exact ties of the maximum, one-hot otherwise.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.min_p > 0:
        logits = _mask_min_p(logits, params.min_p)
    if params.top_k and params.top_k < logits.shape[-1]:
        logits = _mask_top_k(logits, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _mask_top_p(probs, params.top_p)
    return probs


def token_logprobs(
    logits: torch.Tensor, params: SamplingConfig, tokens: Sequence[int], top_n: int,
    bias: Bias | None = None,
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """For each token i: (log p_i[token], its rank, the top_n (id, log p_i) pairs), p_i the
    distribution of logits row i [n, V] under `params`; the rank is 1 + the number of tokens
    more likely than it (vLLM's).

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
    chosen = logp.gather(-1, torch.tensor(list(tokens), device=logp.device).unsqueeze(-1))
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    chosen = chosen.squeeze(-1).tolist()
    if top_n <= 0:
        return [(value, rank, []) for value, rank in zip(chosen, ranks)]
    values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return list(zip(chosen, ranks, tops))


def _biased(logits: torch.Tensor, bias: Bias | None) -> torch.Tensor:
    logits = logits.to(torch.float64)
    return logits if bias is None else bias.apply(logits)


def greedy_token(logits: torch.Tensor, bias: Bias | None = None) -> int:
    """The token `sample(probs_from_logits(logits, greedy, bias), gen)` gives, without the
    one-hot row, its CDF or a draw (a plain step's greedy token costs an argmax, not ~2 ms
    of float64 work over a 152k vocabulary). float32 -> float64 is exact, so without a bias
    the argmax and its ties (lowest id) are the same in either."""
    return int((logits if bias is None else _biased(logits, bias)).argmax(dim=-1))


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy as a distribution; ties go to the lowest id, as torch.argmax does."""
    out = torch.zeros_like(logits, dtype=torch.float64)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _mask_min_p(shifted: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens with p >= min_p * max p (Nguyen et al. 2024, "min-p sampling"). The
    logits are shifted to a maximum of 0, so p / max p = exp(logit): one comparison in
    log space, and the likeliest token always stays (log 1 = 0 <= 0)."""
    return shifted.masked_fill(shifted < math.log(min_p), float("-inf"))


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


def sample_ids(probs: torch.Tensor, gen: Draws) -> torch.Tensor:
    """Token ids on probs' device: one per row of [..., V] (rows need not be normalised).

    One uniform per row from the CPU generator; nothing is read back to the
    host. With a GumbelNoise, each row's Gumbel-max token at its position.
    """
    if isinstance(gen, GumbelNoise):
        return coupled_ids(probs, gen)
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    # r <= 1 - 2**-53 (torch draws float64 uniforms as multiples of 2**-53), so
    # u = r * total stays strictly below total after rounding: some cdf entry exceeds it.
    u = uniforms(gen, (*probs.shape[:-1], 1)).to(cdf.device, non_blocking=True) * cdf[..., -1:]
    # right=True: the first index whose cdf exceeds u, never a zero-mass token.
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def sample(probs: torch.Tensor, gen: Draws) -> int:
    """Draw one token id from a probability row [V] (need not be normalised): one host read."""
    token = int(sample_ids(probs, gen))
    if token >= probs.shape[-1]:
        raise ValueError("cannot sample from a row without probability mass")
    return token


def sample_rows(probs: torch.Tensor, gen: Draws) -> list[int]:
    """One draw per row of [B, V]; the same inverse-CDF rule as `sample`, one host read."""
    tokens = sample_ids(probs, gen).tolist()
    if any(t >= probs.shape[-1] for t in tokens):
        raise ValueError("cannot sample from a row without probability mass")
    return tokens


def uniforms(gen: torch.Generator, shape: int | Sequence[int] = ()) -> torch.Tensor:
    """U[0, 1) draws in float64 from the request's generator, always on the CPU."""
    return torch.rand(shape, generator=gen, dtype=torch.float64)


# --- Coupled sampling ----------------------------------------------------------------
#
# Gumbel-max (Gumbel 1954; Maddison et al. 2014): argmax_v (log p(v) + g_v)
# with g_v i.i.d. standard Gumbel is an exact draw from p. Keying g by
# (seed, position, token) alone makes the token at a position a function of
# the prefix and the seed: whoever computes it (AR, the verifier, a draft
# proposing with its own q) and whenever (a cache hit or a miss, any batch)
# gets the same noise. The noise comes from a counter-based hash in integer
# tensor ops, no generator state, so it is the same on every device; see
# docs/exactness.md for what that buys and what it costs.

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_GOLDEN32 = 0x9E3779B1  # floor(2^32 / phi), odd: t -> t * _GOLDEN32 is a bijection mod 2^32
_TOKEN_SALTS = (0x68E31DA4, 0xB5297A4D)  # one per lane, so the two lanes hash tokens differently


# A draft's coupled proposal may be approximate: verification keeps the output
# AR's whatever the draft proposes, so a draft lets only the DRAFT_CANDIDATES
# most likely tokens of each row compete. It differs from the full
# Gumbel-max only when the winner lies outside them, which happens with the
# row's mass outside them: below 1 % for an LLM at T <= 1 with 64. It saves
# hashing the whole vocabulary for every branch of every cache build.
DRAFT_CANDIDATES = 64


@dataclass(frozen=True)
class GumbelNoise:
    """A request's coupled randomness for the rows it draws: row i's token is
    argmax(log p_i + g(seed, positions[i], .)). Positions are absolute
    indices in the request's sequence (prompt included) of the token drawn.
    `candidates`: only that many most likely tokens per row compete (a
    draft's proposals, see DRAFT_CANDIDATES); None: all do (the target's own
    tokens, which must be exact)."""

    seed: int
    positions: tuple[int, ...]
    candidates: int | None = None

    def rows(self, vocab: int, device: torch.device | str = "cpu", ids: torch.Tensor | None = None) -> torch.Tensor:
        """The noise [len(positions), V] in float64 on `device`; at `ids` [len(positions), m] only, if given."""
        return gumbel_noise(self.seed, self.positions, vocab, device, ids)


# What a draw consumes: the request's generator (standard) or its keyed noise (coupled).
Draws = torch.Generator | GumbelNoise


def draws_at(
    sampling: SamplingConfig, gen: torch.Generator, positions: Sequence[int], candidates: int | None = None,
) -> Draws:
    """The randomness for tokens at `positions` (one per row drawn): the
    request's generator, or under coupling its noise there. The one place a
    drawing site asks which sampler the request runs."""
    if sampling.coupled:
        return GumbelNoise(sampling.seed, tuple(positions), candidates)
    return gen


def coupled_ids(probs: torch.Tensor, noise: GumbelNoise) -> torch.Tensor:
    """Gumbel-max ids on probs' device, one per row of [..., V] (rows need not be
    normalised: the argmax ignores a row's scale). A row without mass gets V,
    out of range, as sample_ids' inverse CDF does."""
    scores = coupled_scores(probs, noise)
    ids = scores.argmax(dim=-1)
    return torch.where(scores.amax(dim=-1) > float("-inf"), ids, probs.shape[-1])


def coupled_scores(probs: torch.Tensor, noise: GumbelNoise) -> torch.Tensor:
    """log p + g per row of [..., V] in float64: masked tokens (p = 0), and
    with `noise.candidates` the tokens outside each row's top ones, score -inf."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab).to(torch.float64)
    if len(noise.positions) != flat.shape[0]:
        raise ValueError(f"noise for {len(noise.positions)} positions, probabilities of shape {tuple(probs.shape)}")
    if noise.candidates is None or noise.candidates >= vocab:
        return noise.rows(vocab, flat.device).add_(flat.log()).view(probs.shape)
    values, ids = torch.topk(flat, noise.candidates, dim=-1)
    top = noise.rows(vocab, flat.device, ids).add_(values.log())
    return torch.full_like(flat, float("-inf")).scatter_(-1, ids, top).view(probs.shape)


def gumbel_noise(
    seed: int, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu",
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise [len(positions), V] (or at `ids`), float64: -log(-log u) of `keyed_uniforms`."""
    return keyed_uniforms(seed, positions, vocab, device, ids).log_().neg_().log_().neg_()


def keyed_uniforms(
    seed: int, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu",
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """U(0, 1) [len(positions), V] in float64, a pure function of (seed, position,
    token); with `ids` [len(positions), m], at those token ids only (the same values).

    Two 32-bit lanes, each the murmur3 finalizer over (row code ^ token
    code); their top 26 bits each make a 52-bit integer n, and u = (n + 0.5)
    / 2^52 is exact in float64, never 0 or 1. Integer ops only up to there,
    with no product above 2^48, so every device computes the same bits.
    In place where it can: a [K + 1, 152k] call passes over 6 MB tensors
    some forty times, and fresh allocations would fault their pages in each time.
    """
    if any(not 0 <= p <= _M32 for p in positions):
        raise ValueError(f"positions must be in 0..2^32-1, got {list(positions)[:8]}")
    keys = _seed_keys(seed)
    pos = torch.tensor(list(positions), dtype=torch.int64, device=device).unsqueeze(1)  # [R, 1]
    tokens = _token_codes(vocab, str(device))
    if ids is not None:
        tokens = tokens[:, ids.to(device=device, dtype=torch.long)]  # [2, R, m]
    hi = _fmix32(_fmix32(pos ^ keys[0]) ^ keys[1]) ^ tokens[0]  # row code ^ token code: [R, V]
    lo = _fmix32(_fmix32(pos ^ keys[2]) ^ keys[3]) ^ tokens[1]
    scratch = torch.empty_like(hi)
    _fmix32(hi, scratch)
    _fmix32(lo, scratch)
    hi >>= 6
    hi *= 1 << 26
    lo >>= 6
    hi += lo
    return hi.to(torch.float64).add_(0.5).mul_(2.0**-52)


def _seed_keys(seed: int) -> tuple[int, int, int, int]:
    """Four 32-bit keys from the seed: two splitmix64 outputs (Steele et al. 2014)."""
    state, keys = seed & _M64, []
    for _ in range(2):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        keys += [z & _M32, z >> 32]
    return tuple(keys)  # type: ignore[return-value]


@functools.lru_cache(maxsize=8)
def _token_codes(vocab: int, device: str) -> torch.Tensor:
    """[2, V] per-lane codes of the token ids (bijective in the id), computed once per vocabulary and device."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    _mul32(ids, _GOLDEN32, torch.empty_like(ids))
    return torch.stack([_fmix32(ids ^ salt) for salt in _TOKEN_SALTS])


def _fmix32(h: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """murmur3's 32-bit finalizer (Appleby), a bijection on 0..2^32-1 with full
    avalanche; in place on `h` given a scratch tensor of its shape."""
    if scratch is None:
        h, scratch = h.clone(), torch.empty_like(h)
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h ^= torch.bitwise_right_shift(h, shift, out=scratch)
        _mul32(h, multiplier, scratch)
    h ^= torch.bitwise_right_shift(h, 16, out=scratch)
    return h


def _mul32(x: torch.Tensor, c: int, scratch: torch.Tensor) -> torch.Tensor:
    """x = (x * c) mod 2^32 in place, for x in 0..2^32-1, without an int64 product
    above 2^48 (signed overflow is undefined in the kernels): c in 16-bit halves."""
    torch.mul(x, c >> 16, out=scratch)
    scratch &= 0xFFFF
    scratch <<= 16
    x *= c & 0xFFFF
    x += scratch
    x &= _M32
    return x
