"""The one engine loop: continuous batching, many requests advancing together, one round at a time.

Every mode (AR, SD, SSD) is one batched engine on this loop; a single
request is a batch of one (`Engine.generate`). An engine holds up to
`max_rows` running requests (rows). Requests join between rounds (`admit`)
and leave the moment they finish, are cancelled or fail, without disturbing
the other rows: every row keeps its own KV cache, seeded generator, stop
strings, EOS and max tokens. One `step` runs one round for every row: AR
decodes one token per row (ssd.engine.ar); SD drafts K per row and the target
verifies every row's speculation in one batched forward (ssd.engine.sd); SSD
gets every row's speculation from the draft in one exchange per step
(ssd.saguaro.target). Then each row accepts, rolls back and samples on its
own with the one verification routine.

The serving worker drives it:

    while rows or queue:
        while queue and engine.can_admit(queue[0].request):
            engine.admit(queue.popleft().request)   # prefill chunks run inside step()
        for finished in engine.step():
            hand finished.result to finished.request's stream

A tensor-parallel target (ssd.models.tp) is handed over as its leader, a
model whose sequences the follower ranks mirror: its rows batch as any
model's, each packed forward one command to the followers.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.kv_manager import KVManager
from ssd.engine.lookup import one_hot_rows
from ssd.engine.metrics import Stopwatch
from ssd.engine.proposers import PromptLookup, Proposal
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.engine.rows import Row, SequenceState, Verifier, emit, judge, new_state, next_token, result, score_prompt
from ssd.engine.scheduler import Scheduler
from ssd.models.backend import Model, forward_rows, precision_of
from ssd.models.tokenizer import Tokenizer, eos_token_ids
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

__all__ = ["BatchedEngine", "Engine", "Finished", "Row", "SequenceState", "Verifier"]


@dataclass
class Finished:
    """A row that left the batch in this step: its request and how it ended.

    `error` is set (and `result` is None) when this row alone failed; the
    other rows go on.
    """

    request: GenerationRequest
    result: GenerationResult | None
    error: Exception | None = None


class Engine(ABC):
    """What a caller drives: rows join (`admit`), advance (`step`) and leave.

    Implemented by the batched engines here and by the cluster's proxy to an
    engine on target rank 0 (ssd.cluster.batch).
    """

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

    def stepped_rows(self, rows_before: int) -> list[int]:
        """The row count of each step the last `step` call ran (for /metrics): one step of
        the rows it had. An engine whose call may run none or several says so (replicas)."""
        return [rows_before]

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request alone: a batch of one (the Generator interface)."""
        if self.rows:
            raise RuntimeError("generate() runs a request alone; this engine has rows running")
        self.admit(request)
        while True:
            for finished in self.step():
                if finished.error is not None:
                    raise finished.error
                return finished.result

    def warm(self) -> bool:
        """Idle work between requests, one short piece a call (ssd.engine.prefix: prefilling a
        finished chat's reply before its next turn); whether more is left. None by default."""
        return False

    def close(self) -> None:
        """Free whatever the engine runs besides the caller's thread."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BatchedEngine(Engine):
    """The round loop; a mode says what a round drafts and how a row settles.

    A step, as nano-vllm shapes it: schedule (cancelled rows leave; followers take their
    leaders' chunks; prefilling rows get prompt chunks within the token budget the decoding
    rows' rounds leave: ssd.engine.scheduler) -> propose (the mode's drafter gives each row
    a Proposal: SD's chain, SSD's proposal; rows it gives none look their text up:
    ssd.engine.proposers) -> one packed target forward over every prefill chunk and every
    decoding row's scored positions -> settle (each row alone, one path for every proposer,
    with the one verification routine: ssd.engine.rows) -> leave (ssd.engine.kv_manager
    keeps or frees the caches). A mode says `_draft`, `_proposal` and `_settled`.
    Work that is one row's (sampling, verification, its callback) fails that row alone;
    a failed batched forward fails every row in it.
    """

    def __init__(
        self,
        target: Model,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        draft: Model | None = None,
    ) -> None:
        """`speculation`: the settings for requests that bring none of their own.

        `target` and `draft` are models of any backend (ssd.models.backend: a torch
        module, a llama.cpp model, or for `target` a tensor-parallel leader, ssd.models.tp.TPLeader).
        """
        batching = batching or BatchingConfig()
        self.target_model, self.draft_model = target, draft
        self.tokenizer = tokenizer
        self.batching = batching
        self.speculation = speculation or SpeculationConfig(mode=self.mode)
        if self.speculation.mode != self.mode:
            raise ValueError(f"the {self.mode} engine was given {self.speculation.mode!r} settings")
        self.verifier = verifier  # replaceable so tests can prove their power
        self.eos_ids = eos_token_ids(tokenizer, target)
        self.precision = f"target {precision_of(target)}"  # named in every stats line
        if draft is not None:
            self.precision += f", draft {precision_of(draft)}"
        stops = frozenset(self.eos_ids)  # a prompt chunk also ends after one (ssd.engine.prefix)
        self.kv = KVManager(target, draft, batching, stops)
        self.scheduler = Scheduler(batching, self.kv.token_bytes, stops)
        self.lookup = PromptLookup()

    @property
    def rows(self) -> int:
        return len(self.scheduler.rows)

    def can_admit(self, request: GenerationRequest) -> bool:
        """Whether `request` fits beside the running rows.

        True also for a request `admit` refuses (a mode this engine does not
        run, or one that exceeds the limits even alone), so that a worker
        hands back the error instead of queueing it forever.
        """
        try:
            needs = self.scheduler.needs(request, self._settings(request))
        except ValueError:
            return True
        return not self.scheduler.fits(*needs, alone=True) or self.scheduler.has_room(*needs)

    def admit(self, request: GenerationRequest) -> None:
        speculation = self._settings(request)
        need_bytes, need_tokens = self.scheduler.needs(request, speculation)
        if not self.scheduler.fits(need_bytes, need_tokens, alone=True):
            raise ValueError(
                f"request needs {need_bytes / 2**20:.1f} MiB of KV cache and {need_tokens} tokens per round; "
                f"the engine allows {self.batching.kv_memory_mb} MiB and {self.batching.max_batched_tokens} tokens"
            )
        if not self.scheduler.has_room(need_bytes, need_tokens):
            raise RuntimeError(f"the batch is full ({self.rows} rows); check can_admit first")
        state = new_state(request, speculation, self.mode, self.tokenizer, self.eos_ids, self.precision)
        target, draft, cached = self.kv.open(request, need_bytes, self.scheduler.reserved_bytes)
        state.stats.cached_prompt_tokens = cached
        row = Row(state, target, draft, Stopwatch(), need_bytes, need_tokens, prefilled=cached)
        row.leader, row.shares = self.kv.leader(request, cached, self.scheduler.rows)
        self.scheduler.rows.append(row)

    def step(self) -> list[Finished]:
        left = [self._leave(row, aborted=True) for row in self.scheduler.cancelled()]
        self.kv.follow(self.scheduler.rows)
        decoding = self.scheduler.decoding()
        chunks = self.scheduler.chunks(decoding, self._round_cost)
        self._together([row for row, _ in chunks], self._prefill_draft, chunks)
        self._together(decoding, self._draft, decoding)
        self._look_up(decoding, chunks)
        jobs = [(row, ids, True) for row, ids in chunks if row.error is None]
        jobs += [(row, self._scored(row), False) for row in decoding if row.error is None]
        started = time.perf_counter()
        logits = self._together([row for row, _, _ in jobs], self._score, jobs)
        forward_s = time.perf_counter() - started
        if logits and not chunks:  # a prefill chunk's cost is not a round's
            self.lookup.step_cost.observe(sum(len(ids) for _, ids, _ in jobs), forward_s)
        for (row, ids, prefill), rows in zip(jobs, logits or []):
            if prefill:
                self._alone(row, self._prefilled, row, len(ids), rows)
            else:
                self._alone(row, self._settle, row, rows, forward_s)
        return left + [self._leave(row) for row in self.scheduler.done()]

    def warm(self) -> bool:
        """Idle work (no rows): the prefix cache prefills a finished chat's reply as its next
        turn's prompt chunks, one chunk a call (ssd.engine.kv_manager); whether more is left."""
        return not self.scheduler.rows and self.kv.warm()

    # --- what a mode says ---------------------------------------------------------

    def _round_cost(self, row: Row) -> int:
        """The most tokens this step's round of `row` feeds the target."""
        return 1 + self.lookup.room(row)

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        """Feed the draft the same prompt chunks (SD)."""

    def _draft(self, rows: list[Row]) -> None:
        """Draft this round's tokens for every decoding row (SD, SSD)."""

    def _proposal(self, row: Row) -> Proposal | None:
        """This round's speculation of the row from the mode's drafter (SD's chain, SSD's
        proposal); None: the drafter ran no round for it (AR, no draft, parked or lost)."""
        return None

    def _drafts_nothing(self, row: Row) -> bool:
        """Whether the row's round is a plain target step unless a prompt lookup fills it."""
        proposal = self._proposal(row)
        return proposal is None or not proposal.tokens

    def _settled(self, row: Row, outcome: Outcome | None, seconds: float) -> None:
        """After the row's round: `outcome` of the drafter's proposal (None: a plain step or a
        prompt lookup ran instead) and the round's target seconds."""

    def _scored(self, row: Row) -> list[int]:
        """The tokens this round feeds the row's target: what its cache lacks, then its speculation."""
        proposal = self._proposal(row)
        speculated = row.lookup or (proposal.tokens if proposal is not None else ())
        return [*row.state.sequence, *speculated][row.target.length :]

    def _settings(self, request: GenerationRequest) -> SpeculationConfig | None:
        """The request's speculation settings (else the engine's); a mode this engine does not run is an error."""
        speculation = request.settings(self.speculation)
        if speculation.mode != self.mode:
            raise ValueError(f"speculation.mode {speculation.mode!r} sent to the {self.mode} engine")
        return speculation if self.mode != "ar" else None

    # --- settling a row: the same in every mode -------------------------------------

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """Turn the row's scored logits into its round's tokens, the same path for every
        proposer: the drafter's proposal, else the row's prompt lookup (a one-hot q), both
        through the one verification routine; else one token of the target alone."""
        proposal = None if row.lookup else self._proposal(row)
        if proposal is not None:
            self._settled(row, *self._verify(row, proposal, logits, forward_s))
            return
        if row.lookup:
            q = one_hot_rows(row.lookup, logits.shape[-1]) if row.state.sampling.needs_q else None
            outcome, _ = self._verify(row, Proposal(row.lookup, q), logits, forward_s, looked_up=True)
            self.lookup.settled(row, outcome.k)
        else:
            started = time.perf_counter()
            token = next_token(row.state, logits[-1])
            row.state.stats.record_round(drafted=0, accepted=0, target_s=forward_s + time.perf_counter() - started)
            emit(row.state, [token], logits[-1:])
        self._settled(row, None, forward_s)

    def _verify(
        self, row: Row, proposal: Proposal, logits: torch.Tensor, forward_s: float, looked_up: bool = False,
    ) -> tuple[Outcome, float]:
        """Verify a speculation, roll the row's caches back to the accepted tokens, count the
        round and emit its tokens; (outcome, the round's target seconds: forward + verification)."""
        started = time.perf_counter()
        state, drafted = row.state, list(proposal.tokens)
        k = len(drafted)
        q = proposal.stacked_q() if state.sampling.needs_q else None  # greedy and coupled never read q
        outcome = judge(state, drafted, q, logits[-(k + 1) :], self.verifier)
        row.target.rollback(len(state.sequence) + outcome.k)
        if row.draft is not None:  # it never fed its last drafted token, so it may hold fewer
            row.draft.rollback(min(row.draft.length, len(state.sequence) + outcome.k))
        target_s = forward_s + time.perf_counter() - started
        if looked_up:  # counted apart: acceptance stays the draft's
            state.stats.record_lookup(proposed=k, accepted=outcome.k, target_s=target_s)
        else:
            state.stats.record_round(drafted=k, accepted=outcome.k, target_s=target_s)
        emit(state, outcome.tokens(drafted), logits[-(k + 1) :])
        return outcome, target_s

    def _look_up(self, decoding: list[Row], chunks: list[tuple[Row, list[int]]]) -> None:
        """Each row that drafts nothing this round proposes what its text predicts
        (ssd.engine.proposers), priced at what a token adds to this step's forward."""
        wanting = [(row, room) for row in decoding
                   if row.error is None and self._drafts_nothing(row) and (room := self.lookup.room(row))]
        for row in decoding:
            row.lookup, row.lookup_match = [], 0
        if not wanting:
            return
        base = sum(len(ids) for _, ids in chunks) + sum(len(self._scored(r)) for r in decoding if r.error is None)
        token_cost = self.lookup.step_cost.token_cost(base)
        for row, room in wanting:
            self._alone(row, self.lookup.propose, row, room, token_cost, len(decoding))
        self.lookup.forget_unproposed(row for row, _ in wanting)

    # --- the forward --------------------------------------------------------------

    def _score(self, jobs: list[tuple[Row, list[int], bool]]) -> list[torch.Tensor]:
        """One packed target forward: the last position of prefill chunks (every position when the
        request asks for its prompt's log-probabilities), every scored position of rounds."""
        scored_prompt = [prefill and row.state.prompt_logprobs is not None for row, _, prefill in jobs]
        last_only = [prefill and not scored for (_, _, prefill), scored in zip(jobs, scored_prompt)]
        return forward_rows([row.target for row, _, _ in jobs], [ids for _, ids, _ in jobs], last_only, scored_prompt)

    def _prefilled(self, row: Row, fed: int, logits: torch.Tensor) -> None:
        """Count a prefill chunk; the chunk that completes the prompt samples the first token."""
        if row.state.prompt_logprobs is not None:
            score_prompt(row.state, row.prefilled, logits)
        row.prefilled += fed
        if row.decoding:
            emit(row.state, [next_token(row.state, logits[-1])], logits[-1:])
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

    def _leave(self, row: Row, aborted: bool = False) -> Finished:
        """The row leaves the batch (cancelled: `aborted`; finished or failed) and the KV manager
        keeps or frees its caches."""
        if aborted:
            row.state.output.finish_reason = "aborted"
        self.scheduler.rows.remove(row)
        self.kv.leave(row)
        if row.error is not None and not aborted:
            return Finished(row.request, None, row.error)
        return Finished(row.request, result(row.state, row.clock))
