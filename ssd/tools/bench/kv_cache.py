"""The KV cache's type on llama.cpp's kernels at long contexts: which caches keep batched and
speculative rows bit-exact, what a decode step costs in each, how far each moves the logits,
and decoding through our AR engine against plain llama.cpp.

Caches (keys/values): F16 (llama.cpp's default), BF16/F16 and BF16. Past 256 positions ggml's
flash attention takes a split-KV path for a lone query row over an all-F16 cache, and that row
parts from the same token in a verification or beside other rows (ssd.models.llamacpp); the
other two take the row-by-row path always. Per cache:
- exact: `invariant_tokens` after PROBE_LEAD positions on two threads (the engine's probe);
- step ms: one-token decode steps after P positions of real text (Python's argparse source),
  the caches interleaved, `repeats` rounds of 16 steps, median;
- error: log-softmax KL (mean, max) and the greatest logit difference over 48 teacher-forced
  tokens after P positions, against an F32 cache without flash attention (the precise
  reference: flash attention rounds F32 keys and values to F16);
- decode tok/s: our AREngine (each cache) and plain llama.cpp (its own context and sampler)
  on one long prompt, greedy, interleaved.
Run it with launch/bench_kv.py.
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig
from ssd.engine import AREngine
from ssd.engine.request import GenerationRequest

CACHES = ("f16", "bf16/f16", "bf16")
STEPS = 16  # decode steps a timing round
SCORED = 48  # teacher-forced tokens the error is taken over


def long_text_ids(tokenizer: Any, n: int) -> list[int]:
    """`n` ids of real Python source (argparse's), the same on every host with this Python."""
    import argparse

    ids = tokenizer(inspect.getsource(argparse))["input_ids"]
    if len(ids) < n:
        raise ValueError(f"argparse's source has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def _sequence(model: Any, kv: str, room: int, flash_attn: bool = True) -> Any:
    """A fresh one-slot sequence of `room` cells with cache `kv`, as the engine's contexts run."""
    from ssd.models.llamacpp import LlamaCppSequence

    return LlamaCppSequence(model, n_ctx_seq=room, flash_attn=flash_attn, pad_single=False, kv_type=kv,
                            n_ubatch=model.invariant_options().get("n_ubatch", 512))


def step_ms(model: Any, ids: list[int], positions: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of a one-token decode step after each count of positions, per cache, interleaved."""
    out: dict[str, dict[int, float]] = {kv: {} for kv in CACHES}
    for p in positions:
        rows = {kv: _sequence(model, kv, p + STEPS + 8) for kv in CACHES}
        for row in rows.values():
            row.forward(ids[:p], last_only=True)
        times: dict[str, list[float]] = {kv: [] for kv in CACHES}
        for _ in tqdm(range(repeats), desc=f"steps after {p}", leave=False):
            for kv, row in rows.items():
                started = time.perf_counter()
                for token in ids[p: p + STEPS]:
                    row.forward([token])
                times[kv].append((time.perf_counter() - started) / STEPS * 1000)
                row.rollback(p)
        for kv, row in rows.items():
            out[kv][p] = statistics.median(times[kv])
            row.close()
    return out


def _scored_logits(model: Any, ids: list[int], p: int, kv: str, flash_attn: bool = True) -> torch.Tensor:
    row = _sequence(model, kv, p + SCORED + 8, flash_attn)
    row.forward(ids[:p], last_only=True)
    logits = torch.cat([row.forward([t]) for t in ids[p: p + SCORED]]).double()
    row.close()
    return logits


def logit_error(model: Any, ids: list[int], positions: list[int]) -> dict[str, dict[int, dict[str, float]]]:
    """Per cache and position: mean and max KL(reference || cache) and max |logit difference|."""
    out: dict[str, dict[int, dict[str, float]]] = {kv: {} for kv in CACHES}
    for p in tqdm(positions, desc="logit error", leave=False):
        reference = _scored_logits(model, ids, p, "f32", flash_attn=False).log_softmax(-1)
        for kv in CACHES:
            logits = _scored_logits(model, ids, p, kv)
            kl = (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1)
            out[kv][p] = {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                          "max_logit_diff": float((logits - reference).abs().max())}
    return out


def decode_rates(gguf: Path, tokenizer: Any, ids: list[int], tokens: int, repeats: int,
                 llamacpp: bool) -> dict[str, list[float]]:
    """Decode tokens/s after the first token, our AR engine per cache and plain llama.cpp, interleaved."""
    from ssd.models.llamacpp import LlamaCppModel

    batching = BatchingConfig(max_rows=1, prefill_chunk=128, max_batched_tokens=4096, prefix_cache=False)
    systems: dict[str, Any] = {f"ours, {kv}": AREngine(LlamaCppModel(gguf, n_ctx=4096, kv_type=kv), tokenizer, batching)
                               for kv in CACHES[1:]}
    if llamacpp:
        from ssd.tools.bench.llamacpp import LlamaCppEngine

        systems["llama.cpp (F16 cache)"] = LlamaCppEngine(gguf, torch.get_num_threads())
    rates: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for _ in tqdm(range(repeats), desc="decode", leave=False):
            for name, system in systems.items():
                request = GenerationRequest(list(ids), SamplingConfig(temperature=0.0),
                                            GenerationConfig(max_new_tokens=tokens, ignore_eos=True))
                stats = system.generate(request).stats
                rates[name].append((stats.new_tokens - 1) / (stats.total_s - stats.time_to_first_token_s))
    finally:
        for system in systems.values():
            system.close()
    return rates


def bench_kv(config: Any, positions: list[int], repeats: int, prompt_tokens: int, tokens: int,
             llamacpp: bool = True) -> dict[str, Any]:
    from ssd.models.llamacpp import PROBE_LEAD, LlamaCppModel, invariant_tokens
    from ssd.models.tokenizer import load_tokenizer
    from ssd.tools.bench.llamacpp import gguf_for

    gguf = gguf_for(config.target.name)
    tokenizer = load_tokenizer(config.target)
    model = LlamaCppModel(gguf, n_ctx=4096)
    options = model.invariant_options()
    ids = long_text_ids(tokenizer, max(max(positions), prompt_tokens) + SCORED + STEPS)
    exact = {kv: invariant_tokens(model, options["flash_attn"], False, kv, lead=PROBE_LEAD) >= 2 for kv in CACHES}
    return {"machine": hardware.summary(), "uptime": hardware.uptime(), "threads": torch.get_num_threads(),
            "target": f"{config.target.name} ({model.precision}{', repacked' if model.repacked else ''})",
            "probe_picks": model.kv_type, "exact": exact, "repeats": repeats,
            "step_ms": step_ms(model, ids, positions, repeats), "error": logit_error(model, ids, positions),
            "prompt_tokens": prompt_tokens, "tokens": tokens,
            "decode": decode_rates(gguf, tokenizer, ids[:prompt_tokens], tokens, max(1, repeats // 3), llamacpp)}


def format_table(result: dict[str, Any]) -> str:
    positions = list(result["step_ms"][CACHES[0]])
    lines = [f"{result['machine']}; {result['threads']} threads; target {result['target']}; "
             f"the probe picks {result['probe_picks']}; uptime {result['uptime']}",
             "| cache (keys/values) | batched and speculative rows exact | "
             + " | ".join(f"step ms after {p}" for p in positions) + " | "
             + " | ".join(f"mean / max KL after {p}" for p in positions) + " |",
             "|---|---|" + "---|" * (2 * len(positions))]
    for kv in CACHES:
        steps = " | ".join(f"{result['step_ms'][kv][p]:.1f}" for p in positions)
        errors = " | ".join(f"{e['mean_kl']:.2e} / {e['max_kl']:.2e}" for e in result["error"][kv].values())
        lines.append(f"| {kv} | {'yes' if result['exact'][kv] else 'no'} | {steps} | {errors} |")
    lines += [f"Steps: median of {result['repeats']} interleaved rounds of {STEPS}; KL over {SCORED} teacher-forced "
              "tokens against an F32 cache without flash attention.",
              f"Decode tokens/s after a {result['prompt_tokens']}-token prompt, {result['tokens']} tokens, greedy, "
              "interleaved (median):",
              "| system | tok/s | x llama.cpp |", "|---|---|---|"]
    peer = result["decode"].get("llama.cpp (F16 cache)")
    for name, rates in result["decode"].items():
        ratio = f"{statistics.median(rates) / statistics.median(peer):.2f}" if peer else "n/a"
        lines.append(f"| {name} | {statistics.median(rates):.2f} | {ratio} |")
    return "\n".join(lines)
