"""Text deltas for streamed rounds, consistent with the final text.

Byte-level BPE pieces only become text in context, so each round decodes the
whole output and emits the new suffix. Two things are held back until they
are safe: a trailing U+FFFD (the rest of a multi-byte character may come next
round) and, with stop strings, the last len(longest stop) - 1 characters
(the start of a stop string that the final text will cut); the round that
completes a stop string shows only the text before it, as the engine's
final text does (ssd.engine.output's rule: with min_tokens, only a stop
string that ends past those tokens' text counts). The deltas joined always
equal the final text.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from ssd.config import GenerationConfig
from ssd.engine.output import cut_at_stop, first_stop, held_chars

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], generation: GenerationConfig | None = None) -> None:
        """`generation`: the request's stop strings, min_tokens and include_stop_str_in_output."""
        generation = generation or GenerationConfig()
        self.decode = decode
        self.stop = list(generation.stop)
        self.min_tokens = generation.min_tokens
        self.include_stop = generation.include_stop_str_in_output
        self.held: int | None = None  # the first min_tokens tokens' text length, once they are out
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: Sequence[int]) -> str:
        """Add a round's tokens; return the text now safe to show."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if self.stop and self.held is None and len(self.ids) >= self.min_tokens:
            self.held = held_chars(self.decode, self.ids, self.min_tokens)
        hit = None
        if self.held is not None and len(self.ids) > self.min_tokens:
            hit = first_stop(text, self.stop, self.held)
        if hit is not None:  # this round ended generation: the text ends at the stop string
            return self._advance(cut_at_stop(text, hit, self.include_stop))
        safe = len(text.rstrip(REPLACEMENT)) - self.holdback
        return self._advance(text[: max(safe, 0)])

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, cut at a stop string)."""
        if not final_text.startswith(self.sent):
            # Cannot happen with the holdback above; never send text twice.
            log.warning("final text does not extend the streamed text; dropping the tail")
            return ""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta
