"""Grammars for structured output, through llguidance (github.com/guidance-ai/llguidance).

A grammar travels with a request as llguidance's own serialized grammar (a
string: portable to another process, like the rest of a GenerationRequest);
each row builds its matcher from it over the engine's tokenizer. The matcher
gives, for the tokens committed so far, the set of tokens that may come next
(`mask`: 0 allowed, -inf forbidden; ssd.engine.processing adds it to the
logits) and rolls back the tokens a rejected speculation took.

Why llguidance: it installs here as one abi3 wheel with no dependencies
(xgrammar needs triton and a matching torch), and its mask on Qwen2.5's
151k-token vocabulary takes well under a millisecond per token for JSON
(docs/serving.md has the measurement).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

import numpy as np
import torch

# JSON as Python's json.dumps and Jinja's tojson write it (what Qwen2.5's template shows the
# model): ", " and ": ", no other whitespace. Flexible whitespace would let a sampled
# output pad forever, and spend tokens on nothing.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_EXTENSION = "NoExtensionBias"  # llguidance's error where no token of the vocabulary may come next
_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


class GrammarFailed(RuntimeError):
    """llguidance could not go on with a row's grammar mid-generation (one of its limits, met
    only at some position, or a token it refused): that request alone ends with this error,
    which the front ends report as the request's fault (HTTP 400, gRPC INVALID_ARGUMENT)."""


def _llguidance():
    """llguidance, imported on first use: only structured output needs it, and a machine
    that runs the engine without serving (the GPU smoke run's, which installs nothing)
    may lack it."""
    import llguidance

    return llguidance


# --- grammars from what a client sends ------------------------------------------------


def json_object() -> str:
    """OpenAI's JSON mode: any JSON object."""
    return json_schema({"type": "object"})


def json_schema(schema: dict[str, Any]) -> str:
    """Output valid under a JSON schema (OpenAI's response_format json_schema)."""
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)


def regex(pattern: str) -> str:
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect; `%json {schema}` embeds a JSON schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def error(grammar: str) -> str | None:
    """Why llguidance refuses the grammar (its message), or None when it is valid."""
    message = _llguidance().LLMatcher.validate_grammar(grammar)
    return message or None


# --- a row's matcher ---------------------------------------------------------------------


def matcher(grammar: str, tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """A fresh matcher for one row; ValueError if llguidance refuses the grammar."""
    found = _llguidance().LLMatcher(ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
    if found.is_error():
        raise ValueError(f"grammar: {reason(found)}")
    return found


def can_start(grammar: str, tokenizer: Any, eos_ids: Sequence[int], vocab: int) -> bool:
    """Whether some token of the vocabulary may come first (a grammar needing characters the
    vocabulary lacks cannot), or the grammar is complete as it is; ValueError where llguidance
    cannot compute the first token's mask or take a first token (a grammar over one of its
    limits, which llguidance checks only as it parses), so that such a grammar is refused at
    admission rather than failing its row."""
    found = matcher(grammar, tokenizer, eos_ids)
    allowed = (mask(found, vocab) == 0).nonzero().flatten()
    if found.is_error():
        if reason(found) == NO_EXTENSION:
            return False
        raise ValueError(f"grammar: {reason(found)}")
    if len(allowed):  # llguidance meets most of its limits (items in a row, lexer states) here
        probe = found.deep_copy()
        probe.consume_token(int(allowed[0]))
        if probe.is_error():
            raise ValueError(f"grammar: {reason(probe)}")
    return found.is_stopped() or bool(len(allowed)) or found.is_accepting()


def reason(found: Any) -> str:
    """A matcher's error, its first line (llguidance appends its parser state and the grammar)."""
    return (found.get_error() or "").split("\n", 1)[0]


def mask(found: Any, vocab: int) -> torch.Tensor:
    """[vocab] float64: 0 where the next token may be, -inf elsewhere (ids past the
    grammar's vocabulary, e.g. a model's padding rows, are forbidden)."""
    allowed = np.frombuffer(found.compute_logit_bias(), dtype=np.uint8)[:vocab] != 0
    out = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    out[: allowed.shape[0]].masked_fill_(torch.from_numpy(allowed.copy()), 0.0)
    return out


def ll_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the engine's tokenizer, built once (about a second for a 151k vocabulary)."""
    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), eos)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is None:
            hit = (tokenizer, _build(tokenizer, eos))  # the tokenizer is kept so its id stays its own
            _TOKENIZERS[key] = hit
    return hit[1]


def _build(tokenizer: Any, eos: tuple[int, ...]) -> Any:
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a Hugging Face tokenizer
        wrapped = _llguidance().TokenizerWrapper(_HFTokens(tokenizer, eos))
        return _llguidance().LLTokenizer(wrapped, eos_token=list(eos) or None)
    return _llguidance().LLTokenizer(_llguidance().TokenizerWrapper(_CharTokens(tokenizer, eos)))


class _HFTokens:
    """A Hugging Face byte-level BPE tokenizer as llguidance reads one: each id's bytes, and only
    the tokenizer's *special* tokens marked special.

    llguidance's own loader (the tokenizer JSON) marks every added token special, so Qwen2.5's
    `<tool_call>` (added but "special": false, and how the model writes its calls) was allowed
    by the mask as the text "<tool_call>" yet refused when consumed. Here it is text, as the
    tokenizer itself decodes it; the tokenizer still encodes it as the one token, so a
    grammar's forced "<tool_call>" lets the model write its own token.
    """

    def __init__(self, tokenizer: Any, eos: tuple[int, ...]) -> None:
        to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.tokens: list[bytes] = []
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            if i in added:
                self.tokens.append(added[i].content.encode("utf-8"))
            else:
                self.tokens.append(bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece)
                                   else piece.encode("utf-8"))
        self.special_token_ids = [i for i, t in added.items() if t.special]
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = None
        self.tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class _CharTokens:
    """The tiny one-character tokenizer (ssd.models.tokenizer.TinyTokenizer) as llguidance
    reads one; without an EOS of its own it gets an extra id past the vocabulary that no
    model row ever samples (a completed grammar then ends the row: ssd.engine.processing)."""

    def __init__(self, tokenizer: Any, eos: tuple[int, ...]) -> None:
        size = len(tokenizer)
        self.chars = tokenizer.decode(list(range(size)))
        self.tokens = [ch.encode("utf-8") for ch in self.chars]
        if eos:
            self.eos_token_id = eos[0]
        else:
            self.eos_token_id = size
            self.tokens.append(b"<eos>")
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]
        self.ids = {ch: i for i, ch in enumerate(self.chars)}

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="ignore")
        return [self.ids[ch] for ch in text if ch in self.ids]
