"""Continuous batching: many requests advance together, one round at a time.

A `BatchEngine` holds up to `max_rows` running requests (rows). Requests join
between rounds (`admit`) and leave the moment they finish, are cancelled or
fail, without disturbing the other rows: every row keeps its own KV cache,
seeded generator, stop strings, EOS and max tokens. One `step` runs one round
for every row: AR decodes one token per row; SD drafts K per row and the
target verifies every row's speculation in one batched forward, then each row
accepts, rolls back and samples on its own with the one verification routine.
SSD (ssd.engine.batch_ssd) gets every row's speculation from the draft in one
exchange per step and verifies them the same way.

The serving worker drives it:

    while rows or queue:
        while queue and engine.can_admit(queue[0].request):
            engine.admit(queue.popleft().request)   # prefill chunks run inside step()
        for finished in engine.step():
            hand finished.result to finished.request's stream

A batch of one is `generate(request)`: the Generator interface.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.base import RequestHandling, SequenceState, Verifier
from ssd.engine.metrics import Stopwatch
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.engine.sd import draft_length, q_matrix, settle_draft
from ssd.models.kv import KVSequence, forward_rows, kv_bytes_per_token
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.engine.drafting import Chain, draft_chains
from ssd.verify import verify

log = logging.getLogger(__name__)


@dataclass
class Finished:
    """A row that left the batch in this step: its request and how it ended.

    `error` is set (and `result` is None) when this row alone failed; the
    other rows go on.
    """

    request: GenerationRequest
    result: GenerationResult | None
    error: Exception | None = None


class BatchEngine(ABC):
    mode: str = ""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Requests admitted and not yet finished (prefilling or decoding)."""

    @abstractmethod
    def can_admit(self, request: GenerationRequest) -> bool:
        """Whether `request` fits now (rows, batched tokens and KV memory limits)."""

    @abstractmethod
    def admit(self, request: GenerationRequest) -> None:
        """Add a row; its prefill runs (chunked) in the next steps, interleaved with decoding."""

    @abstractmethod
    def step(self) -> list[Finished]:
        """One round for every row; return the rows that left the batch.

        Cancelled rows (request.is_cancelled()) leave first with finish
        reason "aborted". Each row's admitted tokens go to its
        request.on_tokens as the round lands.
        """

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request alone (a batch of one)."""
        if self.rows:
            raise RuntimeError("generate() runs a request alone; this engine has rows running")
        self.admit(request)
        while True:
            for finished in self.step():
                if finished.error is not None:
                    raise finished.error
                return finished.result

    def close(self) -> None:
        """Free whatever the engine runs besides the caller's thread."""


@dataclass
class Row:
    """One request in the batch: its state, its own caches, and how far its prompt is prefilled."""

    state: SequenceState
    target: KVSequence
    draft: KVSequence | None
    clock: Stopwatch
    kv_bytes: int  # what admission reserved for its caches
    round_tokens: int  # the most tokens one of its rounds feeds the target (K + 1; AR: 1)
    prefilled: int = 0  # prompt tokens the target has been fed
    chain: Chain | None = None  # SD: this round's drafting
    link: Any = None  # SSD: the row's sequence on the draft link (ssd.engine.batch_ssd.RowLink)
    error: Exception | None = None

    @property
    def request(self) -> GenerationRequest:
        return self.state.request

    @property
    def decoding(self) -> bool:
        """The prompt is in the cache and the first token sampled: rounds run."""
        return self.prefilled == len(self.state.request.prompt_ids)

    @property
    def done(self) -> bool:
        return self.error is not None or self.state.output.finished


class BatchedEngine(RequestHandling, BatchEngine):
    """The round loop of continuous batching; AR and SD say what a round drafts and how it settles.

    A step: cancelled rows leave; prefilling rows get prompt chunks within
    the token budget left after the decoding rows' rounds; the mode drafts
    (SD); one packed target forward runs every prefill chunk and every
    decoding row's scored positions; then each row settles on its own.
    Work that is one row's (sampling, verification, its callback) fails that
    row alone; a failed batched forward fails every row in it.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Tokenizer,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        speculation: SpeculationConfig | None = None,
        draft: torch.nn.Module | None = None,
    ) -> None:
        self._bind(target, tokenizer, verifier, speculation)
        self.target_model, self.draft_model = target, draft
        self.batching = batching or BatchingConfig()
        self._token_bytes = kv_bytes_per_token(target) + (kv_bytes_per_token(draft) if draft is not None else 0)
        self._rows: list[Row] = []

    @property
    def rows(self) -> int:
        return len(self._rows)

    def can_admit(self, request: GenerationRequest) -> bool:
        """Whether `request` fits beside the running rows.

        True also for a request `admit` refuses (a mode this engine does not
        run, or one that exceeds the limits even alone), so that a worker
        hands back the error instead of queueing it forever.
        """
        try:
            need_bytes, need_tokens = self._needs(request)
        except ValueError:
            return True
        if not self._fits(need_bytes, need_tokens, []):
            return True
        return len(self._rows) < self.batching.max_rows and self._fits(need_bytes, need_tokens, self._rows)

    def admit(self, request: GenerationRequest) -> None:
        need_bytes, need_tokens = self._needs(request)
        if not self._fits(need_bytes, need_tokens, []):
            raise ValueError(
                f"request needs {need_bytes / 2**20:.1f} MiB of KV cache and {need_tokens} tokens per round; "
                f"the engine allows {self.batching.kv_memory_mb} MiB and {self.batching.max_batched_tokens} tokens"
            )
        if len(self._rows) >= self.batching.max_rows or not self._fits(need_bytes, need_tokens, self._rows):
            raise RuntimeError(f"the batch is full ({self.rows} rows); check can_admit first")
        draft = KVSequence(self.draft_model) if self.draft_model is not None else None
        self._rows.append(Row(
            self._new_state(request), KVSequence(self.target_model), draft, Stopwatch(), need_bytes, need_tokens
        ))

    def step(self) -> list[Finished]:
        left = self._drop_cancelled()
        decoding = [row for row in self._rows if row.decoding]
        chunks = self._chunks(decoding)
        self._together([row for row, _ in chunks], self._prefill_draft, chunks)
        self._together(decoding, self._draft, decoding)
        jobs = [(row, ids, True) for row, ids in chunks if row.error is None]
        jobs += [(row, self._scored(row), False) for row in decoding if row.error is None]
        started = time.perf_counter()
        logits = self._together([row for row, _, _ in jobs], self._score, jobs)
        forward_s = time.perf_counter() - started
        for (row, ids, prefill), rows in zip(jobs, logits or []):
            if prefill:
                self._alone(row, self._prefilled, row, len(ids), rows)
            else:
                self._alone(row, self._settle, row, rows, forward_s)
        return left + self._collect()

    # --- what a mode says ---------------------------------------------------------

    def _round_cost(self, row: Row) -> int:
        """The tokens this step's round of `row` feeds the target."""
        return 1

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        """Feed the draft the same prompt chunks (SD)."""

    def _draft(self, rows: list[Row]) -> None:
        """Draft this round's tokens for every decoding row (SD)."""

    def _scored(self, row: Row) -> list[int]:
        """The tokens this round feeds the row's target: what its cache lacks, then any drafts."""
        drafted = row.chain.tokens if row.chain is not None else []
        return [*row.state.sequence, *drafted][row.target.length :]

    @abstractmethod
    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """Turn the row's scored logits into its round's tokens and emit them."""

    # --- the loop -----------------------------------------------------------------

    def _needs(self, request: GenerationRequest) -> tuple[int, int]:
        """(KV bytes, the most tokens a round feeds the target) the request
        reserves; refuses a mode this engine does not run."""
        speculation = self._settings(request)
        k = speculation.k if speculation is not None else 0
        tokens = len(request.prompt_ids) + request.generation.max_new_tokens + k
        return tokens * self._token_bytes, k + 1

    def _fits(self, need_bytes: int, need_tokens: int, rows: Sequence[Row]) -> bool:
        """KV memory within kv_memory_mb; the rounds leave at least one token of the budget for prefill."""
        kv_ok = need_bytes + sum(r.kv_bytes for r in rows) <= self.batching.kv_memory_mb * 2**20
        round_tokens = need_tokens + sum(r.round_tokens for r in rows)
        return kv_ok and round_tokens < self.batching.max_batched_tokens

    def _drop_cancelled(self) -> list[Finished]:
        left = []
        for row in [r for r in self._rows if r.request.is_cancelled()]:
            row.state.output.finish_reason = "aborted"
            left.append(Finished(row.request, self._result(row.state, row.clock)))
            self._rows.remove(row)
        return left

    def _chunks(self, decoding: list[Row]) -> list[tuple[Row, list[int]]]:
        """Prompt chunks for this step, oldest rows first, within the budget the rounds leave."""
        budget = self.batching.max_batched_tokens - sum(self._round_cost(r) for r in decoding)
        chunks = []
        for row in self._rows:
            if row.decoding:
                continue
            prompt = row.request.prompt_ids
            n = min(self.batching.prefill_chunk, len(prompt) - row.prefilled, budget)
            if n <= 0:
                break
            chunks.append((row, prompt[row.prefilled : row.prefilled + n]))
            budget -= n
        return chunks

    def _score(self, jobs: list[tuple[Row, list[int], bool]]) -> list[torch.Tensor]:
        """One packed target forward: the last position of prefill chunks, every scored position of rounds."""
        return forward_rows([row.target for row, _, _ in jobs], [ids for _, ids, _ in jobs], [last for *_, last in jobs])

    def _prefilled(self, row: Row, fed: int, logits: torch.Tensor) -> None:
        """Count a prefill chunk; the chunk that completes the prompt samples the first token."""
        row.prefilled += fed
        if row.decoding:
            self._emit(row.state, [self._next_token(row.state, logits[-1])])
            row.state.stats.time_to_first_token_s = row.clock.elapsed()

    def _together(self, rows: list[Row], work: Callable, *args) -> object:
        """Run work shared by `rows` (a batched forward); if it fails, each of them fails with it."""
        if not rows:
            return None
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - handed back with every row it touched
            log.warning("a batched forward over %d rows failed: %r", len(rows), error)
            for row in rows:
                row.error = error
            return None

    @staticmethod
    def _alone(row: Row, work: Callable, *args) -> None:
        """Run one row's own work; if it fails, that row alone leaves with the error."""
        try:
            work(*args)
        except Exception as error:  # noqa: BLE001 - handed back with this row
            log.warning("request %r failed: %r", row.request.request_id, error)
            row.error = error

    def _collect(self) -> list[Finished]:
        """Rows that finished or failed leave now; their caches go with them."""
        left = []
        for row in [r for r in self._rows if r.done]:
            if row.error is not None:
                left.append(Finished(row.request, None, row.error))
            else:
                left.append(Finished(row.request, self._result(row.state, row.clock)))
            self._rows.remove(row)
        return left


class BatchedAREngine(BatchedEngine):
    """Autoregressive decoding, one token per row per step: the batched reference."""

    mode = "ar"

    def __init__(self, target: torch.nn.Module, tokenizer: Tokenizer, batching: BatchingConfig | None = None) -> None:
        super().__init__(target, tokenizer, batching)

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        started = time.perf_counter()
        token = self._next_token(row.state, logits[-1])
        row.state.stats.record_round(drafted=0, accepted=0, target_s=forward_s + time.perf_counter() - started)
        self._emit(row.state, [token])


class BatchedSDEngine(BatchedEngine):
    """Speculative decoding for every row: K batched draft steps, one batched target verification."""

    mode = "sd"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        k: int = 4,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
    ) -> None:
        """`k`: drafted tokens per round for requests that bring no speculation settings."""
        super().__init__(target, tokenizer, batching, verifier, SpeculationConfig(mode="sd", k=k), draft)
        self.precision += f", draft {precision_of(draft)}"

    def _round_cost(self, row: Row) -> int:
        return self._draft_length(row) + 1

    def _draft_length(self, row: Row) -> int:
        """K for this row at the current batch size (speculation.k_policy; 0: a plain
        target step), never past max_new_tokens."""
        k = row.state.speculation.k_for(len(self._rows))
        return min(k, draft_length(row.state))

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        forward_rows([row.draft for row, _ in chunks], [ids for _, ids in chunks], last_only=True)

    def _draft(self, rows: list[Row]) -> None:
        for row in rows:
            state = row.state
            row.chain = Chain(row.draft, state.sequence, self._draft_length(row), state.sampling, state.gen)
        draft_chains([row.chain for row in rows])
        for row in rows:
            row.error = row.chain.error

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        started = time.perf_counter()
        state, drafted = row.state, row.chain.tokens
        k = len(drafted)
        outcome = self._judge(state, drafted, q_matrix(row.chain.q_rows, state), logits[-(k + 1) :])
        row.target.rollback(len(state.sequence) + outcome.k)
        settle_draft(row.draft, state, outcome)
        state.stats.record_round(drafted=k, accepted=outcome.k, target_s=forward_s + time.perf_counter() - started)
        self._emit(state, outcome.tokens(drafted))
