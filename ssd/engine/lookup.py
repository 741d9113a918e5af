"""Prompt lookup: the text so far as a free draft, where a round would otherwise draft nothing.

A row whose round is a plain target step (K 0 by speculation.k_policy, as the
start-up plan sets where the draft's core is worth more to the target; an SSD
round without the draft) may still have a text that predicts what comes next:
the tokens that followed the latest earlier occurrence of its last n tokens
(prompt lookup decoding, Saxena 2023; vLLM's n-gram speculator; transformers'
`prompt_lookup_num_tokens`). Code edits, renames and quoted input repeat
long spans. The target verifies them in the same forward as a one-hot
speculation, so the output law is unchanged.

Each extra scored token costs forward time, so how many to verify is chosen
per round as Leviathan et al. (arXiv:2211.17192, section 3.3) price a draft
with no cost of its own: with per-token acceptance a and each extra token
costing c of the step, L tokens give (1 + a + ... + a^L) / (1 + c L) tokens
per step's time (a batch of R rows: R - 1 more on top); the round verifies
the L that maximizes it, 0 (a plain step) included. The engine learns a for
each match length n from its rows' lookups (`LookupOdds`): a longer match
predicts better (greedy Qwen2.5-Coder-1.5B on code edits: 5.1-6.7 of 8
looked-up tokens right after a 4-token match, 1.2-3.6 after a 2-token one),
and c from its forwards' times (`StepCost`).

Pure: no model, no I/O.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from ssd.sampling import Q_DTYPE

NGRAM_WINDOW = 4096  # tokens of context an n-gram match looks back over


def prompt_lookup(
    context: Sequence[int], k: int, max_n: int, min_n: int = 1, window: int = NGRAM_WINDOW,
) -> tuple[int, list[int]]:
    """(n, up to k tokens): the longest suffix of n tokens (max_n down to min_n) that occurred
    before within the context's last `window` tokens, and what followed its latest
    occurrence; (0, []) when none occurs. Prompt lookup (Saxena 2023) / suffix matching."""
    text = TokenText(context[-window:])
    return text.find(len(text), k, max_n, min_n, window)


def ngram_match(
    context: Sequence[int], k: int, max_n: int, min_n: int = 1, window: int = NGRAM_WINDOW,
) -> list[int]:
    """The tokens of `prompt_lookup`, without the match length."""
    return prompt_lookup(context, k, max_n, min_n, window)[1]


class TokenText:
    """Token ids as 4-byte words, searched by bytes.rfind (C's memory search):
    a suffix match over a 4096-token context costs microseconds, not the
    milliseconds of comparing Python slices at every start."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.data = array("I", self.tokens).tobytes()

    def __len__(self) -> int:
        return len(self.tokens)

    def match(self, length: int, k: int, max_n: int, min_n: int, window: int) -> list[int]:
        """`ngram_match` of the first `length` tokens."""
        return self.find(length, k, max_n, min_n, window)[1]

    def find(self, length: int, k: int, max_n: int, min_n: int, window: int) -> tuple[int, list[int]]:
        """(n, `match`): how many of the last tokens matched, and what followed; (0, []) for none."""
        lo = max(0, length - window)
        for n in range(min(max_n, length - lo - 1), min_n - 1, -1):
            start = self._latest(lo, length, n)
            if start is not None:
                return n, self.tokens[start + n : min(start + n + k, length)]
        return 0, []

    def _latest(self, lo: int, length: int, n: int) -> int | None:
        """The latest start s in [lo, length - n - 1] whose n tokens equal the last n of
        tokens[:length] (never the suffix itself: a token must follow the match)."""
        needle = self.data[4 * (length - n) : 4 * length]
        end = 4 * (length - 1)  # the match ends before the last token
        while True:
            at = self.data.rfind(needle, 4 * lo, end)
            if at < 0:
                return None
            if at % 4 == 0:
                return at // 4
            end = at + len(needle) - 1  # straddles two words: look before it


def one_hot_rows(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The q of a deterministic proposal: one row per token, all its mass on that token."""
    rows = torch.zeros(len(tokens), vocab_size, dtype=Q_DTYPE)
    return rows.scatter_(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1), 1.0)


def best_length(acceptance: float, token_cost: float, longest: int, rows: int = 1) -> int:
    """The L in 0..longest that maximizes (rows + a + ... + a^L) / (1 + c L): expected
    tokens per unit of step time when each of L verified tokens is accepted with
    probability a after the one before and each costs c of the step, whose `rows`
    rows give one token each (one row's lookup slows the others' step too)."""
    best, best_rate, expected, power = 0, float(rows), float(rows), 1.0
    for length in range(1, longest + 1):
        power *= acceptance
        expected += power
        rate = expected / (1.0 + token_cost * length)
        if rate > best_rate:
            best, best_rate = length, rate
    return best


class LookupOdds:
    """The per-token acceptance of lookups after matches of one length: accepted tokens
    over accepted plus rejections, with recent rounds weighing most.

    Each round forgets a share of the counts; a step whose matches of this length
    proposed nothing forgets toward the prior, so lookups that stopped paying (the
    text stopped repeating) are tried again after a while: the text may repeat.
    """

    def __init__(self, accepted: float, rejected: float = 1.0, memory: float = 0.9) -> None:
        self.prior = (accepted, rejected)
        self.accepted, self.rejected = accepted, rejected
        self.memory = memory

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @classmethod
    def after_match(cls, n: int) -> "LookupOdds":
        """Before any lookup: (n - 1) / n after an n-token match (a longer match predicts better)."""
        return cls(accepted=n - 1.0, rejected=1.0)

    def record(self, proposed: int, accepted: int) -> None:
        """One round: `proposed` tokens looked up, the first `accepted` of them kept."""
        m = self.memory
        if proposed:
            self.accepted = m * self.accepted + accepted
            self.rejected = m * self.rejected + (accepted < proposed)
        else:
            prior_accepted, prior_rejected = self.prior
            self.accepted = m * self.accepted + (1 - m) * prior_accepted
            self.rejected = m * self.rejected + (1 - m) * prior_rejected


class StepCost:
    """A packed forward's seconds as a + b * scored tokens, fitted by least squares over
    recent forwards (each forward's weight decays by `memory` per forward), the slope
    shrunk toward the prior's (each extra token costing `prior` of a one-token step)
    as if `prior_weight` forwards had scored one token more or less than the mean.

    The shrinkage weighs the data by how far its token counts spread: with every
    recent forward of one count (lookups stopped) the slope returns to the prior's,
    so an old or warm-up outlier cannot keep lookups off for good.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, memory: float = 0.95) -> None:
        self.prior, self.prior_weight, self.memory = prior, prior_weight, memory
        self._sums = [0.0] * 5  # weight, w n, w n^2, w t, w n t

    def observe(self, tokens: int, seconds: float) -> None:
        self._sums = [s * self.memory for s in self._sums]
        for i, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self._sums[i] += value

    def token_cost(self, base_tokens: int) -> float:
        """What one more scored token costs, as a share of a forward of `base_tokens`."""
        w, wn, wnn, wt, wnt = self._sums
        if w == 0:
            return self.prior / (1 + self.prior * (base_tokens - 1))
        mean_n, mean_t = wn / w, wt / w
        spread = max(wnn - wn * mean_n, 0.0)  # sum of w (n - mean_n)^2
        data_slope = (wnt - wn * mean_t) / spread if spread > 0 else 0.0
        p = self.prior  # b / (a + b) = p through (mean_n, mean_t)
        prior_slope = mean_t * p / (1 - p + p * mean_n)
        slope = max((spread * data_slope + self.prior_weight * prior_slope) / (spread + self.prior_weight), 0.0)
        base = mean_t + slope * (base_tokens - mean_n)
        return slope / base if base > 0 else self.prior
