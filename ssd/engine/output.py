"""Where generation ends: EOS, max_new_tokens and stop strings, exactly.

A speculative round can append several tokens at once; they are admitted one
at a time so that nothing past the end condition is ever emitted. Before
`min_tokens` tokens (vLLM's), EOS cannot be drawn (ssd.engine.processing
bans it) and a stop string ends nothing; after, only a stop string that ends
past those tokens' text does, as in vLLM, which looks for stop strings in
each step's new text.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ssd.config import GenerationConfig
from ssd.models.tokenizer import Tokenizer


def first_stop(text: str, stop: Sequence[str], held_chars: int = 0) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in `text` (the longest of those starting
    there), of those that end past the first `held_chars` characters (the first min_tokens
    tokens' text); None: none does."""
    hits = []
    for s in stop:
        start = text.find(s, max(0, held_chars - len(s) + 1))
        if start >= 0:
            hits.append((start, start + len(s)))
    return min(hits, key=lambda hit: (hit[0], -hit[1])) if hits else None


def cut_at_stop(text: str, hit: tuple[int, int], include_stop: bool) -> str:
    """The text a stop string ends: up to it, or through it (vLLM's include_stop_str_in_output)."""
    return text[: hit[1] if include_stop else hit[0]]


def held_chars(decode: Callable[[Sequence[int]], str], ids: Sequence[int], min_tokens: int) -> int:
    """How many characters of text the first min_tokens of `ids` make: no stop string ends within them."""
    return len(decode(list(ids[:min_tokens]))) if min_tokens else 0


class OutputTracker:
    """Collects generated token ids and decides when and why generation ends."""

    def __init__(
        self, tokenizer: Tokenizer, config: GenerationConfig, eos_ids: set[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.eos_ids = set() if config.ignore_eos else set(eos_ids)
        self.stop_ids = set(config.stop_token_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None  # "eos" | "length" | "stop"
        self.stop_text: str | None = None  # the text up to (or through) the stop string
        self._held_chars = 0  # the first min_tokens tokens' text: a stop string must end past it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.token_ids)

    def add(self, tokens: Sequence[int]) -> list[int]:
        """Admit tokens in order until an end condition; return those admitted."""
        admitted = []
        for token in tokens:
            if self.finished:
                break
            self.token_ids.append(token)
            admitted.append(token)
            self.finish_reason = self._end_reason(token)
        return admitted

    def end(self, reason: str) -> None:
        """End here unless something else already did (a completed grammar: ssd.engine.processing)."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def text(self) -> str:
        """The generated text, cut before the stop string when one ended it."""
        if self.stop_text is not None:
            return self.stop_text
        return self._decode(self.token_ids)

    def _end_reason(self, token: int) -> str | None:
        if token in self.eos_ids:
            return "eos"
        if token in self.stop_ids:
            return "stop"
        if self.config.stop and len(self.token_ids) == self.config.min_tokens:
            self._held_chars = held_chars(self._decode, self.token_ids, self.config.min_tokens)
        if self.config.stop and len(self.token_ids) > self.config.min_tokens and self._hit_stop_string():
            return "stop"
        if self.remaining <= 0:
            return "length"
        return None

    def _hit_stop_string(self) -> bool:
        # The whole text is decoded again: byte-level BPE pieces only become
        # text in context, and the sequences here are short.
        text = self._decode(self.token_ids)
        hit = first_stop(text, self.config.stop, self._held_chars)
        if hit is None:
            return False
        self.stop_text = cut_at_stop(text, hit, self.config.include_stop_str_in_output)
        return True

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.config.skip_special_tokens)
