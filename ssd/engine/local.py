"""SSD in one process: the speculator serves from a thread over the in-process
channel. The whole protocol runs and is tested without Ray or
torch.distributed; the engine code is the same one the cluster runs."""

from __future__ import annotations

import threading

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Verifier
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.engine.ssd import SSDEngine
from ssd.models.quant import precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.speculation import protocol
from ssd.speculation.speculator import Speculator
from ssd.transport import inprocess_pair
from ssd.verify import verify


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
        target_end, draft_end = inprocess_pair()
        self.speculator = Speculator(draft, draft_end)
        self._thread = threading.Thread(target=self.speculator.serve, name="ssd-speculator", daemon=True)
        self._thread.start()
        self.engine = SSDEngine(target, tokenizer, target_end, speculation, verifier, draft_precision=precision_of(draft))
        self._channel = target_end

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.engine.generate(request)

    def close(self) -> None:
        if self._thread.is_alive():
            self._channel.send(protocol.shutdown())
            self._thread.join()

    def __enter__(self) -> "LocalSSD":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
