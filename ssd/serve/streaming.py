"""Text deltas for streamed rounds, consistent with the final text.

Byte-level BPE pieces only become text in context, so each round decodes the
whole output and emits the new suffix. Two things are held back until they
are safe: a trailing U+FFFD (the rest of a multi-byte character may come next
round) and, with stop strings, the last len(longest stop) - 1 characters
(the start of a stop string that the final text will cut); the round that
completes a stop string shows only the text before it, as the engine's
final text does. The deltas joined always equal the final text.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = list(stop)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def push(self, ids: Sequence[int]) -> str:
        """Add a round's tokens; return the text now safe to show."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:  # this round ended generation: the text ends before the stop string
            return self._advance(text[: min(hits)])
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
