"""What the server generates with: a small Backend protocol and the local one.

The servicer sees only this protocol, so the tests can wrap the real backend
(slow it down, make it fail) and the cluster backend (cluster_backend.py) slots in.
A backend may also offer `batch_engine(mode)` (ssd.serve.worker.BatchingBackend):
the worker then runs that mode's requests together (continuous batching).
The local backend's engines, for the worker and for `generate`, all come from
ssd.factory.make_engine.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from ssd.config import MODES, Config
from ssd.engine.batch import Engine
from ssd.factory import LoadedPair, load_pair, make_engine
from ssd.engine.request import GenerationRequest, GenerationResult, Generator
from ssd.models.tokenizer import chat_ids, eos_token_ids, has_chat_template
from ssd.saguaro.startup import plan_for_pair

log = logging.getLogger(__name__)

class UnsupportedRequest(ValueError):
    """The backend cannot do what was asked (e.g. chat without a template)."""


@dataclass(frozen=True)
class BackendInfo:
    target_model: str
    draft_model: str | None  # None: only "ar" is served
    vocab_size: int  # valid prompt ids are 0..vocab_size-1
    max_context_tokens: int  # prompt + generated tokens
    modes: tuple[str, ...]
    chat_template: bool
    eos_token_ids: tuple[int, ...]
    defaults: Config  # sampling, generation.max_new_tokens and speculation defaults


class Backend(Generator, Protocol):
    """A Generator that also tokenizes and describes itself to clients."""

    info: BackendInfo

    def encode(self, text: str) -> list[int]: ...

    def apply_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def close(self) -> None: ...


class EngineByMode:
    """One engine per mode (make_engine), made on first use; the request carries every other setting.

    Engines share the loaded weights; each holds its own KV caches and (SSD) a
    speculator thread. Not thread-safe: the server runs one generation at a time.
    """

    def __init__(self, pair: LoadedPair, defaults: Config) -> None:
        self.pair = pair
        self.defaults = defaults
        self._engines: dict[str, Engine] = {}

    def get(self, mode: str) -> Engine:
        if mode not in self._engines:
            self._engines[mode] = make_engine(mode, self.pair, self.defaults.speculation, self.defaults.batching)
        return self._engines[mode]

    def discard(self, mode: str) -> None:
        """Drop an engine whose generation failed: its state is not to be trusted."""
        engine = self._engines.pop(mode, None)
        if engine is not None:
            _close_quietly(engine)

    def close(self) -> None:
        while self._engines:
            _close_quietly(self._engines.popitem()[1])


class TokenizerMixin:
    """Prompt handling shared by the backends: `self.tokenizer` and `self.info` set."""

    tokenizer: Any
    info: BackendInfo

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.info.chat_template:
            raise UnsupportedRequest(f"model {self.info.target_model!r} has no chat template")
        return chat_ids(self.tokenizer, messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class LocalBackend(TokenizerMixin):
    """The target (and draft) in this process; SSD's speculator runs in a thread."""

    def __init__(self, config: Config, with_draft: bool = True, pair: LoadedPair | None = None) -> None:
        """pair: models already loaded (the serving bench starts several servers over one pair)."""
        self.pair = pair if pair is not None else load_pair(config, with_draft=with_draft)
        self.config = plan_for_pair(config, self.pair)  # SSD's start-up plan, where the config asks for one
        self.tokenizer = self.pair.tokenizer
        self._engines = EngineByMode(self.pair, self.config)
        self._lock = threading.Lock()  # the worker serializes; this guards misuse
        self.info = self._describe()

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request alone, a batch of one on its mode's engine."""
        mode = request.settings(self.config.speculation).mode
        with self._lock:
            engine = self._engines.get(mode)
            try:
                return engine.generate(request)
            except BaseException:
                self._engines.discard(mode)
                raise

    def batch_engine(self, mode: str) -> Engine:
        """A new engine for `mode` over the loaded weights, with the config's limits
        (batching.max_rows 1: one row at a time); the caller owns and closes it.
        A mode the pair cannot run (no draft loaded) raises ValueError."""
        return make_engine(mode, self.pair, self.config.speculation, self.config.batching)

    def close(self) -> None:
        with self._lock:
            self._engines.close()

    def _describe(self) -> BackendInfo:
        tokenizer, target = self.pair.tokenizer, self.pair.target
        has_draft = self.pair.draft is not None
        return backend_info(
            self.config, tokenizer, modes=MODES if has_draft else ("ar",),
            max_context_tokens=_max_positions(target, tokenizer),
            eos_token_ids=eos_token_ids(tokenizer, target),
        )


def backend_info(
    config: Config, tokenizer: Any, modes: tuple[str, ...], max_context_tokens: int, eos_token_ids: Iterable[int],
) -> BackendInfo:
    """What a backend tells clients; a draft is named only when some mode uses it."""
    return BackendInfo(
        target_model=config.target.name,
        draft_model=config.draft.name if modes != ("ar",) else None,
        vocab_size=len(tokenizer),
        max_context_tokens=max_context_tokens,
        modes=modes,
        chat_template=has_chat_template(tokenizer),
        eos_token_ids=tuple(sorted(eos_token_ids)),
        defaults=config,
    )


def _max_positions(model: Any, tokenizer: Any) -> int:
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return positions
    # HF tokenizers report a huge sentinel when they know no limit.
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else 4096


def _close_quietly(engine: Any) -> None:
    try:
        engine.close()
    except Exception:  # closing a broken engine must not hide the original error
        log.exception("closing an engine failed")
