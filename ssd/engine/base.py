"""The generation loop shared by every engine: prefill, rounds, end conditions.

An engine only says how the first token is produced and what one round
appends; the loop, end conditions and metrics are written once here.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ssd.config import SamplingConfig, SpeculationConfig
from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.output import OutputTracker
from ssd.engine.request import GenerationRequest, GenerationResult, TokenCallback
from ssd.hardware import sync, to_device
from ssd.models.kv import KVSequence
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer, eos_token_ids
from ssd.sampling import make_generator, probs_from_logits, sample
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

Verifier = Callable[..., Outcome]

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "RequestHandling", "SequenceState", "TokenCallback", "Verifier"]


@dataclass
class SequenceState:
    """One generation's state while it runs."""

    request: GenerationRequest
    speculation: SpeculationConfig | None  # the settings this request runs with (None: AR)
    gen: torch.Generator
    sequence: list[int]  # prompt + generated ids so far
    output: OutputTracker
    stats: GenerationStats

    @property
    def sampling(self) -> SamplingConfig:
        return self.request.sampling


class RequestHandling:
    """What every engine does per request, alone (Engine) or batched
    (ssd.engine.batch): resolve its settings, build its state, emit admitted
    tokens, turn a round's target logits into a token or an outcome, and
    report the result. Written once so both paths behave the same."""

    mode: str = ""

    def _bind(
        self, target: torch.nn.Module, tokenizer: Tokenizer, verifier: Verifier,
        speculation: SpeculationConfig | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer, target)
        self.verifier = verifier  # replaceable so tests can prove their power
        self.precision = f"target {precision_of(target)}"  # named in every stats line
        self.speculation = speculation  # for requests that bring no settings of their own

    def _settings(self, request: GenerationRequest) -> SpeculationConfig | None:
        """The request's speculation settings (else the engine's); a mode this engine does not run is an error."""
        speculation = request.speculation or self.speculation
        if speculation is not None and speculation.mode != self.mode:
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
        )

    def _result(self, req: SequenceState, clock: Stopwatch) -> GenerationResult:
        req.stats.total_s = clock.elapsed()
        req.stats.new_tokens = len(req.output.token_ids)
        log.debug("%s", req.stats.summary())
        return GenerationResult(req.output.token_ids, req.output.text(), req.output.finish_reason, req.stats)

    @staticmethod
    def _next_token(req: SequenceState, logits: torch.Tensor) -> int:
        """Sample the token after `logits` [V] with the request's settings and generator."""
        return sample(probs_from_logits(logits, req.sampling), req.gen)

    def _judge(self, req: SequenceState, drafted: list[int], q: torch.Tensor | None, logits: torch.Tensor) -> Outcome:
        """Verify `drafted` against the target's logits [K+1, V] at the scored positions.

        p stays on the target's device; sampled q rows are moved there (over a
        host link they arrive in host memory).
        """
        p = probs_from_logits(logits, req.sampling)
        if not req.sampling.greedy:  # greedy verification never reads q
            if q is None:
                if drafted:
                    raise ValueError("a sampled speculation arrived without its q rows")
                q = p.new_zeros(0, p.shape[-1])
            q = to_device(q, p.device)
        outcome = self.verifier(drafted, q, p, req.gen, greedy=req.sampling.greedy)
        sync(p)  # the round's timer covers the device's work
        return outcome

    @staticmethod
    def _emit(req: SequenceState, tokens: list[int]) -> None:
        admitted = req.output.add(tokens)
        req.sequence.extend(admitted)
        req.request.emit(admitted)


class Engine(RequestHandling, ABC):
    """One request at a time: the generation loop over the engine's own caches."""

    def __init__(
        self, target: torch.nn.Module | KVSequence, tokenizer: Tokenizer, verifier: Verifier = verify,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        # A KVSequence subclass may stand in for the model: the tensor-parallel
        # leader mirrors every cache operation to its follower ranks.
        self.target = target if isinstance(target, KVSequence) else KVSequence(target)
        self._bind(self.target.model, tokenizer, verifier, speculation)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate until an end condition or until `request.cancelled()` says stop."""
        clock = Stopwatch()
        req = self._new_state(request)
        self._start(req)
        try:
            self._emit(req, [self._first_token(req)])
            req.stats.time_to_first_token_s = clock.elapsed()
            while not req.output.finished:
                if request.is_cancelled():
                    req.output.finish_reason = "aborted"
                    break
                self._emit(req, self._round(req))
        finally:
            self._finish(req)
        return self._result(req, clock)

    def close(self) -> None:
        """Stop whatever the engine runs besides the caller's thread (nothing here)."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, req: SequenceState) -> None:
        """Reset per-sequence state before the prompt is processed."""
        self.target.reset()

    def _first_token(self, req: SequenceState) -> int:
        """Prefill the target with the prompt and sample the first token."""
        return self._next_token(req, self.target.forward(req.sequence, last_only=True)[-1])

    @abstractmethod
    def _round(self, req: SequenceState) -> list[int]:
        """Run one round; return the tokens it appends (at least one)."""

    def _finish(self, req: SequenceState) -> None:
        """Release per-sequence resources; runs even when generation fails."""

    def _target_step(self, req: SequenceState) -> list[int]:
        """One plain decoding step on the target alone (AR, and SSD without its draft)."""
        started = time.perf_counter()
        logits = self.target.catch_up(req.sequence)
        token = self._next_token(req, logits)
        sync(logits)  # the timer covers the device's work
        req.stats.record_round(drafted=0, accepted=0, target_s=time.perf_counter() - started)
        return [token]

    def _verify(self, req: SequenceState, drafted: list[int], q: torch.Tensor | None) -> Outcome:
        """Score `drafted` with the target in one forward and verify it (SD and SSD).

        Leaves the target cache holding the sequence plus the accepted tokens.
        """
        started = time.perf_counter()
        k = len(drafted)
        scored = req.sequence + drafted
        logits = self.target.forward(scored[self.target.length :])[-(k + 1) :]
        outcome = self._judge(req, drafted, q, logits)
        self.target.rollback(len(req.sequence) + outcome.k)
        req.stats.record_round(drafted=k, accepted=outcome.k, target_s=time.perf_counter() - started)
        return outcome
