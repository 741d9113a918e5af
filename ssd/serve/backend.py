"""What the server generates with: a small Backend protocol and the local one.

The servicer sees only this protocol, so the tests can wrap the real backend
(slow it down, make it fail) and the cluster backend (cluster_backend.py) slots in.
A backend gives a batch engine per mode (`batch_engine(mode)`); the worker
(ssd.serve.worker) runs every request on one, one row included. The local
backend's engines come from ssd.factory.make_engine, the one per-mode map.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from ssd.config import MODES, Config
from ssd.engine.batch import Engine
from ssd.factory import LoadedPair, load_pair, make_engine
from ssd.models.backend import max_positions
from ssd.models.tokenizer import (RESERVED_TEMPLATE_KWARGS, chat_ids, eos_token_ids, fim_ids, has_chat_template,
                                  has_think_tokens, template_variables)
from ssd.saguaro.startup import plan_for_pair
from ssd.serve.request import ChatOptions

log = logging.getLogger(__name__)

class UnsupportedRequest(ValueError):
    """The backend cannot do what was asked (e.g. chat without a template); `field`: the request
    field at fault, where one is (validation's name for it)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


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
    fim_ids: tuple[int, int, int] | None = None  # fill-in-the-middle tokens (prefix, suffix, middle)
    think_tokens: bool = False  # a reasoning model's <think> and </think> are tokens


class Backend(Protocol):
    """Batch engines per mode, and the tokenizer; it describes itself to clients."""

    info: BackendInfo

    def batch_engine(self, mode: str) -> Engine:
        """A new engine for `mode`, owned (and closed) by the caller (ssd.serve.worker)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   options: ChatOptions | None = None) -> list[int]:
        """The conversation in the chat template (with `tools` when given), by default ready for the
        assistant; `options` (given only when a request sets them) lay it out otherwise."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def close(self) -> None: ...


class TokenizerMixin:
    """Prompt handling shared by the backends: `self.tokenizer` and `self.info` set."""

    tokenizer: Any
    info: BackendInfo

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   options: ChatOptions | None = None) -> list[int]:
        if not self.info.chat_template:
            raise UnsupportedRequest(f"model {self.info.target_model!r} has no chat template")
        options = options or ChatOptions()
        self._check_template_kwargs(options.template_kwargs or {})
        return chat_ids(self.tokenizer, messages, tools, add_generation_prompt=options.add_generation_prompt,
                        continue_final_message=options.continue_final_message,
                        template_kwargs=options.template_kwargs)

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Each kwarg is a variable the template reads and not one apply_chat_template sets itself:
        one the template would never read is refused, not ignored."""
        readable = template_variables(self.tokenizer)
        for name in kwargs:
            field = f"chat.template_kwargs.{name}"
            if name in RESERVED_TEMPLATE_KWARGS:
                raise UnsupportedRequest("set by the server (or by its own request field), not a template kwarg", field)
            if readable is not None and name not in readable:
                known = ", ".join(sorted(readable - RESERVED_TEMPLATE_KWARGS)) or "none"
                raise UnsupportedRequest(f"the model's chat template does not read it (it reads: {known})", field)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class LocalBackend(TokenizerMixin):
    """The target (and draft) in this process; SSD's speculator runs in a thread."""

    def __init__(self, config: Config, with_draft: bool = True, pair: LoadedPair | None = None) -> None:
        """pair: models already loaded (the serving bench starts several servers over one pair)."""
        self.pair = pair if pair is not None else load_pair(config, with_draft=with_draft)
        self.config = plan_for_pair(config, self.pair)  # SSD's start-up plan, where the config asks for one
        self.tokenizer = self.pair.tokenizer
        self.info = self._describe()

    def batch_engine(self, mode: str) -> Engine:
        """A new engine for `mode` over the loaded weights, with the config's limits
        (batching.max_rows 1: one row at a time); the caller owns and closes it.
        A mode the pair cannot run (no draft loaded) raises ValueError."""
        return make_engine(mode, self.pair, self.config.speculation, self.config.batching)

    def close(self) -> None:
        """The engines belong to the worker that made them; the weights go with this object."""

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
        fim_ids=fim_ids(tokenizer),
        think_tokens=has_think_tokens(tokenizer),
    )


def _max_positions(model: Any, tokenizer: Any) -> int:
    positions = max_positions(model)
    if positions is not None:
        return positions
    # HF tokenizers report a huge sentinel when they know no limit.
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else 4096

