"""One request in the batch, and what happens to it alone: its state, the token it samples, the
speculation it verifies, the tokens it admits and the result it leaves with.

The engine loop (ssd.engine.batch) schedules rows and runs their packed forward; everything
after that forward is one row's own business and lives here, as nano-vllm's postprocess does:
sampling with the row's generator, the one verification routine, stop conditions, logprobs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ssd.config import SamplingConfig, SpeculationConfig
from ssd.engine.drafting import Chain
from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.output import OutputTracker
from ssd.engine.processing import LogitsProcessor
from ssd.engine.request import GenerationRequest, GenerationResult, Processing, TokenLogprob
from ssd.hardware import sync, to_device
from ssd.models.backend import AnySequence
from ssd.models.tokenizer import Tokenizer
from ssd.sampling import draws_at, greedy_token, make_generator, probs_from_logits, sample, token_logprobs
from ssd.verify import Outcome

log = logging.getLogger(__name__)

PLAIN_LAW = SamplingConfig()  # token_logprobs at temperature 0 read the plain log-softmax: a prompt's law
PROMPT_ROWS = 32  # prompt positions scored at a time: 32 x 152k float64 is 39 MB

Verifier = Callable[..., Outcome]


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
    lookup: list[int] = dataclasses.field(default_factory=list)  # this round's prompt lookup (ssd.engine.proposers)
    lookup_match: int = 0  # how many of the text's last tokens it matched
    link: Any = None  # SSD: the row's sequence on the draft link (ssd.saguaro.target.RowLink)
    error: Exception | None = None
    # a running row whose prompt chunks this one copies once it has prefilled them
    # (ssd.engine.kv_manager): `shares` positions of it; meanwhile this row's prefill waits
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


def new_state(request: GenerationRequest, speculation: SpeculationConfig | None, mode: str, tokenizer: Tokenizer,
              eos_ids: frozenset[int] | set[int], precision: str) -> SequenceState:
    """A request's state before its prompt is processed: its own seeded generator, end conditions and stats."""
    return SequenceState(
        request=request,
        speculation=speculation,
        gen=make_generator(request.sampling.seed),
        sequence=list(request.prompt_ids),
        output=OutputTracker(tokenizer, request.generation, eos_ids),
        stats=GenerationStats(mode=mode, k=speculation.k if speculation is not None else 0,
                              prompt_tokens=len(request.prompt_ids), precision=precision),
        logprobs=[] if request.logprobs is not None else None,
        prompt_logprobs=[] if request.prompt_logprobs is not None else None,
        processor=_processor(request, tokenizer, eos_ids),
    )


def _processor(request: GenerationRequest, tokenizer: Tokenizer, eos_ids: Sequence[int]) -> LogitsProcessor | None:
    """The request's logits processing state, or None when it asks for none."""
    spec = request.processing or Processing()
    generation = request.generation
    held = set(generation.stop_token_ids) | (set() if generation.ignore_eos else set(eos_ids))
    if not spec.active and not (generation.min_tokens and held):
        return None
    return LogitsProcessor(spec, tokenizer, sorted(eos_ids), request.prompt_ids, generation.min_tokens, sorted(held))


def next_token(state: SequenceState, logits: torch.Tensor) -> int:
    """Sample the token after `logits` [V] with the request's settings, processing and
    generator (coupled: its noise at the token's position, len(sequence))."""
    bias = state.processor.bias(logits.shape[-1]) if state.processor is not None else None
    if state.sampling.greedy:  # the one-hot row's draw cannot change the token: skip the row and the draw
        return greedy_token(logits, bias)
    draws = draws_at(state.sampling, state.gen, [len(state.sequence)])
    return sample(probs_from_logits(logits, state.sampling, bias), draws)


def judge(state: SequenceState, drafted: list[int], q: torch.Tensor | None, logits: torch.Tensor,
          verifier: Verifier) -> Outcome:
    """Verify `drafted` against the target's logits [K+1, V] at the scored positions.

    p stays on the target's device; sampled q rows are moved there (over a host link they
    arrive in host memory). With logits processing, row i of p is the processed law after
    drafted[:i] (ssd.engine.processing): the law verified against. Coupled requests verify
    with their noise at the K + 1 positions p scores, from len(sequence) on.
    """
    bias = state.processor.rows(drafted, logits.shape[-1]) if state.processor is not None else None
    p = probs_from_logits(logits, state.sampling, bias)
    if state.sampling.needs_q:  # greedy and coupled verification never read q
        if q is None:
            if drafted:
                raise ValueError("a sampled speculation arrived without its q rows")
            q = p.new_zeros(0, p.shape[-1])
        q = to_device(q, p.device)
    start = len(state.sequence)
    draws = draws_at(state.sampling, state.gen, range(start, start + len(drafted) + 1))
    outcome = verifier(drafted, q, p, draws, greedy=state.sampling.greedy)
    sync(p)  # the round's timer covers the device's work
    return outcome


def emit(state: SequenceState, tokens: list[int], logits: torch.Tensor) -> None:
    """Admit the round's tokens; `logits` [len(tokens), V] are the target's rows that scored
    them (the source of their log-probabilities)."""
    processor, ended, bias = state.processor, False, None
    if processor is not None:
        tokens, ended = processor.admit(tokens, logits.shape[-1])  # nothing past a completed grammar
        if state.logprobs is not None and tokens:
            bias = processor.rows(tokens[:-1], logits.shape[-1])  # the laws the tokens came from
    admitted = state.output.add(tokens)
    if processor is not None:
        processor.commit(admitted)
        if ended:
            state.output.end("stop")
    state.sequence.extend(admitted)
    logprobs = None
    if state.logprobs is not None:
        logprobs = [TokenLogprob(token, value, tuple(top), rank) for token, (value, rank, top) in zip(
            admitted, token_logprobs(logits, state.sampling, admitted, state.request.logprobs, bias))]
        state.logprobs.extend(logprobs)
    state.request.emit(admitted, logprobs)


def score_prompt(state: SequenceState, start: int, logits: torch.Tensor) -> None:
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


def result(state: SequenceState, clock: Stopwatch) -> GenerationResult:
    """What a row leaves with: its tokens, text, finish reason, stats and logprobs."""
    state.stats.total_s = clock.elapsed()
    state.stats.new_tokens = len(state.output.token_ids)
    log.debug("%s", state.stats.summary())
    return GenerationResult(state.output.token_ids, state.output.text(), state.output.finish_reason, state.stats,
                            logprobs=list(state.logprobs) if state.logprobs is not None else None,
                            prompt_logprobs=state.prompt_logprobs)
