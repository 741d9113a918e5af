"""The KV/prefix manager: the one owner of every KV sequence the engine's rows run on.

It makes a new row's target and draft sequences, or hands it an earlier request's whole
prompt chunks from the prefix cache (ssd.engine.prefix: which chunks may be reused and why
the output stays bit for bit the same); it lets rows admitted together prefill their shared
chunks once (a follower copies its leader's); it keeps a leaving row's chunks for later
prompts or gives its sequences back; and, while the engine is idle, it prefills a finished
chat's reply as its next turn's prompt chunks (`warm`). nano-vllm's block manager has the same
job over paged blocks; here a sequence is opaque (a torch KV cache or a llama.cpp slot) and
what it can do (copy itself, keep a prefix) is the backend's.

A tensor-parallel target's sequences (ssd.models.tp) are handled as any: each is mirrored
on the follower ranks, a copy or a release included.
"""

from __future__ import annotations

import logging
from typing import Collection

from ssd.config import BatchingConfig
from ssd.engine.prefix import CachedPrefix, PrefixCache, common_chunks, shared_chunks, whole_chunks
from ssd.engine.request import GenerationRequest
from ssd.engine.rows import Row
from ssd.models.backend import (
    AnySequence, Model, forward_rows, has_free_slot, kv_bytes_per_token, new_sequence, release, sequence_source,
)

log = logging.getLogger(__name__)

Sequences = tuple[AnySequence, AnySequence | None]


class KVManager:
    """Sequences for rows, the prefix cache over finished ones, and shared prompt chunks."""

    def __init__(self, target: Model, draft: Model | None, batching: BatchingConfig, stops: Collection[int]) -> None:
        self.batching, self.stops = batching, frozenset(stops)
        self.token_bytes = kv_bytes_per_token(target) + (kv_bytes_per_token(draft) if draft is not None else 0)
        self.target_source = self._source(target)
        self.draft_source = self._source(draft) if draft is not None else None
        self.prefix = PrefixCache(batching.prefill_chunk, self.stops, self.token_bytes) if batching.prefix_cache else None

    def _source(self, model: Model) -> object:
        """What sequences of `model` come from (ssd.models.backend.sequence_source)."""
        b = self.batching
        return sequence_source(model, b.max_rows, b.max_batched_tokens,
                               int(b.kv_memory_mb * 2**20) // kv_bytes_per_token(model))

    @property
    def _sources(self) -> list[object]:
        return [s for s in (self.target_source, self.draft_source) if s is not None]

    def fresh(self) -> Sequences:
        """New, empty target and draft sequences."""
        draft = new_sequence(self.draft_source) if self.draft_source is not None else None
        return new_sequence(self.target_source), draft

    # --- a new row ----------------------------------------------------------------------

    def open(self, request: GenerationRequest, need_bytes: int, reserved: int) -> tuple[AnySequence, AnySequence | None, int]:
        """A new row's target and draft sequences, and how many prompt positions they already hold:
        an earlier request's whole prompt chunks the prompt starts with, or none. `reserved`: the
        bytes the running rows hold."""
        reuse = self.prefix is not None and request.prompt_logprobs is None  # those score every position
        found = self.prefix.find(request.prompt_ids) if reuse else None
        if found is None:
            self._make_room(need_bytes + reserved, slots=True)
            return (*self.fresh(), 0)
        entry, cached = found
        if cached < entry.whole:  # another prompt's entry: a copy of the shared part, if there is room
            self._make_room(need_bytes + reserved, slots=True, spare=entry)
            forked = self._copies(entry.target, entry.draft, cached) if all(map(has_free_slot, self._sources)) else None
            if forked is not None:
                return (*forked, cached)
        self.prefix.remove(entry)  # this prompt continues it (or no room for a copy): it moves
        self._make_room(need_bytes + reserved, slots=False)
        for sequence in (entry.target, entry.draft):
            if sequence is not None:
                sequence.rollback(cached)
        return entry.target, entry.draft, cached

    @staticmethod
    def _copies(target: AnySequence, draft: AnySequence | None, length: int) -> Sequences | None:
        """Copies of the first `length` positions of a target sequence and its draft's (None:
        none); None, and nothing made, where a sequence cannot copy itself (a context of its own)."""
        made = []
        try:
            for sequence in (target, draft):
                made.append(sequence.fork(length) if sequence is not None else None)
        except ValueError as error:
            log.debug("a prefix is not copied: %r", error)
            for sequence in made:
                release(sequence)
            return None
        return made[0], made[1]

    def _make_room(self, reserved: int, slots: bool, spare: CachedPrefix | None = None) -> None:
        """Drop the oldest cached prefixes (but `spare`) while they hold the memory the rows need
        (`reserved` bytes, the new row's included), or (`slots`: it needs new sequences) every
        free llama.cpp slot."""
        if self.prefix is None:
            return
        budget = self.batching.kv_memory_mb * 2**20
        sources = self._sources if slots else []
        while len(self.prefix) > (spare is not None) and (reserved + self.prefix.nbytes > budget
                                                          or not all(map(has_free_slot, sources))):
            self._drop(self.prefix.pop_oldest(spare))

    # --- rows admitted together: a leader prefills the shared chunks once --------------

    def leader(self, request: GenerationRequest, cached: int, rows: list[Row]) -> tuple[Row | None, int]:
        """The running row whose prompt shares the most whole chunks with `request`'s, more than
        the `cached` ones the new row holds, and how many positions: `n` samples of one prompt,
        or requests under one system prompt, admitted together prefill the shared chunks once
        (vLLM and SGLang share them through their prefix caches the same way)."""
        if self.prefix is None or request.prompt_logprobs is not None:
            return None, 0
        best, most = None, cached
        for row in rows:
            if row.leader is not None or row.error is not None or not _copyable(row):
                continue
            shares = shared_chunks(row.request.prompt_ids, request.prompt_ids, self.batching.prefill_chunk, self.stops)
            if shares > most:
                best, most = row, shares
        return (best, most) if best is not None else (None, 0)

    def follow(self, rows: list[Row]) -> None:
        """Rows whose leader has prefilled the chunks they share take copies of them; a leader
        that failed or left leaves its followers to prefill on their own."""
        for row in rows:
            leader = row.leader
            if leader is None:
                continue
            gone = leader.error is not None or leader not in rows
            if not gone and leader.prefilled < row.shares:
                continue
            row.leader = None
            if not gone:
                self._copy_chunks(row, leader)

    def _copy_chunks(self, row: Row, leader: Row) -> None:
        """`row`'s sequences become copies of the prompt chunks it shares with `leader`: a prompt
        chunk computes the same keys and values in any row, so they hold what its own prefill would."""
        prompt, chunk = row.request.prompt_ids, self.batching.prefill_chunk
        length = min(common_chunks(s.tokens, prompt, chunk, self.stops, limit=row.shares)
                     for s in (leader.target, leader.draft) if s is not None)
        if length <= row.prefilled:
            return
        release(row.target)  # first: a llama.cpp copy takes the slot this frees
        release(row.draft)
        copies = self._copies(leader.target, leader.draft, length)
        if copies is None:  # a sequence that cannot copy itself: this row prefills on its own
            length, copies = 0, self.fresh()
        row.target, row.draft = copies
        row.prefilled = row.state.stats.cached_prompt_tokens = length

    # --- a row leaves -------------------------------------------------------------------

    def leave(self, row: Row) -> None:
        """A leaving row's caches wait for a later prompt (`_keep`) or go back (a llama.cpp slot
        is freed at once)."""
        if self._keep(row):
            return
        release(row.target)
        release(row.draft)

    def _keep(self, row: Row) -> bool:
        """Cache a finishing row's whole prompt chunks for later prompts; False: its caches go
        back."""
        if self.prefix is None or row.error is not None:
            return False
        chunk, prompt, stops = self.batching.prefill_chunk, row.request.prompt_ids, self.stops
        whole = whole_chunks(prompt, min(row.prefilled, row.target.length), chunk, stops)
        sequences = [s for s in (row.target, row.draft) if s is not None]
        if not all(s.keeps_prefix for s in sequences):
            return False
        for sequence in sequences:  # what each holds of those whole chunks
            whole = common_chunks(sequence.tokens, prompt, chunk, stops, limit=whole)
        if whole == 0:
            return False
        for sequence in sequences:
            sequence.rollback(whole)
        text = row.state.sequence
        self.prefix.put(CachedPrefix(tuple(text[:whole]), row.target, row.draft,
                                     pending=(*text[whole:], *self._turn_end(row))))
        return True

    def _turn_end(self, row: Row) -> tuple[int, ...]:
        """What a chat's next prompt likely puts after an output that did not end its turn (cut by
        max_tokens or a stop string): the end-of-turn token that closed the prompt's earlier
        messages, so `warm` can prefill up to it. Only a guess of what to prefill: a prompt
        that goes on otherwise shares nothing past it."""
        output = row.state.output.token_ids
        if not output or output[-1] in self.stops:  # no output (left while prefilling), or it ended its turn
            return ()
        return next(((t,) for t in reversed(row.request.prompt_ids) if t in self.stops), ())

    # --- idle work ----------------------------------------------------------------------

    def warm(self) -> bool:
        """Prefill one whole chunk of the newest entry's pending ids as a prompt chunk
        (ssd.engine.prefix); whether more is left. Only with no rows running (the engine asks
        then), within kv_memory_mb; an entry whose chunk fails (its context is full) stops warming."""
        entry = self.prefix.warmable() if self.prefix is not None else None
        if entry is None:
            return False
        chunk = self.prefix.next_chunk(entry)
        if self.prefix.nbytes + chunk * self.token_bytes > self.batching.kv_memory_mb * 2**20:
            return False
        sequences = [s for s in (entry.target, entry.draft) if s is not None]
        try:
            for sequence in sequences:
                forward_rows([sequence], [list(entry.pending[:chunk])], last_only=True)
        except Exception as error:  # noqa: BLE001 - the entry stays as it was; warming it stops
            log.info("warming a cached prefix stopped: %r", error)
            for sequence in sequences:
                sequence.rollback(entry.whole)
            entry.pending = ()
            return self.prefix.warmable() is not None
        entry.grow(chunk)
        return self.prefix.warmable() is not None

    @staticmethod
    def _drop(entry: CachedPrefix | None) -> None:
        if entry is not None:
            release(entry.target)
            release(entry.draft)


def _copyable(row: Row) -> bool:
    return all(s.keeps_prefix for s in (row.target, row.draft) if s is not None)
