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

A tensor-parallel target (ssd.models.tp) is handed over as its leader's one
KVSequence, whose cache operations the follower ranks mirror: there the batch
is held at one row, which reuses that sequence.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ssd.config import BatchingConfig, SamplingConfig, SpeculationConfig
from ssd.engine.drafting import Chain
from ssd.engine.lookup import NGRAM_WINDOW, LookupOdds, StepCost, best_length, one_hot_rows, prompt_lookup
from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.output import OutputTracker
from ssd.engine.prefix import CachedPrefix, PrefixCache, chunk_end, common_chunks, shared_chunks, whole_chunks
from ssd.engine.processing import LogitsProcessor
from ssd.engine.request import GenerationRequest, GenerationResult, Processing, TokenLogprob
from ssd.hardware import sync, to_device
from ssd.models.backend import (
    AnySequence, Model, forward_rows, has_free_slot, kv_bytes_per_token, new_sequence, precision_of, release,
    sequence_source,
)
from ssd.models.kv import KVSequence
from ssd.models.tokenizer import Tokenizer, eos_token_ids
from ssd.sampling import draws_at, greedy_token, make_generator, probs_from_logits, sample, token_logprobs
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

PLAIN_LAW = SamplingConfig()  # token_logprobs at temperature 0 read the plain log-softmax: a prompt's law
PROMPT_ROWS = 32  # prompt positions scored at a time: 32 x 152k float64 is 39 MB

Verifier = Callable[..., Outcome]


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


@dataclass
class SequenceState:
    """One request's generation state while it runs."""

    request: GenerationRequest
    speculation: SpeculationConfig | None  # the settings this request runs with (None: AR)
    gen: torch.Generator
    sequence: list[int]  # prompt + generated ids so far
    output: OutputTracker
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per admitted token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first, when asked
    processor: LogitsProcessor | None = None  # logit_bias, penalties, a grammar (request.processing)

    @property
    def sampling(self) -> SamplingConfig:
        return self.request.sampling


@dataclass
class Row:
    """One request in the batch: its state, its own caches, and how far its prompt is prefilled."""

    state: SequenceState
    target: AnySequence
    draft: AnySequence | None
    clock: Stopwatch
    kv_bytes: int  # what admission reserved for its caches
    round_tokens: int  # the most tokens one of its rounds feeds the target (K + 1; AR: 1)
    prefilled: int = 0  # prompt tokens the target has been fed
    chain: Chain | None = None  # SD: this round's drafting
    lookup: list[int] = dataclasses.field(default_factory=list)  # this round's prompt lookup (ssd.engine.lookup)
    lookup_match: int = 0  # how many of the text's last tokens it matched
    link: Any = None  # SSD: the row's sequence on the draft link (ssd.saguaro.target.RowLink)
    error: Exception | None = None
    # a running row whose prompt chunks this one copies once it has prefilled them (`_follow`):
    # `shares` positions of it; meanwhile this row's prefill waits
    leader: "Row | None" = None
    shares: int = 0

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


class BatchedEngine(Engine):
    """The round loop; a mode says what a round drafts and how a row settles.

    A step: cancelled rows leave; prefilling rows get prompt chunks within
    the token budget left after the decoding rows' rounds; the mode drafts
    (SD, SSD); one packed target forward runs every prefill chunk and every
    decoding row's scored positions; then each row settles on its own.
    Work that is one row's (sampling, verification, its callback) fails that
    row alone; a failed batched forward fails every row in it.
    """

    def __init__(
        self,
        target: Model | KVSequence,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        draft: Model | None = None,
    ) -> None:
        """`speculation`: the settings for requests that bring none of their own.

        `target` and `draft` are models of any backend (ssd.models.backend:
        a torch module or a llama.cpp model), or `target` is the tensor-parallel leader's one sequence
        (ssd.models.tp.TPLeaderSequence): its followers mirror one sequence,
        so the batch is held at one row, which reuses it.
        """
        batching = batching or BatchingConfig()
        self._shared_target = target if isinstance(target, KVSequence) else None
        if self._shared_target is not None:
            target = self._shared_target.model
            batching = dataclasses.replace(batching, max_rows=1)
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
        self._token_bytes = kv_bytes_per_token(target) + (kv_bytes_per_token(draft) if draft is not None else 0)
        self._target_source = self._source(target)
        self._draft_source = self._source(draft) if draft is not None else None
        self._rows: list[Row] = []
        # finished rows' caches for later prompts (ssd.engine.prefix); the tensor-parallel
        # target's one sequence keeps its own: `_shared_whole` positions of it
        self._stops = frozenset(self.eos_ids)  # a prompt chunk also ends after one (ssd.engine.prefix)
        self._prefix = (PrefixCache(batching.prefill_chunk, self._stops, self._token_bytes)
                        if batching.prefix_cache else None)
        self._shared_whole = 0
        # prompt lookup: what a scored token adds to a forward, how lookups fare by match length
        self._step_cost = StepCost()
        self._lookup_odds: dict[int, LookupOdds] = {}

    def _source(self, model: Model) -> object:
        """What the engine's sequences of `model` come from (ssd.models.backend.sequence_source)."""
        b = self.batching
        return sequence_source(model, b.max_rows, b.max_batched_tokens,
                               int(b.kv_memory_mb * 2**20) // kv_bytes_per_token(model))

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
        state = self._new_state(request)
        target, draft, cached = self._sequences(request, need_bytes)
        state.stats.cached_prompt_tokens = cached
        row = Row(state, target, draft, Stopwatch(), need_bytes, need_tokens, prefilled=cached)
        row.leader, row.shares = self._leader(request, cached)
        self._rows.append(row)

    def step(self) -> list[Finished]:
        left = self._drop_cancelled()
        self._follow()
        decoding = [row for row in self._rows if row.decoding]
        chunks = self._chunks(decoding)
        self._together([row for row, _ in chunks], self._prefill_draft, chunks)
        self._together(decoding, self._draft, decoding)
        self._look_up(decoding, chunks)
        jobs = [(row, ids, True) for row, ids in chunks if row.error is None]
        jobs += [(row, self._scored(row), False) for row in decoding if row.error is None]
        started = time.perf_counter()
        logits = self._together([row for row, _, _ in jobs], self._score, jobs)
        forward_s = time.perf_counter() - started
        if logits and not chunks:  # a prefill chunk's cost is not a round's
            self._step_cost.observe(sum(len(ids) for _, ids, _ in jobs), forward_s)
        for (row, ids, prefill), rows in zip(jobs, logits or []):
            if prefill:
                self._alone(row, self._prefilled, row, len(ids), rows)
            else:
                self._alone(row, self._settle, row, rows, forward_s)
        return left + self._collect()

    # --- what a mode says ---------------------------------------------------------

    def _round_cost(self, row: Row) -> int:
        """The most tokens this step's round of `row` feeds the target."""
        return 1 + self._lookup_room(row)

    def _prefill_draft(self, chunks: list[tuple[Row, list[int]]]) -> None:
        """Feed the draft the same prompt chunks (SD)."""

    def _draft(self, rows: list[Row]) -> None:
        """Draft this round's tokens for every decoding row (SD, SSD)."""

    def _drafted(self, row: Row) -> Sequence[int]:
        """This round's speculation of the row from its drafter (SD's chain, SSD's proposal)."""
        return row.chain.tokens if row.chain is not None else []

    def _drafts_nothing(self, row: Row) -> bool:
        """Whether the row's round is a plain target step unless a prompt lookup fills it."""
        return not self._drafted(row)

    def _scored(self, row: Row) -> list[int]:
        """The tokens this round feeds the row's target: what its cache lacks, then its speculation."""
        return [*row.state.sequence, *(row.lookup or self._drafted(row))][row.target.length :]

    @abstractmethod
    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """Turn the row's scored logits into its round's tokens and emit them."""

    # --- one request's handling, the same in every mode -----------------------------

    def _settings(self, request: GenerationRequest) -> SpeculationConfig | None:
        """The request's speculation settings (else the engine's); a mode this engine does not run is an error."""
        speculation = request.settings(self.speculation)
        if speculation.mode != self.mode:
            raise ValueError(f"speculation.mode {speculation.mode!r} sent to the {self.mode} engine")
        return speculation if self.mode != "ar" else None

    def _new_state(self, request: GenerationRequest) -> SequenceState:
        """A request's state before its prompt is processed: its own seeded generator, end conditions and stats."""
        speculation = self._settings(request)
        return SequenceState(
            request=request,
            speculation=speculation,
            gen=make_generator(request.sampling.seed),
            sequence=list(request.prompt_ids),
            output=OutputTracker(self.tokenizer, request.generation, self.eos_ids),
            stats=GenerationStats(
                mode=self.mode, k=speculation.k if speculation is not None else 0,
                prompt_tokens=len(request.prompt_ids), precision=self.precision,
            ),
            logprobs=[] if request.logprobs is not None else None,
            prompt_logprobs=[] if request.prompt_logprobs is not None else None,
            processor=self._processor(request),
        )

    def _processor(self, request: GenerationRequest) -> LogitsProcessor | None:
        """The request's logits processing state, or None when it asks for none."""
        spec = request.processing or Processing()
        generation = request.generation
        held = set(generation.stop_token_ids) | (set() if generation.ignore_eos else self.eos_ids)
        if not spec.active and not (generation.min_tokens and held):
            return None
        return LogitsProcessor(spec, self.tokenizer, sorted(self.eos_ids), request.prompt_ids, generation.min_tokens,
                               sorted(held))

    # --- caches: a new row's, and what a finished row leaves (ssd.engine.prefix) ---

    def _sequences(self, request: GenerationRequest, need_bytes: int) -> tuple[AnySequence, AnySequence | None, int]:
        """A new row's target and draft caches, and how many prompt positions they already hold:
        an earlier request's whole prompt chunks the prompt starts with, or none."""
        reuse = self._prefix is not None and request.prompt_logprobs is None  # those score every position
        if self._shared_target is not None:
            return self._shared_sequences(request, reuse)
        found = self._prefix.find(request.prompt_ids) if reuse else None
        if found is None:
            self._make_room(need_bytes, slots=True)
            draft = new_sequence(self._draft_source) if self._draft_source is not None else None
            return new_sequence(self._target_source), draft, 0
        entry, cached = found
        if cached < entry.whole:  # another prompt's entry: a copy of the shared part, if there is room
            forked = self._fork(entry, cached, need_bytes)
            if forked is not None:
                return (*forked, cached)
        self._prefix.remove(entry)  # this prompt continues it (or no room for a copy): it moves
        self._make_room(need_bytes, slots=False)
        for sequence in (entry.target, entry.draft):
            if sequence is not None:
                sequence.rollback(cached)
        return entry.target, entry.draft, cached

    def _fork(self, entry: CachedPrefix, length: int,
              need_bytes: int) -> tuple[AnySequence, AnySequence | None] | None:
        """Copies of `entry`'s first `length` positions for a new row, the entry staying
        cached; None where the room or a backend's copy is lacking."""
        self._make_room(need_bytes, slots=True, spare=entry)
        sources = [s for s in (self._target_source, self._draft_source) if s is not None]
        if not all(has_free_slot(s) for s in sources):
            return None
        return self._copies(entry.target, entry.draft, length)

    @staticmethod
    def _copies(target: AnySequence, draft: AnySequence | None,
                length: int) -> tuple[AnySequence, AnySequence | None] | None:
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

    def _shared_sequences(self, request: GenerationRequest, reuse: bool) -> tuple[AnySequence, AnySequence | None, int]:
        """Tensor parallel: the one target sequence the followers mirror keeps the last prompt's
        whole chunks (with no draft beside it to keep in step)."""
        shared = self._shared_target
        draft = new_sequence(self._draft_source) if self._draft_source is not None else None
        cached = shared_chunks(shared.tokens[: self._shared_whole], request.prompt_ids,
                               self.batching.prefill_chunk, self._stops) if reuse and draft is None else 0
        if cached:
            shared.rollback(cached)
        else:
            shared.reset()
        return shared, draft, cached

    def _make_room(self, need_bytes: int, slots: bool, spare: CachedPrefix | None = None) -> None:
        """Drop the oldest cached prefixes (but `spare`) while they hold the memory the new row
        needs, or (`slots`: it needs new sequences) every free llama.cpp slot."""
        if self._prefix is None:
            return
        reserved = need_bytes + sum(row.kv_bytes for row in self._rows)
        budget = self.batching.kv_memory_mb * 2**20
        sources = [s for s in (self._target_source, self._draft_source) if s is not None] if slots else []
        while len(self._prefix) > (spare is not None) and (reserved + self._prefix.nbytes > budget
                                                           or not all(has_free_slot(s) for s in sources)):
            self._drop(self._prefix.pop_oldest(spare))

    def _leader(self, request: GenerationRequest, cached: int) -> tuple["Row | None", int]:
        """The running row whose prompt shares the most whole chunks with `request`'s, more than
        the `cached` ones the new row holds, and how many positions: `n` samples of one prompt,
        or requests under one system prompt, admitted together prefill the shared chunks once
        (vLLM and SGLang share them through their prefix caches the same way)."""
        if self._prefix is None or self._shared_target is not None or request.prompt_logprobs is not None:
            return None, 0
        best, most = None, cached
        for row in self._rows:
            if row.leader is not None or row.error is not None or not self._copyable(row):
                continue
            shares = shared_chunks(row.request.prompt_ids, request.prompt_ids, self.batching.prefill_chunk,
                                   self._stops)
            if shares > most:
                best, most = row, shares
        return (best, most) if best is not None else (None, 0)

    @staticmethod
    def _copyable(row: Row) -> bool:
        return all(s.keeps_prefix for s in (row.target, row.draft) if s is not None)

    def _follow(self) -> None:
        """Rows whose leader has prefilled the chunks they share take copies of them; a leader
        that failed or left leaves its followers to prefill on their own."""
        for row in self._rows:
            leader = row.leader
            if leader is None:
                continue
            gone = leader.error is not None or leader not in self._rows
            if not gone and leader.prefilled < row.shares:
                continue
            row.leader = None
            if not gone:
                self._copy_chunks(row, leader)

    def _copy_chunks(self, row: Row, leader: Row) -> None:
        """`row`'s caches become copies of the prompt chunks it shares with `leader`: a prompt chunk
        computes the same keys and values in any row, so they hold what its own prefill would."""
        prompt, chunk = row.request.prompt_ids, self.batching.prefill_chunk
        length = min(common_chunks(s.tokens, prompt, chunk, self._stops, limit=row.shares)
                     for s in (leader.target, leader.draft) if s is not None)
        if length <= row.prefilled:
            return
        release(row.target)  # first: a llama.cpp copy takes the slot this frees
        release(row.draft)
        copies = self._copies(leader.target, leader.draft, length)
        if copies is None:  # a sequence that cannot copy itself: this row prefills on its own
            length, copies = 0, (new_sequence(self._target_source),
                                 new_sequence(self._draft_source) if self._draft_source is not None else None)
        row.target, row.draft = copies
        row.prefilled = row.state.stats.cached_prompt_tokens = length

    def _keep(self, row: Row) -> bool:
        """Cache a finishing row's whole prompt chunks for later prompts; False: its caches go
        back (the tensor-parallel target's one sequence stays, `_shared_whole` of it kept)."""
        if self._prefix is None or row.error is not None:
            return False
        chunk, prompt, stops = self.batching.prefill_chunk, row.request.prompt_ids, self._stops
        whole = whole_chunks(prompt, min(row.prefilled, row.target.length), chunk, stops)
        if row.target is self._shared_target:  # it stays; `_shared_whole` of it serve the next prompt
            self._shared_whole = common_chunks(row.target.tokens, prompt, chunk, stops, limit=whole)
            return False
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
        self._prefix.put(CachedPrefix(tuple(text[:whole]), row.target, row.draft,
                                      pending=(*text[whole:], *self._turn_end(row))))
        return True

    def _turn_end(self, row: Row) -> tuple[int, ...]:
        """What a chat's next prompt likely puts after an output that did not end its turn (cut by
        max_tokens or a stop string): the end-of-turn token that closed the prompt's earlier
        messages, so `warm` can prefill up to it. Only a guess of what to prefill: a prompt
        that goes on otherwise shares nothing past it."""
        output = row.state.output.token_ids
        if not output or output[-1] in self._stops:  # no output (left while prefilling), or it ended its turn
            return ()
        return next(((t,) for t in reversed(row.request.prompt_ids) if t in self._stops), ())

    def warm(self) -> bool:
        """Idle work (no rows): prefill one whole chunk of the newest entry's pending ids as a
        prompt chunk (ssd.engine.prefix); whether more is left. Within kv_memory_mb; an entry
        whose chunk fails (its context is full) stops warming."""
        entry = self._prefix.warmable() if self._prefix is not None and not self._rows else None
        if entry is None:
            return False
        chunk = self._prefix.next_chunk(entry)
        if self._prefix.nbytes + chunk * self._token_bytes > self.batching.kv_memory_mb * 2**20:
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
            return self._prefix.warmable() is not None
        entry.grow(chunk)
        return self._prefix.warmable() is not None

    @staticmethod
    def _drop(entry: CachedPrefix | None) -> None:
        if entry is not None:
            release(entry.target)
            release(entry.draft)

    def _result(self, req: SequenceState, clock: Stopwatch) -> GenerationResult:
        req.stats.total_s = clock.elapsed()
        req.stats.new_tokens = len(req.output.token_ids)
        log.debug("%s", req.stats.summary())
        return GenerationResult(req.output.token_ids, req.output.text(), req.output.finish_reason, req.stats,
                                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                                prompt_logprobs=req.prompt_logprobs)

    @staticmethod
    def _next_token(req: SequenceState, logits: torch.Tensor) -> int:
        """Sample the token after `logits` [V] with the request's settings, processing and
        generator (coupled: its noise at the token's position, len(sequence))."""
        bias = req.processor.bias(logits.shape[-1]) if req.processor is not None else None
        if req.sampling.greedy:  # the one-hot row's draw cannot change the token: skip the row and the draw
            return greedy_token(logits, bias)
        draws = draws_at(req.sampling, req.gen, [len(req.sequence)])
        return sample(probs_from_logits(logits, req.sampling, bias), draws)

    def _judge(self, req: SequenceState, drafted: list[int], q: torch.Tensor | None, logits: torch.Tensor) -> Outcome:
        """Verify `drafted` against the target's logits [K+1, V] at the scored positions.

        p stays on the target's device; sampled q rows are moved there (over a
        host link they arrive in host memory). With logits processing, row i of p
        is the processed law after drafted[:i] (ssd.engine.processing): the law verified
        against. Coupled requests verify with their noise at the K + 1 positions p
        scores, from len(sequence) on.
        """
        bias = req.processor.rows(drafted, logits.shape[-1]) if req.processor is not None else None
        p = probs_from_logits(logits, req.sampling, bias)
        if req.sampling.needs_q:  # greedy and coupled verification never read q
            if q is None:
                if drafted:
                    raise ValueError("a sampled speculation arrived without its q rows")
                q = p.new_zeros(0, p.shape[-1])
            q = to_device(q, p.device)
        start = len(req.sequence)
        draws = draws_at(req.sampling, req.gen, range(start, start + len(drafted) + 1))
        outcome = self.verifier(drafted, q, p, draws, greedy=req.sampling.greedy)
        sync(p)  # the round's timer covers the device's work
        return outcome

    def _settle_speculation(
        self, row: Row, drafted: Sequence[int], q: torch.Tensor | None, logits: torch.Tensor, forward_s: float,
        looked_up: bool = False,
    ) -> tuple[Outcome, float]:
        """Verify the row's speculation (SD and SSD, or its prompt lookup), roll its caches
        back to the accepted tokens, count the round and emit its tokens; (outcome, the
        round's target seconds: forward + verification)."""
        started = time.perf_counter()
        state, drafted = row.state, list(drafted)
        k = len(drafted)
        outcome = self._judge(state, drafted, q, logits[-(k + 1) :])
        row.target.rollback(len(state.sequence) + outcome.k)
        if row.draft is not None:  # it never fed its last drafted token, so it may hold fewer
            row.draft.rollback(min(row.draft.length, len(state.sequence) + outcome.k))
        target_s = forward_s + time.perf_counter() - started
        if looked_up:  # counted apart: acceptance stays the draft's
            state.stats.record_lookup(proposed=k, accepted=outcome.k, target_s=target_s)
        else:
            state.stats.record_round(drafted=k, accepted=outcome.k, target_s=target_s)
        self._emit(state, outcome.tokens(drafted), logits[-(k + 1) :])
        return outcome, target_s

    def _plain_step(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """A round of the target alone: one token from the last scored position (AR, or a
        speculation of 0 tokens), or the tokens its prompt lookup proposed, verified."""
        if row.lookup:
            self._settle_lookup(row, logits, forward_s)
            return
        started = time.perf_counter()
        token = self._next_token(row.state, logits[-1])
        row.state.stats.record_round(drafted=0, accepted=0, target_s=forward_s + time.perf_counter() - started)
        self._emit(row.state, [token], logits[-1:])

    # --- prompt lookup (ssd.engine.lookup) ---------------------------------------------

    @staticmethod
    def _lookup_room(row: Row) -> int:
        """The most tokens the row's prompt lookup may propose in a round (0: it has none)."""
        spec = row.state.speculation
        if spec is None:
            return 0
        return max(0, min(spec.lookup_ceiling, row.state.output.remaining - 1, row.round_tokens - 1))

    def _look_up(self, decoding: list[Row], chunks: list[tuple[Row, list[int]]]) -> None:
        """Each row that drafts nothing this round proposes what its text predicts, as many
        tokens as lookups after a match of its length are accepted and the forward's cost
        of a token make worth it. Match lengths that proposed nothing this step forget
        toward their prior (LookupOdds)."""
        rows = [(row, room) for row in decoding
                if row.error is None and self._drafts_nothing(row) and (room := self._lookup_room(row))]
        for row in decoding:
            row.lookup, row.lookup_match = [], 0
        if not rows:
            return
        base = sum(len(ids) for _, ids in chunks) + sum(len(self._scored(r)) for r in decoding if r.error is None)
        token_cost = self._step_cost.token_cost(base)
        for row, room in rows:
            self._alone(row, self._look_up_row, row, room, token_cost, len(decoding))
        proposed = {row.lookup_match for row, _ in rows if row.lookup}
        for n in {row.lookup_match for row, _ in rows if row.lookup_match} - proposed:
            self._lookup_odds[n].record(0, 0)

    def _look_up_row(self, row: Row, room: int, token_cost: float, rows: int) -> None:
        spec = row.state.speculation.prompt_lookup
        # A prediction is searched whole, as text before the window of the text so far, however long
        # the text grows (0.25 ms a round for an 8k-token prediction, measured on this host).
        context = [*(row.state.request.prediction or ()), *row.state.sequence[-NGRAM_WINDOW:]]
        n, follow = prompt_lookup(context, room, spec.max_n, spec.min_n, window=len(context))
        if n:
            odds = self._lookup_odds.setdefault(n, LookupOdds.after_match(n))
            row.lookup, row.lookup_match = follow[: best_length(odds.rate, token_cost, len(follow), rows)], n

    def _settle_lookup(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """Verify the row's prompt lookup like any speculation: a one-hot q, the one routine."""
        state, proposed = row.state, row.lookup
        q = one_hot_rows(proposed, logits.shape[-1]) if state.sampling.needs_q else None
        outcome, _ = self._settle_speculation(row, proposed, q, logits, forward_s, looked_up=True)
        self._lookup_odds[row.lookup_match].record(len(proposed), outcome.k)

    @staticmethod
    def _emit(req: SequenceState, tokens: list[int], logits: torch.Tensor) -> None:
        """Admit the round's tokens; `logits` [len(tokens), V] are the target's
        rows that scored them (the source of their log-probabilities)."""
        processor, ended, bias = req.processor, False, None
        if processor is not None:
            tokens, ended = processor.admit(tokens, logits.shape[-1])  # nothing past a completed grammar
            if req.logprobs is not None and tokens:
                bias = processor.rows(tokens[:-1], logits.shape[-1])  # the laws the tokens came from
        admitted = req.output.add(tokens)
        if processor is not None:
            processor.commit(admitted)
            if ended:
                req.output.end("stop")
        req.sequence.extend(admitted)
        logprobs = None
        if req.logprobs is not None:
            logprobs = [
                TokenLogprob(token, value, tuple(top), rank)
                for token, (value, rank, top) in zip(admitted, token_logprobs(
                    logits, req.sampling, admitted, req.request.logprobs, bias))
            ]
            req.logprobs.extend(logprobs)
        req.request.emit(admitted, logprobs)

    # --- the loop -----------------------------------------------------------------

    def _needs(self, request: GenerationRequest) -> tuple[int, int]:
        """(KV bytes, the most tokens a round feeds the target) the request
        reserves; refuses a mode this engine does not run."""
        speculation = self._settings(request)
        k = speculation.round_ceiling if speculation is not None else 0
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
            self._leave(row)
        return left

    def _chunks(self, decoding: list[Row]) -> list[tuple[Row, list[int]]]:
        """Prompt chunks for this step, oldest rows first, within the budget the rounds leave.

        A chunk ends where the prompt's own tokens say (ssd.engine.prefix.chunk_end: after
        prefill_chunk tokens, or at an end-of-turn token) or at the prompt's end, and is
        never cut to fit: a prompt's chunks are the same whatever else a step runs, so are
        its keys and values where a backend computes a chunk as a whole (llama.cpp,
        ssd.models.llamacpp), and a cached prefix holds what a fresh prefill computes.
        A chunk that does not fit waits.
        """
        size = self.batching.prefill_chunk
        budget = self.batching.max_batched_tokens - sum(self._round_cost(r) for r in decoding)
        chunks = []
        for row in self._rows:
            if row.decoding or row.leader is not None:  # a follower waits for its leader's chunks
                continue
            prompt = row.request.prompt_ids
            end = chunk_end(prompt, row.prefilled, size, self._stops) or len(prompt)
            if end - row.prefilled > budget:
                break
            chunks.append((row, prompt[row.prefilled : end]))
            budget -= end - row.prefilled
        return chunks

    def _score(self, jobs: list[tuple[Row, list[int], bool]]) -> list[torch.Tensor]:
        """One packed target forward: the last position of prefill chunks (every position when the
        request asks for its prompt's log-probabilities), every scored position of rounds."""
        scored_prompt = [prefill and row.state.prompt_logprobs is not None for row, _, prefill in jobs]
        last_only = [prefill and not scored for (_, _, prefill), scored in zip(jobs, scored_prompt)]
        return forward_rows([row.target for row, _, _ in jobs], [ids for _, ids, _ in jobs], last_only, scored_prompt)

    def _prefilled(self, row: Row, fed: int, logits: torch.Tensor) -> None:
        """Count a prefill chunk; the chunk that completes the prompt samples the first token."""
        if row.state.prompt_logprobs is not None:
            self._score_prompt(row.state, row.prefilled, logits)
        row.prefilled += fed
        if row.decoding:
            self._emit(row.state, [self._next_token(row.state, logits[-1])], logits[-1:])
            row.state.stats.time_to_first_token_s = row.clock.elapsed()

    @staticmethod
    def _score_prompt(state: SequenceState, start: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens a chunk's rows predict (row i: token start + i + 1):
        the model's own law, log-softmax at temperature 1, unprocessed; PROMPT_ROWS rows at a time,
        so a chunk over a large vocabulary never holds its float64 log-softmax whole."""
        prompt, top_n = state.request.prompt_ids, state.request.prompt_logprobs
        for at in range(0, len(logits), PROMPT_ROWS):
            rows = logits[at : at + PROMPT_ROWS]
            scored = prompt[start + at + 1 : start + at + len(rows) + 1]  # the last chunk's last row: none
            entries = token_logprobs(rows, PLAIN_LAW, scored, top_n)
            state.prompt_logprobs += [TokenLogprob(t, value, tuple(top), rank)
                                      for t, (value, rank, top) in zip(scored, entries)]

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

    def _leave(self, row: Row) -> None:
        """The row leaves the batch; its caches wait for a later prompt (`_keep`) or go back
        (a llama.cpp slot is freed at once)."""
        self._rows.remove(row)
        if row.target is self._shared_target:
            self._shared_whole = 0
        if self._keep(row):
            return
        if row.target is not self._shared_target:
            release(row.target)
        release(row.draft)

    def _collect(self) -> list[Finished]:
        """Rows that finished or failed leave now; their caches go with them."""
        left = []
        for row in [r for r in self._rows if r.done]:
            if row.error is not None:
                left.append(Finished(row.request, None, row.error))
            else:
                left.append(Finished(row.request, self._result(row.state, row.clock)))
            self._leave(row)
        return left
