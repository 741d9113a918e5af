"""The generation loop shared by every engine: prefill, rounds, end conditions.

An engine only says how the first token is produced and what one round
appends; the loop, end conditions and metrics are written once here.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ssd.config import GenerationConfig, SamplingConfig
from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.output import OutputTracker
from ssd.models.tokenizer import Tokenizer, eos_token_ids
from ssd.models.kv import KVSequence
from ssd.models.quant import precision_of
from ssd.sampling import make_generator, probs_from_logits, sample
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

# Called with the tokens each round admits, as soon as they are known.
TokenCallback = Callable[[list[int]], None]
Verifier = Callable[..., Outcome]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "aborted"
    stats: GenerationStats


@dataclass
class Request:
    """One generation's state while it runs."""

    sampling: SamplingConfig
    gen: torch.Generator
    sequence: list[int]  # prompt + generated ids so far
    output: OutputTracker
    stats: GenerationStats


class Engine(ABC):
    mode: str = ""

    def __init__(
        self, target: torch.nn.Module | KVSequence, tokenizer: Tokenizer, verifier: Verifier = verify
    ) -> None:
        # A KVSequence subclass may stand in for the model: the tensor-parallel
        # leader mirrors every cache operation to its follower ranks.
        self.target = target if isinstance(target, KVSequence) else KVSequence(target)
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer, self.target.model)
        self.verifier = verifier  # replaceable so tests can prove their power
        self.precision = f"target {precision_of(self.target.model)}"  # named in every stats line

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        generation: GenerationConfig,
        on_tokens: TokenCallback | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Generate until an end condition; `cancelled` is polled before every
        round, and a True ends generation with finish reason "aborted"."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        clock = Stopwatch()
        req = Request(
            sampling=sampling,
            gen=make_generator(sampling.seed),
            sequence=list(prompt_ids),
            output=OutputTracker(self.tokenizer, generation, self.eos_ids),
            stats=GenerationStats(
                mode=self.mode, k=self.k, prompt_tokens=len(prompt_ids), precision=self.precision
            ),
        )
        self._start(req)
        try:
            self._emit(req, [self._first_token(req)], on_tokens)
            req.stats.time_to_first_token_s = clock.elapsed()
            while not req.output.finished:
                if cancelled is not None and cancelled():
                    req.output.finish_reason = "aborted"
                    break
                self._emit(req, self._round(req), on_tokens)
        finally:
            self._finish(req)
        req.stats.total_s = clock.elapsed()
        req.stats.new_tokens = len(req.output.token_ids)
        log.debug("%s", req.stats.summary())
        return GenerationResult(
            req.output.token_ids, req.output.text(), req.output.finish_reason, req.stats
        )

    @property
    def k(self) -> int:
        return 0

    def close(self) -> None:
        """Stop whatever the engine runs besides the caller's thread (nothing here)."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, req: Request) -> None:
        """Reset per-sequence state before the prompt is processed."""
        self.target.reset()

    def _first_token(self, req: Request) -> int:
        """Prefill the target with the prompt and sample the first token."""
        logits = self.target.forward(req.sequence, last_only=True)[-1]
        return sample(probs_from_logits(logits, req.sampling), req.gen)

    @abstractmethod
    def _round(self, req: Request) -> list[int]:
        """Run one round; return the tokens it appends (at least one)."""

    def _finish(self, req: Request) -> None:
        """Release per-sequence resources; runs even when generation fails."""

    def _target_step(self, req: Request) -> list[int]:
        """One plain decoding step on the target alone (AR, and SSD without its draft)."""
        started = time.perf_counter()
        logits = self.target.catch_up(req.sequence)
        token = sample(probs_from_logits(logits, req.sampling), req.gen)
        req.stats.record_round(drafted=0, accepted=0, target_s=time.perf_counter() - started)
        return [token]

    def _verify(self, req: Request, drafted: list[int], q: torch.Tensor | None) -> Outcome:
        """Score `drafted` with the target in one forward and verify it (SD and SSD).

        Leaves the target cache holding the sequence plus the accepted tokens.
        """
        started = time.perf_counter()
        k = len(drafted)
        scored = req.sequence + drafted
        logits = self.target.forward(scored[self.target.length :])[-(k + 1) :]
        p = probs_from_logits(logits, req.sampling)
        if q is None and not req.sampling.greedy:
            if k:
                raise ValueError("a sampled speculation arrived without its q rows")
            q = p.new_zeros(0, p.shape[-1])
        outcome = self.verifier(drafted, q, p, req.gen, greedy=req.sampling.greedy)
        self.target.rollback(len(req.sequence) + outcome.k)
        req.stats.record_round(drafted=k, accepted=outcome.k, target_s=time.perf_counter() - started)
        return outcome

    @staticmethod
    def _emit(req: Request, tokens: list[int], on_tokens: TokenCallback | None) -> None:
        admitted = req.output.add(tokens)
        req.sequence.extend(admitted)
        if on_tokens and admitted:
            on_tokens(admitted)
