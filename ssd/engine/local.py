"""SSD in one process: the speculator serves from a thread over the in-process
channel. The whole protocol runs and is tested without Ray or
torch.distributed; the engine code is the same one the cluster runs."""

from __future__ import annotations

import logging
import threading

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.base import Verifier
from ssd.engine.batch import BatchEngine, Finished
from ssd.engine.batch_ssd import BatchedSSDEngine
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.engine.ssd import SSDEngine
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.saguaro import protocol
from ssd.saguaro.speculator import Speculator
from ssd.transport import inprocess_pair
from ssd.transport.channel import Channel
from ssd.verify import verify

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # a speculator mid-build finishes it before it reads the shutdown


class SpeculatorThread:
    """A speculator serving `draft` from a daemon thread; `channel` is the target's end."""

    def __init__(self, draft: torch.nn.Module) -> None:
        self.channel, draft_end = inprocess_pair()
        self.speculator = Speculator(draft, draft_end)
        self.thread = threading.Thread(target=self.speculator.serve, name="ssd-speculator", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Shut the speculator down (through our own end: the engine may have dropped its link)."""
        if self.thread.is_alive():
            self.channel.send(protocol.shutdown())
            self.thread.join(JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                log.warning("the speculator thread did not stop within %.0f s", JOIN_TIMEOUT_S)


class LocalSSD:
    mode = "ssd"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig,
        verifier: Verifier = verify,
    ) -> None:
        self._serving = SpeculatorThread(draft)
        self.speculator = self._serving.speculator
        self.engine = SSDEngine(
            target, tokenizer, self._serving.channel, speculation, verifier, draft_precision=precision_of(draft)
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.engine.generate(request)

    def close(self) -> None:
        self._serving.stop()

    def __enter__(self) -> "LocalSSD":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalBatchedSSD(BatchEngine):
    """Batched SSD with its speculator in a thread of this process; close() stops the thread.

    A BatchEngine that forwards to `engine` (a BatchedSSDEngine), so the
    serving worker drives it like the AR and SD batch engines.
    """

    mode = "ssd"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        draft_timeout_s: float | None = None,
    ) -> None:
        self._serving = SpeculatorThread(draft)
        self.speculator = self._serving.speculator
        self.engine = BatchedSSDEngine(
            target, tokenizer, self._serving.channel, speculation, batching, verifier,
            draft_timeout_s, draft_precision=precision_of(draft),
        )

    @property
    def channel(self) -> Channel:
        """The target's end of the in-process link."""
        return self._serving.channel

    @property
    def rows(self) -> int:
        return self.engine.rows

    def can_admit(self, request: GenerationRequest) -> bool:
        return self.engine.can_admit(request)

    def admit(self, request: GenerationRequest) -> None:
        self.engine.admit(request)

    def step(self) -> list[Finished]:
        return self.engine.step()

    def close(self) -> None:
        self._serving.stop()

    def __enter__(self) -> "LocalBatchedSSD":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
