"""Continuous batching: many requests advance together, one round at a time.

A `BatchEngine` holds up to `max_rows` running requests (rows). Requests join
between rounds (`admit`) and leave the moment they finish, are cancelled or
fail, without disturbing the other rows: every row keeps its own KV cache,
seeded generator, stop strings, EOS and max tokens. One `step` runs one round
for every row: AR decodes one token per row; SD drafts K per row and the
target verifies every row's speculation in one batched forward, then each row
accepts, rolls back and samples on its own with the one verification routine.

The serving worker drives it:

    while rows or queue:
        while queue and engine.can_admit(queue[0].request):
            engine.admit(queue.popleft().request)   # prefill chunks run inside step()
        for finished in engine.step():
            hand finished.result to finished.request's stream

A batch of one is `generate(request)`: the Generator interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ssd.engine.request import GenerationRequest, GenerationResult


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
