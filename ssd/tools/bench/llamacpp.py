"""llama.cpp plain decoding of the same GGUF file, timed like our engines: the peer a
CPU user would otherwise pick.

`pip install 'ssd[models]'` (or `ssd[llamacpp]`) builds llama-cpp-python
from its sdist once (about 9 minutes on 2 cores). The offline pair's GGUF files are the very q4_k_m
files our models are dequantized from, so both sides start from the same
weights; llama.cpp keeps them in q4_k_m, as our llama.cpp backend does; our torch
backend re-quantizes to int8 (or runs bf16/fp32). Prompt ids come from our tokenizer (the GGUF carries the same
one), no BOS is added, and every sampler but temperature / top-k / top-p is
off. At T = 0 it is greedy; at T > 0 its draws use its own seeded RNG, so
only speeds compare, not tokens.

llama.cpp's repacked weight layouts (its "extra buffer types", on by default
in llama.cpp) load where they run on this host, as in our backend
(`ssd.models.llamacpp.repack_probe`): on an AVX512/AMX VM they died
with SIGILL, so users there run plain layouts.

GGUFTokenizer is the engines' tokenizer over the same file's own vocabulary
(llama.cpp's tokenizer), for the benches that run the GGUF pair without the
hub's tokenizer (ssd.tools.bench.llamacpp_pair).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.request import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from ssd.models.llamacpp import LlamaCppModel

log = logging.getLogger(__name__)

MODE = "llama.cpp"


def gguf_for(model_name: str) -> Path:
    """The GGUF file behind a model name: an offline registry name or a .gguf path."""
    from ssd.models.offline import OFFLINE_MODELS, ensure_offline_gguf

    if model_name in OFFLINE_MODELS:
        return ensure_offline_gguf(model_name)
    path = Path(model_name)
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"no GGUF file for {model_name!r}: pass an offline registry name or a .gguf path")


class LlamaCppEngine:
    """Plain decoding with llama.cpp on `threads` threads: llama.cpp's own context defaults
    (flash attention auto, F16 KV cache) and its own sampler chain, one llama_decode per
    token through the C API (no Python sampling in the loop: the fastest plain decoding
    llama-cpp-python offers).

    The weights load as our backend loads them: in llama.cpp's repacked layouts (its
    default) where they run on this host, plain where they do not (on an AVX512/AMX
    Xeon they died with SIGILL, so no user there runs them).
    """

    mode = MODE

    def __init__(self, gguf: Path, threads: int = 0, n_ctx: int = 4096, precision: str = "q4_k_m",
                 reuse_prefix: bool = False) -> None:
        """reuse_prefix: keep the last request's cache and feed only what a prompt adds to their
        common prefix, as llama.cpp's server does (`cache_prompt`, its default)."""
        try:
            import llama_cpp as L
        except ImportError as exc:
            raise RuntimeError("the llama.cpp peer needs llama-cpp-python: pip install 'ssd[llamacpp]'") from exc
        from ssd.models.llamacpp import LlamaCppModel

        self.threads = threads or os.cpu_count() or 1
        self.model = LlamaCppModel(gguf, n_ctx=n_ctx, plain_prefill=False)  # llama.cpp prefills in place
        self.precision = precision + ("+repack" if self.model.repacked else "")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch = self.model.n_ctx, 512
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self._L = L
        self._ctx = L.llama_init_from_model(self.model._model, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {gguf}")
        self._eos = set(self.model.generation_config.eos_token_id)
        self.reuse_prefix = reuse_prefix
        self._held: list[int] = []  # the ids the context's cache holds (reuse_prefix)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Plain decoding of the GGUF; token callbacks get the whole output at once."""
        L, ctx = self._L, self._ctx
        prompt_ids, sampling, generation = list(request.prompt_ids), request.sampling, request.generation
        clock = Stopwatch()
        stats = GenerationStats(mode=MODE, precision=self.precision, prompt_tokens=len(prompt_ids))
        start = self._reusable(prompt_ids)
        stats.cached_prompt_tokens = start
        sampler = self._sampler(sampling)
        tokens: list[int] = []
        finish = "length"
        try:
            for i in range(start, len(prompt_ids), 512):
                self._decode(prompt_ids[i:i + 512])
            while True:
                token = int(L.llama_sampler_sample(sampler, ctx, -1))
                if not tokens:
                    stats.time_to_first_token_s = clock.elapsed()
                if token in self._eos and not generation.ignore_eos:
                    finish = "eos"
                    break
                tokens.append(token)
                if len(tokens) >= generation.max_new_tokens:
                    break
                self._decode([token])
        finally:
            L.llama_sampler_free(sampler)
        stats.total_s = clock.elapsed()
        stats.new_tokens = len(tokens)
        stats.rounds = max(0, len(tokens) - 1)  # decode steps after the first token, as for AR
        request.emit(tokens)
        return GenerationResult(tokens, self._detokenize(tokens), finish, stats)

    def _reusable(self, prompt_ids: list[int]) -> int:
        """Positions of the cache kept for `prompt_ids` (the rest is dropped): their common
        prefix with what it holds, leaving the last prompt token to feed; 0 without reuse_prefix."""
        L = self._L
        keep = 0
        if self.reuse_prefix:
            limit = min(len(self._held), len(prompt_ids) - 1)
            keep = next((i for i in range(limit) if self._held[i] != prompt_ids[i]), limit)
        if keep:
            L.llama_memory_seq_rm(L.llama_get_memory(self._ctx), 0, keep, -1)
        else:
            L.llama_memory_clear(L.llama_get_memory(self._ctx), True)
        self._held = prompt_ids[:keep]
        return keep

    def _sampler(self, sampling):
        """llama.cpp's chain: greedy at T = 0, else top-k, top-p, temperature, a seeded draw."""
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if sampling.temperature == 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if sampling.top_k:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(sampling.top_k))
        if sampling.top_p < 1:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(sampling.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(sampling.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
        return chain

    def _detokenize(self, tokens: list[int]) -> str:
        return detokenize(self.model, tokens)

    def _decode(self, ids: list[int]) -> None:
        L = self._L
        array = (L.llama_token * len(ids))(*ids)  # kept alive through the call
        rc = L.llama_decode(self._ctx, L.llama_batch_get_one(array, len(ids)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self._held += ids

    def close(self) -> None:
        if self._ctx:
            self._L.llama_free(self._ctx)
            self._ctx = None
        self.model.close()

    def __enter__(self) -> "LlamaCppEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GGUFTokenizer:
    """The engines' tokenizer subset over a GGUF model's own vocabulary, as llama.cpp
    tokenizes: no BOS, special tokens as text. No EOS either: the benches that use it make
    fixed-length runs."""

    def __init__(self, model: LlamaCppModel) -> None:
        import llama_cpp

        self._L = llama_cpp
        self.model = model  # holds the vocabulary: read through it at each call
        self.vocab_size = model.vocab_size
        self.eos_token_id = None
        self.all_special_ids: list[int] = []

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        L, data = self._L, text.encode()
        vocab = L.llama_model_get_vocab(self.model._model)
        room = len(data) + 1  # a token is at least one byte (a BOS would be the one more)
        ids = (L.llama_token * room)()
        n = L.llama_tokenize(vocab, data, len(data), ids, room, False, False)
        if n < 0:  # -n: the room it needs
            ids = (L.llama_token * -n)()
            n = L.llama_tokenize(vocab, data, len(data), ids, -n, False, False)
        if n < 0:
            raise RuntimeError(f"llama.cpp could not tokenize {text[:40]!r}...: {n}")
        return list(ids[:n])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return detokenize(self.model, ids)


def detokenize(model: LlamaCppModel, tokens: Sequence[int]) -> str:
    """The text of `tokens` in the model's vocabulary (special tokens as nothing, bytes
    that end mid-character as U+FFFD)."""
    import llama_cpp as L

    vocab, buf, out = L.llama_model_get_vocab(model._model), ctypes.create_string_buffer(256), b""
    for token in tokens:
        n = L.llama_token_to_piece(vocab, int(token), buf, len(buf), 0, False)
        out += buf.raw[:max(n, 0)]
    return out.decode(errors="replace")
