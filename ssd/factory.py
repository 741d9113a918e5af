"""From a Config to a ready engine: load the models the mode needs, once, and
make the one engine of each mode (`make_engine`) for every caller: the server,
the cluster's target rank 0, the bench and launch/generate.py."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ssd.config import BatchingConfig, Config, SpeculationConfig
from ssd.engine.ar import AREngine
from ssd.engine.batch import BatchedEngine
from ssd.engine.rows import Verifier
from ssd.engine.sd import SDEngine
from ssd.models import load_model, load_tokenizer
from ssd.models.backend import Model, precision_of
from ssd.models.vocab import apply_draft_vocab, model_eos_ids
from ssd.saguaro.target import SSDEngine
from ssd.verify import verify

log = logging.getLogger(__name__)


@dataclass
class LoadedPair:
    """The models an engine runs; engines made from one pair share its weights, not caches.

    target: the model (on a tensor-parallel target its leader, ssd.models.tp.TPLeader,
    whose sequences the other ranks mirror).
    draft: None where it is not loaded here (AR only, or SSD with the draft
    on another device: the cluster attaches its link).
    """

    target: Model
    draft: torch.nn.Module | None
    tokenizer: Any


def make_engine(
    mode: str,
    pair: LoadedPair,
    speculation: SpeculationConfig,
    batching: BatchingConfig | None = None,
    *,
    verifier: Verifier = verify,
    draft_timeout_s: float | None = None,
) -> BatchedEngine:
    """The engine for `mode` over `pair`: a batch of any size, one row included.

    `speculation`: the defaults for requests that bring no settings (any
    mode's: its mode is set to `mode` here). SSD with a draft in the pair
    runs its speculator on a thread of this process (the engine's close()
    stops it); without one the draft lives elsewhere, and its link is
    `attach`ed when it comes (the cluster), naming the draft's precision.
    """
    speculation = dataclasses.replace(speculation, mode=mode)
    if mode == "ar":
        return AREngine(pair.target, pair.tokenizer, batching)
    if mode == "sd":
        if pair.draft is None:
            raise ValueError("mode 'sd' needs a draft model; none was loaded")
        return SDEngine(pair.target, pair.draft, pair.tokenizer, speculation, batching, verifier)
    if mode != "ssd":
        raise ValueError(f"unknown mode {mode!r}")
    if pair.draft is not None:
        return SSDEngine.in_process(pair.target, pair.draft, pair.tokenizer, speculation, batching, verifier)
    return SSDEngine(
        pair.target, pair.tokenizer, speculation, batching, verifier,
        draft_timeout_s=draft_timeout_s,
    )


def load_pair(config: Config, with_draft: bool = True) -> LoadedPair:
    """Load the tokenizer, the target and (optionally) the draft."""
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    tokenizer = load_tokenizer(config.target)
    target = _timed_load("target", config)
    draft = draft_with_vocab(_timed_load("draft", config), config) if with_draft else None
    return LoadedPair(target, draft, tokenizer)


def build_engine(config: Config) -> BatchedEngine:
    """The engine for the configured mode, loading only the models it needs."""
    from ssd.saguaro.startup import plan_for_pair  # SSD's start-up plan, where the config asks for one

    mode = config.speculation.mode
    pair = load_pair(config, with_draft=mode != "ar")
    config = plan_for_pair(config, pair)
    return make_engine(mode, pair, config.speculation, config.batching)


def _timed_load(role: str, config: Config) -> torch.nn.Module:
    model_config = getattr(config, role)
    started = time.perf_counter()
    model = load_model(model_config)
    log.info("loaded %s %s (%s) in %.1f s", role, model_config.name, precision_of(model), time.perf_counter() - started)
    return model


def draft_with_vocab(draft: Any, config: Config) -> Any:
    """The draft with its head over `speculation.draft_vocab`'s subset (ssd.models.vocab)."""
    return apply_draft_vocab(draft, config.speculation.draft_vocab, model_eos_ids(draft))
