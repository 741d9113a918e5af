"""From a Config to a ready engine: load the models the mode needs, once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ssd.config import BatchingConfig, Config, SpeculationConfig
from ssd.engine.ar import AREngine
from ssd.engine.base import Engine
from ssd.engine.batch import BatchedAREngine, BatchedSDEngine, BatchEngine
from ssd.engine.local import LocalBatchedSSD, LocalSSD
from ssd.engine.sd import SDEngine
from ssd.models import load_model, load_tokenizer
from ssd.models.quant import precision_of

log = logging.getLogger(__name__)


@dataclass
class LoadedPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: Any

    def engine(self, speculation: SpeculationConfig) -> Engine | LocalSSD:
        """An engine for speculation.mode over these models (engines share weights,
        not caches); `speculation` is its default for requests that bring none.

        SSD runs in-process here: the speculator serves from a thread.
        """
        if speculation.mode == "ar":
            return AREngine(self.target, self.tokenizer)
        if self.draft is None:
            raise ValueError(f"mode {speculation.mode!r} needs a draft model; none was loaded")
        if speculation.mode == "sd":
            return SDEngine(self.target, self.draft, self.tokenizer, speculation.k)
        return LocalSSD(self.target, self.draft, self.tokenizer, speculation)

    def batch_engine(self, speculation: SpeculationConfig, batching: BatchingConfig | None = None) -> BatchEngine:
        """A continuous-batching engine for speculation.mode over these models;
        `speculation` is its default for requests that bring none.

        SSD runs in-process here: the speculator serves the batch from a
        thread, which the engine's close() stops.
        """
        if speculation.mode == "ar":
            return BatchedAREngine(self.target, self.tokenizer, batching)
        if self.draft is None:
            raise ValueError(f"mode {speculation.mode!r} needs a draft model; none was loaded")
        if speculation.mode == "sd":
            return BatchedSDEngine(self.target, self.draft, self.tokenizer, speculation, batching)
        return LocalBatchedSSD(self.target, self.draft, self.tokenizer, speculation, batching)


def load_pair(config: Config, with_draft: bool = True) -> LoadedPair:
    """Load the tokenizer, the target and (optionally) the draft."""
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    tokenizer = load_tokenizer(config.target)
    target = _timed_load("target", config)
    draft = _timed_load("draft", config) if with_draft else None
    return LoadedPair(target, draft, tokenizer)


def build_engine(config: Config) -> Engine | LocalSSD:
    """The engine for the configured mode, loading only the models it needs."""
    return load_pair(config, with_draft=config.speculation.mode != "ar").engine(config.speculation)


def _timed_load(role: str, config: Config) -> torch.nn.Module:
    model_config = getattr(config, role)
    started = time.perf_counter()
    model = load_model(model_config)
    log.info("loaded %s %s (%s) in %.1f s", role, model_config.name, precision_of(model), time.perf_counter() - started)
    return model
