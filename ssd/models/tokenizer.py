"""Tokenizers and prompt encoding: the tiny one-character tokenizer for
tests, the HF tokenizer stored with a model, chat templates and EOS ids."""

from __future__ import annotations

import functools
import logging
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, Sequence

from ssd.config import ModelConfig, TinyModelConfig
from ssd.models.loading import TINY, has_gguf, load_resolved
from ssd.models.offline import OFFLINE_MODELS, ensure_offline_tokenizer

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    eos_token_id: int | None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


# '"' last: a vocabulary of 85 tokens spells JSON strings (the structured-output and
# tool-call tests); smaller vocabularies keep their characters.
_BASE_ALPHABET = (
    string.ascii_lowercase + string.digits + string.ascii_uppercase + " \n.,:;!?()[]{}<>=+-*/_\""
)
_EXTRA_START = 0x4E00  # CJK ideographs: printable single characters for larger vocabularies


def tiny_alphabet(vocab_size: int) -> str:
    """Character i is the text of token id i."""
    extra = max(0, vocab_size - len(_BASE_ALPHABET))
    return (_BASE_ALPHABET + "".join(chr(_EXTRA_START + i) for i in range(extra)))[:vocab_size]


class TinyTokenizer:
    """One character per token id, for tiny models; a subset of the HF tokenizer interface.

    Engine code may call `encode`, `decode`, `len()` and read `vocab_size` /
    `eos_token_id` on either kind of tokenizer.
    """

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} outside vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._chars = tiny_alphabet(vocab_size)
        self._ids = {ch: i for i, ch in enumerate(self._chars)}

    @classmethod
    def from_config(cls, tcfg: TinyModelConfig) -> "TinyTokenizer":
        return cls(tcfg.vocab_size, tcfg.eos_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return [] if self.eos_token_id is None else [self.eos_token_id]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; no special tokens are ever added (as with Qwen's tokenizer)."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} is not in this tiny vocabulary {self._chars!r}"
            ) from None

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ints, or a 1-D tensor); eos is dropped when skip_special_tokens."""
        if hasattr(ids, "tolist"):  # a tensor or numpy array
            ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return "".join(self._chars[i] for i in ids)

def load_tokenizer(cfg: ModelConfig) -> Any:
    """TinyTokenizer for "tiny", else the HF tokenizer stored with the model."""
    if cfg.name == TINY:
        return TinyTokenizer.from_config(cfg.tiny)
    from transformers import AutoTokenizer

    if cfg.name in OFFLINE_MODELS:  # the converted model's, or read from the GGUF alone: never a conversion
        return AutoTokenizer.from_pretrained(ensure_offline_tokenizer(cfg.name))
    if has_gguf(cfg.name):
        path = Path(cfg.name).expanduser()
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return load_resolved(cfg.name, AutoTokenizer.from_pretrained)


def encode_prompt(tokenizer: Any, text: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; with chat=True wrapped in the model's chat template.

    A tokenizer without a chat template (the tiny test tokenizer, base models)
    encodes the text as is, so one prompt set serves every model pair.
    """
    if chat and has_chat_template(tokenizer):
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    if chat:
        log.debug("tokenizer %s has no chat template; encoding the chat prompt as plain text", type(tokenizer).__name__)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, by default ready for the
    assistant's turn; `tools` (OpenAI's function definitions) go to the template, which lays them
    out its own way. continue_final_message leaves the last message open (an assistant's prefill);
    template_kwargs are more variables for the template (Qwen3's enable_thinking)."""
    # Only what is asked for is passed: a template (or a stand-in) without tools never sees the key.
    extra = {"tools": tools} if tools else {}
    if continue_final_message:
        extra["continue_final_message"] = True
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **extra, **(template_kwargs or {}))
    return list(tokenizer.encode(rendered, add_special_tokens=False))


# apply_chat_template's own parameters and the variables it sets: never a template kwarg.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


def template_variables(tokenizer: Any) -> frozenset[str] | None:
    """The variables the tokenizer's chat template(s) read; None where the template cannot be parsed
    here (then any template kwarg is passed on)."""
    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    found = [_variables(source) for source in sources if source]
    return None if None in found else frozenset().union(*found)


@functools.lru_cache(maxsize=16)
def _variables(source: str) -> frozenset[str] | None:
    """The undeclared variables of one template's source (parsed once per source)."""
    import jinja2
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_template_environment(source).parse(source)))
    except jinja2.TemplateError:
        return None


def _template_environment(source: str) -> Any:
    """The Jinja environment transformers renders chat templates in (its `{% generation %}` tag too)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(source).environment
    except ImportError:  # another transformers layout: plain Jinja with the loop controls templates use
        import jinja2

        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


# Fill-in-the-middle tokens (prefix, suffix, middle) of the code models that have them:
# Qwen2.5-Coder and CodeGemma, StarCoder / StarCoder2, DeepSeek-Coder.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's fill-in-the-middle tokens (prefix, suffix, middle); None if it has none.
    A prompt is then prefix-token, the text before, suffix-token, the text after, middle-token (PSM)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for names in FIM_TOKENS:
        if all(name in vocab for name in names):
            return tuple(vocab[name] for name in names)
    return None


def has_think_tokens(tokenizer: Any) -> bool:
    """Whether the vocabulary has a reasoning model's <think> and </think> tokens (Qwen3, QwQ, DeepSeek-R1)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return "<think>" in vocab and "</think>" in vocab


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def eos_token_ids(tokenizer: Tokenizer, model: object | None = None) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config.

    Chat models often end turns with a token (Qwen's <|im_end|>) other than
    the tokenizer's own EOS; the generation config lists both.
    """
    ids: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    for eos in (getattr(tokenizer, "eos_token_id", None), getattr(gen_config, "eos_token_id", None)):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(eos)
    return ids
