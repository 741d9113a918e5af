"""A request's logits processing: OpenAI's logit_bias and penalties, vLLM's repetition
penalty and min_tokens, and a grammar's token mask.

All of it is one ssd.sampling.Bias, applied before temperature, min-p, top-k
and top-p by the one sampling pipeline (ssd.sampling.probs_from_logits and
token_logprobs take it as `bias`): the repetition penalty scales the logits,
then the rest adds up:

    repetition       l[j] / r if l[j] > 0 else l[j] * r, for every j in the prompt or
                     generated so far (HF's and vLLM's definition; r = 1: off)
    logit_bias       + b[j] for the listed ids (OpenAI: -100 bans, +100 forces)
    allowed ids      -inf for every token outside vLLM's allowed_token_ids, when given
    bad words        -inf for a bad word's last token where the output ends with the
                     rest of it (vLLM's bad_words, as token id sequences)
    penalties        - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty,
                     c[j] = how often j was generated so far (OpenAI's definition;
                     the prompt does not count, as in vLLM)
    min_tokens       -inf for the EOS and stop token ids until min_tokens tokens are
                     generated (vLLM's)
    grammar          -inf for every token the grammar forbids next (llguidance)

The bias depends on the tokens generated before a position, so it is part of
the target's law at that position: verification compares the draft's tokens
with the *processed* target law, row i biased for the prefix that includes
drafted[:i] (`rows`). That keeps every mode exact with respect to the
processed law: greedy output equals AR's under the same processing, and
sampled output follows the processed distribution. The draft (SD, same
process) drafts under the same processing (`push` as it goes), which only
raises acceptance: a draft token the target's law forbids is rejected with
probability 1 anyway.

The grammar's state follows the committed tokens (`commit`); tentative
tokens (`push`, a draft chain or a verification pass) are rolled back
(`reset`). When the grammar is complete and can only end, the row ends with
finish reason "stop" (`admit`): the forced EOS carries probability 1 under the
masked law, so ending there is the same law without a token the model may not
even have (the tiny test vocabularies have no EOS).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Sequence

import torch

import ssd.engine.grammar as grammars  # not `from ssd.engine`: the package imports this module
from ssd.engine.request import Processing
from ssd.sampling import Bias

log = logging.getLogger(__name__)


class LogitsProcessor:
    """One request's processing state: committed counts and grammar state, plus tentative tokens."""

    def __init__(
        self, spec: Processing, tokenizer: Any = None, eos_ids: Sequence[int] = (),
        prompt_ids: Sequence[int] = (), min_tokens: int = 0, held_ids: Sequence[int] = (),
    ) -> None:
        self.spec = spec
        self.held_ids = list(held_ids)  # banned before min_tokens: EOS (unless ignored), stop token ids
        self.min_tokens = min_tokens
        self.prompt_ids = set(prompt_ids) if spec.repetition_penalty != 1 else set()
        self.counts: Counter[int] = Counter()
        self.tail: list[int] = []  # the last committed tokens, as many as the longest bad word needs
        self.tail_len = max(map(len, spec.bad_words), default=1) - 1
        self.pending: list[int] = []
        self.consumed = 0  # of the pending tokens, those the grammar took (none once it is complete)
        self.frozen = False  # a pending token went past the grammar's end
        self.matcher = grammars.matcher(spec.grammar, tokenizer, eos_ids) if spec.grammar else None
        self._bias_cache: dict[int, torch.Tensor] = {}

    # --- the bias -----------------------------------------------------------------

    def bias(self, vocab: int) -> Bias:
        """The processing (float64, CPU) of the next token after committed + pending tokens."""
        out = torch.zeros(vocab, dtype=torch.float64)
        static = self._static(vocab)
        if static is not None:
            out += static
        penalties = self._penalties(vocab)
        if penalties is not None:
            out -= penalties
        if self.min_tokens and self.counts.total() + len(self.pending) < self.min_tokens:
            out[[t for t in self.held_ids if t < vocab]] = float("-inf")
        banned = self._bad_words_banned()
        if banned:
            out[[t for t in banned if t < vocab]] = float("-inf")
        mask = self._mask(vocab)
        if mask is not None:
            out += mask
        return Bias(out, self._repeated(vocab), self.spec.repetition_penalty)

    def _mask(self, vocab: int) -> torch.Tensor | None:
        """The grammar's mask; None once it is complete (the row ends there: `admit`)."""
        if self.matcher is None or self.frozen or self.matcher.is_stopped():
            return None
        mask = grammars.mask(self.matcher, vocab)
        if self.matcher.is_error() and grammars.reason(self.matcher) != grammars.NO_EXTENSION:
            raise self._failed("cannot compute the next tokens")  # a limit of llguidance's, met here
        if bool((mask == 0).any()):
            return mask
        if self.matcher.is_accepting():  # only its EOS could follow, and the model has none
            return None
        raise grammars.GrammarFailed(f"grammar: no token of the model's vocabulary can continue the output "
                                     f"(near output token {self.counts.total()})")

    def rows(self, drafted: Sequence[int], vocab: int) -> Bias:
        """Bias rows [len(drafted) + 1, vocab]: row i for the prefix that includes drafted[:i].

        A drafted token the bias forbids (-inf) ends the walk: verification
        rejects it for sure, so the rows after it are never read (they repeat
        the last one). Tentative state is rolled back before returning.
        """
        self.reset()
        out = [self.bias(vocab)]
        for token in drafted:
            if not self.allows(out[-1], token):
                break
            self.push(token)
            out.append(self.bias(vocab))
        self.reset()
        out += [out[-1]] * (len(drafted) + 1 - len(out))
        return Bias.stack(out)

    @staticmethod
    def allows(bias: Bias, token: int) -> bool:
        return not bias.forbids(token)

    # --- the state ----------------------------------------------------------------

    def push(self, token: int) -> None:
        """Take `token` tentatively (a draft's, or in a verification walk). A token the grammar
        cannot take (only past its end: the draws come from masked laws) freezes it until
        `reset`: the row ends at that position, so what follows is never emitted."""
        if self.matcher is not None and not self.frozen:
            if self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token):
                self.consumed += 1
            else:
                self.frozen = True
        self.pending.append(token)

    def reset(self) -> None:
        """Drop the tentative tokens (a rejected speculation's): back to the committed state."""
        if self.matcher is not None and self.consumed and not self.matcher.rollback(self.consumed):
            raise self._failed("rollback failed")
        self.pending.clear()
        self.consumed = 0
        self.frozen = False

    def admit(self, tokens: Sequence[int], vocab: int) -> tuple[list[int], bool]:
        """(the prefix of `tokens` up to where the grammar ends, whether it ended there).

        Tokens past a completed grammar were drawn from a position the row never reaches.
        """
        if self.matcher is None:
            return list(tokens), False
        self.reset()
        kept: list[int] = []
        ended = self._complete(vocab)
        for token in tokens:
            if ended:
                break
            if not self.matcher.consume_token(token):
                raise self._failed(f"refused emitted token {token}")
            kept.append(token)
            ended = self._complete(vocab)
        if kept and not self.matcher.rollback(len(kept)):
            raise self._failed("rollback failed")
        return kept, ended

    def _complete(self, vocab: int) -> bool:
        """The grammar can only end here: stopped, or accepting with no token of the vocabulary
        allowed (a model without EOS: the tiny test models)."""
        if self.matcher.is_stopped():
            return True
        return self.matcher.is_accepting() and not bool((grammars.mask(self.matcher, vocab) == 0).any())

    def commit(self, tokens: Sequence[int]) -> None:
        """The row emitted `tokens`: they count for the penalties and advance the grammar."""
        self.reset()
        self.counts.update(tokens)
        if self.tail_len:
            self.tail = (self.tail + list(tokens))[-self.tail_len:]
        if self.matcher is not None:
            for token in tokens:
                if self.matcher.is_stopped():
                    break
                if not self.matcher.consume_token(token):
                    raise self._failed(f"refused emitted token {token}")

    # --- helpers --------------------------------------------------------------------

    def _failed(self, what: str) -> grammars.GrammarFailed:
        """The grammar cannot go on: llguidance's own reason with it."""
        return grammars.GrammarFailed(f"grammar {what} near output token {self.counts.total()}: "
                                      f"{grammars.reason(self.matcher)}")

    def _static(self, vocab: int) -> torch.Tensor | None:
        """logit_bias and the allowed ids' mask: the same at every position."""
        if not (self.spec.logit_bias or self.spec.allowed_token_ids):
            return None
        cached = self._bias_cache.get(vocab)
        if cached is None:
            cached = torch.zeros(vocab, dtype=torch.float64)
            for token, value in self.spec.logit_bias:
                if token < vocab:
                    cached[token] = value
            if self.spec.allowed_token_ids:
                allowed = torch.zeros(vocab, dtype=torch.bool)
                allowed[[t for t in self.spec.allowed_token_ids if t < vocab]] = True
                cached[~allowed] = float("-inf")
            self._bias_cache[vocab] = cached
        return cached

    def _bad_words_banned(self) -> list[int]:
        """The bad words' last tokens the output so far (committed + pending) sets up."""
        if not self.spec.bad_words:
            return []
        output = self.tail + self.pending
        return [word[-1] for word in self.spec.bad_words if _ends_with(output, word[:-1])]

    def _repeated(self, vocab: int) -> torch.Tensor | None:
        """The tokens the repetition penalty scales: in the prompt or generated (pending too)."""
        if self.spec.repetition_penalty == 1:
            return None
        seen = [t for t in self.prompt_ids.union(self.counts, self.pending) if t < vocab]
        out = torch.zeros(vocab, dtype=torch.bool)
        out[seen] = True
        return out

    def _penalties(self, vocab: int) -> torch.Tensor | None:
        spec = self.spec
        if not (spec.presence_penalty or spec.frequency_penalty):
            return None
        counts = self.counts + Counter(self.pending)
        if not counts:
            return None
        ids = torch.tensor([t for t in counts if t < vocab], dtype=torch.long)
        c = torch.tensor([counts[t] for t in counts if t < vocab], dtype=torch.float64)
        out = torch.zeros(vocab, dtype=torch.float64)
        out[ids] = c * spec.frequency_penalty + (c > 0).to(torch.float64) * spec.presence_penalty
        return out


def _ends_with(tokens: list[int], suffix: Sequence[int]) -> bool:
    return not suffix or (len(tokens) >= len(suffix) and tokens[len(tokens) - len(suffix):] == list(suffix))
