"""Prefix caching across requests: a finished row's caches serve the next prompt that starts as its did.

A chat's next turn, an agent's next call, a second question about one file:
each sends again a prompt that begins with what the last request held. vLLM
(automatic prefix caching), SGLang (RadixAttention) and llama.cpp's server
(`cache_prompt`) keep those keys and values; here a finished row's target and
draft sequences wait in a PrefixCache, and a new row whose prompt starts the
same way takes them instead of prefilling that prefix again.

What may be reused, so that the output stays what it would be without the
cache, bit for bit: the engine prefills a prompt in chunks from fixed
positions (multiples of `batching.prefill_chunk`, ssd.engine.batch), and a
backend's keys and values depend on how a position was computed (llama.cpp
runs a prompt chunk as whole ubatches, a decode step in other kernels:
ssd.models.llamacpp). So an entry offers only the whole prompt chunks its row
prefilled, `whole` positions, and a new prompt takes the longest run of them
it shares, chunk by chunk, leaving at least its last token to feed (the first
token is sampled from that forward). Its later chunks then start where a
fresh prefill would start them, and every position holds what a fresh
prefill computes. The positions a row decoded are never served as they are:
decode steps ran other kernels.

But a chat's next prompt repeats the reply, so while the engine is idle (the
user reads it), `BatchedEngine.warm` prefills an entry's `pending` tokens (the
rest of the row's prompt and its output) as prompt chunks from the same
fixed positions, one whole chunk a call: exactly what the next turn's
prefill would compute for them, done before it arrives.

The cache is pure bookkeeping over opaque sequences: which entry serves a
prompt, and which goes first when memory or a llama.cpp slot is needed
(least recently used). The engine owns the sequences' release.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class CachedPrefix:
    """A finished row's caches, cut back to the whole prompt chunks it prefilled."""

    tokens: tuple[int, ...]  # the ids whose keys and values the sequences hold: `whole` of them
    target: Any  # its target sequence (a KVSequence or LlamaCppSequence)
    draft: Any = None  # its draft sequence (SD in process), holding the same ids, or None
    nbytes: int = 0  # what it holds of the engine's KV memory
    pending: tuple[int, ...] = ()  # the row's ids after `tokens` (its prompt's rest, its output): `warm`'s

    @property
    def whole(self) -> int:
        return len(self.tokens)

    def grow(self, chunk: int, token_bytes: int) -> None:
        """The first `chunk` pending ids were fed as a prompt chunk: they are held now."""
        self.tokens, self.pending = self.tokens + self.pending[:chunk], self.pending[chunk:]
        self.nbytes += chunk * token_bytes


def whole_chunks(prefilled: int, chunk: int) -> int:
    """Positions of the whole prompt chunks a row prefilled (chunks start at multiples of `chunk`)."""
    return prefilled // chunk * chunk


def common_chunks(tokens: Sequence[int], prompt: Sequence[int], chunk: int, limit: int | None = None) -> int:
    """How many leading positions `tokens` and `prompt` share, counted in whole chunks, at most `limit`."""
    limit = min(len(tokens), len(prompt), len(prompt) if limit is None else limit)
    shared = 0
    while shared + chunk <= limit and list(prompt[shared : shared + chunk]) == list(tokens[shared : shared + chunk]):
        shared += chunk
    return shared


def shared_chunks(tokens: Sequence[int], prompt: Sequence[int], chunk: int) -> int:
    """The positions a cache holding `tokens` serves a new `prompt`: their common whole chunks,
    leaving the prompt's last token to feed (its forward gives the first token's logits)."""
    return common_chunks(tokens, prompt, chunk, limit=len(prompt) - 1)


class PrefixCache:
    """Finished rows' caches by recency; `take` hands the best match to a new row and forgets it."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # oldest first
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def put(self, entry: CachedPrefix) -> None:
        """Keep `entry` as the most recent (one with no whole chunk is the caller's to release)."""
        if entry.whole < self.chunk:
            raise ValueError(f"an entry holds whole chunks of {self.chunk} tokens, got {entry.whole}")
        self._entries[self._next_key] = entry
        self._next_key += 1

    def take(self, prompt: Sequence[int]) -> tuple[CachedPrefix, int] | None:
        """The entry sharing the most whole chunks with `prompt` (the newest among equals) and
        how many positions it serves; None where none shares a chunk. The entry leaves the cache:
        its sequences become the new row's."""
        best, best_key, best_len = None, None, 0
        for key, entry in reversed(self._entries.items()):  # newest first: ties go to it
            shared = shared_chunks(entry.tokens, prompt, self.chunk)
            if shared > best_len:
                best, best_key, best_len = entry, key, shared
        if best is None:
            return None
        del self._entries[best_key]
        return best, best_len

    def warmable(self) -> CachedPrefix | None:
        """The newest entry with a whole chunk pending (the chat most likely to come back first)."""
        return next((e for e in reversed(self._entries.values()) if len(e.pending) >= self.chunk), None)

    def pop_oldest(self) -> CachedPrefix | None:
        """The least recently cached entry, gone from the cache (None when empty)."""
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[1]
