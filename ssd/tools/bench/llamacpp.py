"""llama.cpp plain decoding of the same GGUF file, timed like our engines: the peer a
CPU user would otherwise pick.

Optional: `pip install 'ssd[llamacpp]'` builds llama-cpp-python from its
sdist (a few minutes). The offline pair's GGUF files are the very q4_k_m
files our models are dequantized from, so both sides start from the same
weights; llama.cpp keeps them in q4_k_m, we re-quantize to int8 (or run
bf16/fp32). Prompt ids come from our tokenizer (the GGUF carries the same
one), no BOS is added, and every sampler but temperature / top-k / top-p is
off. At T = 0 it is greedy; at T > 0 its draws use its own seeded RNG, so
only speeds compare, not tokens.

On hosts with AMX, llama.cpp's AMX kernels crashed in this VM; build with
CMAKE_ARGS="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ssd.engine.metrics import GenerationStats, Stopwatch
from ssd.engine.request import GenerationRequest, GenerationResult

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
    """Plain decoding with llama.cpp on `threads` threads."""

    mode = MODE

    def __init__(self, gguf: Path, threads: int = 0, n_ctx: int = 4096, precision: str = "q4_k_m") -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise RuntimeError("the llama.cpp peer needs llama-cpp-python: pip install 'ssd[llamacpp]'") from exc
        self.threads = threads or os.cpu_count() or 1
        self.precision = precision
        self._llm = Llama(
            model_path=str(gguf), n_threads=self.threads, n_threads_batch=self.threads,
            n_ctx=n_ctx, verbose=False, logits_all=False,
        )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Plain decoding of the GGUF; token callbacks get the whole output at once."""
        prompt_ids, sampling, generation = request.prompt_ids, request.sampling, request.generation
        clock = Stopwatch()
        stats = GenerationStats(mode=MODE, precision=self.precision, prompt_tokens=len(prompt_ids))
        eos = {self._llm.token_eos()}
        tokens: list[int] = []
        finish = "length"
        self._llm.set_seed(sampling.seed)
        for token in self._llm.generate(
            list(prompt_ids), reset=True, temp=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, min_p=0.0, repeat_penalty=1.0,
        ):
            if not tokens:
                stats.time_to_first_token_s = clock.elapsed()
            if token in eos and not generation.ignore_eos:
                finish = "eos"
                break
            tokens.append(int(token))
            stats.rounds += 1
            if len(tokens) >= generation.max_new_tokens:
                break
        stats.total_s = clock.elapsed()
        stats.new_tokens = len(tokens)
        stats.rounds = max(0, stats.rounds - 1)  # decode steps after the first token, as for AR
        request.emit(tokens)
        return GenerationResult(tokens, self._llm.detokenize(tokens).decode(errors="replace"), finish, stats)

    def close(self) -> None:
        self._llm.close()

    def __enter__(self) -> "LlamaCppEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
