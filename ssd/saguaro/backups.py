"""Backup speculators for cache misses. Each is exact: every proposed token
comes with the distribution q it was drawn from (a deterministic proposal is
a one-hot q), so verification stays lossless whichever backup runs. Under
coupled sampling no q is shipped (verification compares with the target's own
tokens) and the sampled backups draw with the request's keyed noise: the
neural one exactly as SD's draft, the random one the Gumbel-max of the
uniform law."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.kv import KVSequence
from ssd.saguaro.cache import DraftWork, Proposal
from ssd.engine.drafting import drafted_chain
from ssd.engine.lookup import NGRAM_WINDOW, TokenText, ngram_match, one_hot_rows
from ssd.saguaro.sampling import Saguaro
from ssd.sampling import Q_DTYPE, draws_at, sample_rows


class Backup(Protocol):
    kind: str

    def propose(
        self, kv: KVSequence, context: Sequence[int], k: int, sampling: SamplingConfig,
        gen: torch.Generator, saguaro: Saguaro | None,
    ) -> Proposal: ...


class NeuralBackup:
    """The draft drafts K tokens now, exactly as plain SD would; the chain's
    cache and logits are the next cache build's start (DraftWork)."""

    kind = "neural"

    def propose(self, kv, context, k, sampling, gen, saguaro):
        chain = drafted_chain(kv, context, k, sampling, gen, saguaro)
        q = torch.stack(chain.q_rows) if sampling.needs_q else None
        return Proposal(chain.tokens, q, self.kind, DraftWork(chain.logit_rows))


class NgramBackup:
    """Continue the most recent earlier match of the context's last n tokens
    (n = max_n down to 1); no model cost. With no match, repeat the last token."""

    kind = "ngram"

    def __init__(self, vocab_size: int, max_n: int = 3) -> None:
        self.vocab_size = vocab_size
        self.max_n = max_n

    def propose(self, kv, context, k, sampling, gen, saguaro):
        tokens = ngram_continuation(context, k, self.max_n)
        q = one_hot_rows(tokens, self.vocab_size) if sampling.needs_q else None
        return Proposal(tokens, q, self.kind)


class LookupBackup:
    """A free candidate first: the n-gram continuation when the context's last
    `min_n`+ tokens occurred before (no model cost, no stall); otherwise the
    neural chain. Either way the proposal carries the q it was drawn from."""

    kind = "lookup"

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 2) -> None:
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, kv, context, k, sampling, gen, saguaro):
        follow = ngram_match(context, k, self.max_n, self.min_n)
        if len(follow) < k:
            return NeuralBackup().propose(kv, context, k, sampling, gen, saguaro)
        q = one_hot_rows(follow, self.vocab_size) if sampling.needs_q else None
        return Proposal(follow, q, "ngram")


def ngram_candidates(
    context: Sequence[int], drafted: Sequence[int], depth: int, vocab_size: int, needs_q: bool,
    taken: Callable[[int, int], bool], max_n: int = 3, min_n: int = 2, window: int = NGRAM_WINDOW,
) -> dict[tuple[int, int], Proposal]:
    """Free cache entries: for each acceptance length k, the outcome t* that
    the text so far predicts (what followed the latest earlier occurrence of
    context + drafted[:k]) with the `depth` tokens that followed it, where the
    draft built nothing for (k, t*) (`taken`). No model cost; q one-hot where
    verification reads q (`needs_q`: not greedy, not coupled)."""
    text = TokenText([*context[-window:], *drafted])
    entries: dict[tuple[int, int], Proposal] = {}
    for k in range(len(drafted) + 1):
        follow = text.match(len(text) - len(drafted) + k, depth + 1, max_n, min_n, window)
        if len(follow) < 2:
            continue
        t_star, tokens = follow[0], follow[1:]
        if (k < len(drafted) and t_star == drafted[k]) or taken(k, t_star):
            continue  # a rejection never yields the drafted token; the draft's own entry is better
        q = one_hot_rows(tokens, vocab_size) if needs_q else None
        entries[(k, t_star)] = Proposal(tokens, q, "ngram")
    return entries


class RandomBackup:
    """Uniformly random tokens: q is uniform, and verification must use it."""

    kind = "random"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, kv, context, k, sampling, gen, saguaro):
        uniform = torch.full((k, self.vocab_size), 1.0 / self.vocab_size, dtype=Q_DTYPE)
        if sampling.coupled:  # the same noise as the target's: uniform draws, coupled
            tokens = sample_rows(uniform, draws_at(sampling, gen, range(len(context), len(context) + k)))
        else:
            tokens = torch.randint(self.vocab_size, (k,), generator=gen).tolist()
        return Proposal(tokens, uniform if sampling.needs_q else None, self.kind)


def ngram_continuation(context: Sequence[int], k: int, max_n: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the context's suffix
    (padded with its last token); with no occurrence, the last token k times."""
    follow = ngram_match(context, k, max_n)
    if not follow:
        return [context[-1]] * k
    return follow + [follow[-1]] * (k - len(follow))


def make_backup(kind: str, vocab_size: int) -> Backup:
    if kind == "neural":
        return NeuralBackup()
    if kind == "ngram":
        return NgramBackup(vocab_size)
    if kind == "lookup":
        return LookupBackup(vocab_size)
    if kind == "random":
        return RandomBackup(vocab_size)
    raise ValueError(f"unknown backup {kind!r}")
