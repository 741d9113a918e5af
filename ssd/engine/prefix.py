"""Prompt chunks, and prefix caching across requests: a finished row's caches serve the next
prompt that starts as its did.

A chat's next turn, an agent's next call, a second question about one file:
each sends again a prompt that begins with what the last request held. vLLM
(automatic prefix caching), SGLang (RadixAttention) and llama.cpp's server
(`cache_prompt`) keep those keys and values; here a finished row's target and
draft sequences wait in a PrefixCache, and a new row whose prompt starts the
same way takes them instead of prefilling that prefix again.

What may be reused, so that the output stays what it would be without the
cache, bit for bit: a backend's keys and values depend on how a position was
computed (llama.cpp runs a prompt chunk as whole ubatches, a decode step in
other kernels: ssd.models.llamacpp). So the engine prefills every prompt in
the same chunks, whatever else a step runs (ssd.engine.scheduler), and an entry
offers only the whole chunks its row prefilled. Where a chunk ends is read
from the prompt's own tokens, left to right (`chunk_end`): after
`prefill_chunk` tokens, or earlier after an end-of-turn token (the model's
EOS ids: a chat template ends every message with one) once the chunk holds a
quarter of that. Two prompts that share a prefix then share its chunks, and
a new prompt takes the longest run of chunks it shares with an entry,
leaving at least its last token to feed (the first token is sampled from that
forward): every position holds what a fresh prefill computes. The positions a
row decoded are never served as they are: decode steps ran other kernels.

But a chat's next prompt repeats the reply, so while the engine is idle (the
user reads it), `KVManager.warm` (ssd.engine.kv_manager) prefills an entry's `pending` ids (the
rest of the row's prompt and its output) as the same prompt chunks, one a
call: exactly what the next turn's prefill computes for them, done before it
arrives. A reply that ended with its end-of-turn token ends a chunk there, so
the next turn feeds little more than its new message; a reply cut short
(max_tokens) is prefilled as if the end-of-turn token that closed the
prompt's earlier messages followed it, as a chat template closes it in the
next prompt (a guess: a prompt that goes on otherwise shares nothing past it).

A prompt that continues an entry (its chat's next turn) takes the entry's
sequences; one that shares only part of it (another chat under the same
system prompt) gets a copy of that part, and the entry stays for its own
chat. The cache is pure bookkeeping over opaque sequences: which entry serves
a prompt, and which goes first when memory or a llama.cpp slot is needed
(least recently used). The KV manager (ssd.engine.kv_manager) owns the sequences' copies and release.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def chunk_end(tokens: Sequence[int], start: int, chunk: int, stops: Collection[int] = ()) -> int | None:
    """Where the prompt chunk from `start` (a chunk's end) ends: after `chunk` tokens, or after a
    token in `stops` once the chunk holds chunk // 4 of them; None where `tokens` end first."""
    least = max(1, chunk // 4)
    for i in range(start + least - 1, min(len(tokens), start + chunk)):
        if tokens[i] in stops:
            return i + 1
    return start + chunk if start + chunk <= len(tokens) else None


def chunk_ends(tokens: Sequence[int], chunk: int, stops: Collection[int] = (), start: int = 0) -> Iterator[int]:
    """The ends of the whole chunks of `tokens` after `start` (a chunk's end), in order."""
    while (end := chunk_end(tokens, start, chunk, stops)) is not None:
        yield end
        start = end


def whole_chunks(tokens: Sequence[int], held: int, chunk: int, stops: Collection[int] = ()) -> int:
    """Positions of the whole chunks among the first `held` of `tokens`."""
    whole = 0
    for end in chunk_ends(tokens[:held], chunk, stops):
        whole = end
    return whole


def common_chunks(tokens: Sequence[int], prompt: Sequence[int], chunk: int, stops: Collection[int] = (),
                  limit: int | None = None) -> int:
    """How many leading positions `tokens` and `prompt` share, in whole chunks, at most `limit`."""
    limit = min(len(tokens), len(prompt), len(prompt) if limit is None else limit)
    shared = 0
    for end in chunk_ends(prompt[:limit], chunk, stops):
        if list(prompt[shared:end]) != list(tokens[shared:end]):
            break
        shared = end
    return shared


def shared_chunks(tokens: Sequence[int], prompt: Sequence[int], chunk: int, stops: Collection[int] = ()) -> int:
    """The positions a cache holding `tokens` serves a new `prompt`: their common whole chunks,
    leaving the prompt's last token to feed (its forward gives the first token's logits)."""
    return common_chunks(tokens, prompt, chunk, stops, limit=len(prompt) - 1)


@dataclass
class CachedPrefix:
    """A finished row's caches, cut back to the whole prompt chunks it prefilled."""

    tokens: tuple[int, ...]  # the ids whose keys and values the sequences hold: `whole` of them
    target: Any  # its target sequence (a KVSequence or LlamaCppSequence)
    draft: Any = None  # its draft sequence (SD in process), holding the same ids, or None
    pending: tuple[int, ...] = ()  # the row's ids after `tokens` (its prompt's rest, its output): `warm`'s

    @property
    def whole(self) -> int:
        return len(self.tokens)

    def grow(self, n: int) -> None:
        """The first `n` pending ids were fed as a prompt chunk: they are held now."""
        self.tokens, self.pending = self.tokens + self.pending[:n], self.pending[n:]


class PrefixCache:
    """Finished rows' caches by recency; `take` hands the best match to a new row and forgets it."""

    def __init__(self, chunk: int, stops: Collection[int] = (), token_bytes: int = 0) -> None:
        """token_bytes: KV memory one held position takes (the target's and draft's together)."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk, self.stops, self.token_bytes = chunk, frozenset(stops), token_bytes
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # by id(entry), oldest first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self.token_bytes * sum(entry.whole for entry in self._entries.values())

    def put(self, entry: CachedPrefix) -> None:
        """Keep `entry` as the most recent (one holding no whole chunk is the caller's to release)."""
        if entry.whole == 0 or whole_chunks(entry.tokens, entry.whole, self.chunk, self.stops) != entry.whole:
            raise ValueError(f"an entry holds whole chunks, got {entry.whole} positions")
        self._entries[id(entry)] = entry

    def find(self, prompt: Sequence[int]) -> tuple[CachedPrefix, int] | None:
        """The entry sharing the most whole chunks with `prompt` (the newest among equals) and
        how many positions it serves; None where none shares a chunk."""
        best, best_len = None, 0
        for entry in reversed(self._entries.values()):  # newest first: ties go to it
            shared = shared_chunks(entry.tokens, prompt, self.chunk, self.stops)
            if shared > best_len:
                best, best_len = entry, shared
        return (best, best_len) if best is not None else None

    def remove(self, entry: CachedPrefix) -> None:
        """`entry` leaves the cache (its sequences become a new row's)."""
        del self._entries[id(entry)]

    def next_chunk(self, entry: CachedPrefix) -> int:
        """How many of `entry`'s pending ids its next whole chunk takes (0: none is whole yet)."""
        return chunk_end(entry.pending, 0, self.chunk, self.stops) or 0  # `whole` is a chunk's end

    def warmable(self) -> CachedPrefix | None:
        """The newest entry with a whole chunk pending (the chat most likely to come back first)."""
        return next((e for e in reversed(self._entries.values()) if self.next_chunk(e)), None)

    def pop_oldest(self, spare: CachedPrefix | None = None) -> CachedPrefix | None:
        """The least recently cached entry but `spare`, gone from the cache (None: no other)."""
        entry = next((e for e in self._entries.values() if e is not spare), None)
        if entry is not None:
            self.remove(entry)
        return entry
