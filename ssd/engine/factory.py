"""From a Config to a ready engine: load the models the mode needs, once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ssd.config import Config
from ssd.engine.ar import AREngine
from ssd.engine.base import Engine
from ssd.engine.sd import SDEngine
from ssd.models import load_model, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: Any

    def engine(self, mode: str, k: int) -> Engine:
        """An engine over these models (engines share the weights, not caches)."""
        if mode == "ar":
            return AREngine(self.target, self.tokenizer)
        if self.draft is None:
            raise ValueError(f"mode {mode!r} needs a draft model; none was loaded")
        return SDEngine(self.target, self.draft, self.tokenizer, k)


def load_pair(config: Config, with_draft: bool = True) -> LoadedPair:
    """Load the tokenizer, the target and (optionally) the draft."""
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    tokenizer = load_tokenizer(config.target)
    target = _timed_load("target", config)
    draft = _timed_load("draft", config) if with_draft else None
    return LoadedPair(target, draft, tokenizer)


def build_engine(config: Config) -> Engine:
    """The engine for the configured mode, loading only the models it needs."""
    mode = config.speculation.mode
    return load_pair(config, with_draft=mode != "ar").engine(mode, config.speculation.k)


def _timed_load(role: str, config: Config) -> torch.nn.Module:
    model_config = getattr(config, role)
    started = time.perf_counter()
    model = load_model(model_config)
    log.info(
        "loaded %s %s (%s%s) in %.1f s", role, model_config.name, model_config.dtype,
        f", {model_config.quantization}" if model_config.quantization else "",
        time.perf_counter() - started,
    )
    return model


def encode_prompt(tokenizer: Any, text: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; with chat=True wrapped in the model's chat template."""
    if chat:
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)
