"""The scheduler: which rows run, what a new request reserves, and which prompt chunks a step
prefills.

A request reserves, at admission, the KV bytes its whole generation may take (prompt, up to
max_new_tokens, and a round's speculation past them) and the most tokens one of its rounds
feeds the target; rows are admitted while both fit (batching.kv_memory_mb and
max_batched_tokens, which keeps at least one token of every step for prefill). A step gives
the decoding rows their rounds first, then prompt chunks to the oldest prefilling rows
within the tokens left: decoding never waits behind a long prompt (vLLM's chunked prefill).
"""

from __future__ import annotations

from typing import Callable

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.prefix import chunk_end
from ssd.engine.request import GenerationRequest
from ssd.engine.rows import Row


class Scheduler:
    """The running rows and the engine's limits."""

    def __init__(self, batching: BatchingConfig, token_bytes: int, stops: frozenset[int]) -> None:
        self.batching, self.token_bytes, self.stops = batching, token_bytes, stops
        self.rows: list[Row] = []

    def needs(self, request: GenerationRequest, speculation: SpeculationConfig | None) -> tuple[int, int]:
        """(KV bytes, the most tokens a round feeds the target) the request reserves."""
        k = speculation.round_ceiling if speculation is not None else 0
        tokens = len(request.prompt_ids) + request.generation.max_new_tokens + k
        return tokens * self.token_bytes, k + 1

    def fits(self, need_bytes: int, need_tokens: int, alone: bool = False) -> bool:
        """KV memory within kv_memory_mb and the rounds leaving at least one token of the budget
        for prefill, beside the running rows (or `alone`)."""
        rows = [] if alone else self.rows
        kv_ok = need_bytes + sum(r.kv_bytes for r in rows) <= self.batching.kv_memory_mb * 2**20
        return kv_ok and need_tokens + sum(r.round_tokens for r in rows) < self.batching.max_batched_tokens

    def has_room(self, need_bytes: int, need_tokens: int) -> bool:
        """A free row and the limits met beside the running rows."""
        return len(self.rows) < self.batching.max_rows and self.fits(need_bytes, need_tokens)

    @property
    def reserved_bytes(self) -> int:
        return sum(row.kv_bytes for row in self.rows)

    def decoding(self) -> list[Row]:
        return [row for row in self.rows if row.decoding]

    def cancelled(self) -> list[Row]:
        return [row for row in self.rows if row.request.is_cancelled()]

    def done(self) -> list[Row]:
        return [row for row in self.rows if row.done]

    def chunks(self, decoding: list[Row], round_cost: Callable[[Row], int]) -> list[tuple[Row, list[int]]]:
        """Prompt chunks for this step, oldest rows first, within the budget the rounds leave.

        A chunk ends where the prompt's own tokens say (ssd.engine.prefix.chunk_end: after
        prefill_chunk tokens, or at an end-of-turn token) or at the prompt's end, and is
        never cut to fit: a prompt's chunks are the same whatever else a step runs, so are
        its keys and values where a backend computes a chunk as a whole (llama.cpp,
        ssd.models.llamacpp), and a cached prefix holds what a fresh prefill computes.
        A chunk that does not fit waits.
        """
        size = self.batching.prefill_chunk
        budget = self.batching.max_batched_tokens - sum(round_cost(r) for r in decoding)
        chunks = []
        for row in self.rows:
            if row.decoding or row.leader is not None:  # a follower waits for its leader's chunks
                continue
            prompt = row.request.prompt_ids
            end = chunk_end(prompt, row.prefilled, size, self.stops) or len(prompt)
            if end - row.prefilled > budget:
                break
            chunks.append((row, prompt[row.prefilled : end]))
            budget -= end - row.prefilled
        return chunks
