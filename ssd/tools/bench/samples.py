"""`n` samples of one long prompt on the real target (OpenAI's `n`, `best_of`): rows admitted
together prefill the prompt once and copy it (ssd.engine.kv_manager `follow`), against every row
prefilling it, beside plain llama.cpp answering the n requests in turn with its server's
prompt cache (`cache_prompt`: the later ones reuse the first's prompt).

A code-review prompt over a fixed piece of Python's standard library, cut to about
`prompt_tokens`, headed by the run's number (so no cache holds it before its run); seeded
samples at T = 0.7. The setups take turns (interleaved, the order
rotating), `repeats` times. Reported per setup: time until every sample has its first token,
until all are done, the prompt tokens the target was fed, and whether our two engines' samples
agree token for token (they must: the copies hold what each row's own prefill computes).
Run it with launch/bench_samples.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import textwrap
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.config import Config, GenerationConfig, SamplingConfig
from ssd.engine import AREngine
from ssd.engine.batch import Engine
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.factory import load_pair
from ssd.models.backend import precision_of
from ssd.models.tokenizer import chat_ids

SAMPLING = SamplingConfig(temperature=0.7)


def review_prompt(tokenizer: Any, prompt_tokens: int, run: int = 0) -> list[int]:
    """A chat asking to review the start of textwrap.TextWrapper, cut to about `prompt_tokens`;
    `run` heads the message, so no cache holds an earlier run's prompt."""
    source = inspect.getsource(textwrap.TextWrapper).splitlines()
    for lines in range(len(source), 0, -1):
        code = "\n".join(source[:lines])
        ids = chat_ids(tokenizer, [{"role": "user", "content": f"Run {run}. Review this code; suggest one improvement.\n"
                                                                 f"```python\n{code}\n```"}])
        if len(ids) <= prompt_tokens:
            return ids
    raise ValueError(f"no prompt fits in {prompt_tokens} tokens")


def run_batch(engine: Engine, requests: list[GenerationRequest]) -> tuple[list[GenerationResult], float, float]:
    """Admit every request, step until all finish: results in order, seconds until every first
    token, seconds until the last finished."""
    started = time.perf_counter()
    for request in requests:
        engine.admit(request)
    done: dict[int, GenerationResult] = {}
    while engine.rows:
        for finished in engine.step():
            if finished.error is not None:
                raise finished.error
            done[id(finished.request)] = finished.result
    total = time.perf_counter() - started
    results = [done[id(r)] for r in requests]
    return results, max(r.stats.time_to_first_token_s for r in results), total


def in_turn(generate: Callable[[GenerationRequest], GenerationResult],
            requests: list[GenerationRequest]) -> tuple[list[GenerationResult], float, float]:
    """The requests one after another (llama.cpp's server with one slot): the last first token
    comes after the earlier samples finished."""
    started, results, firsts = time.perf_counter(), [], []
    for request in requests:
        at = time.perf_counter() - started
        results.append(generate(request))
        firsts.append(at + results[-1].stats.time_to_first_token_s)
    return results, max(firsts), time.perf_counter() - started


def bench_samples(config: Config, n: int, prompt_tokens: int, tokens: int, repeats: int,
                  llamacpp: bool = True) -> dict[str, Any]:
    pair = load_pair(config, with_draft=False)
    batching = dataclasses.replace(config.batching, max_rows=max(n, config.batching.max_rows))
    setups: dict[str, Callable[[list[GenerationRequest]], tuple]] = {}
    for shared in (True, False):
        engine = AREngine(pair.target, pair.tokenizer, dataclasses.replace(batching, prefix_cache=shared))
        name = "ssd, one prefill copied to the rows" if shared else "ssd, every row prefills"
        setups[name] = lambda requests, engine=engine: run_batch(engine, requests)
    if llamacpp:
        from ssd.tools.bench.llamacpp import LlamaCppEngine, gguf_for

        peer = LlamaCppEngine(gguf_for(config.target.name), torch.get_num_threads(), reuse_prefix=True)
        setups["llama.cpp, cache_prompt, in turn"] = lambda requests: in_turn(peer.generate, requests)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    samples: dict[str, list[list[int]]] = {name: [] for name in setups}
    order = list(setups)
    for repeat in tqdm(range(repeats), desc="repeats"):
        ids = review_prompt(pair.tokenizer, prompt_tokens, repeat)
        for name in order[repeat % len(order):] + order[: repeat % len(order)]:
            requests = [GenerationRequest(list(ids), dataclasses.replace(SAMPLING, seed=100 * repeat + i),
                                          GenerationConfig(max_new_tokens=tokens)) for i in range(n)]
            results, first_s, total_s = setups[name](requests)
            samples[name] += [list(r.token_ids) for r in results]
            rows[name].append({"all_first_tokens_s": first_s, "total_s": total_s,
                               "fed": sum(r.stats.prompt_tokens - r.stats.cached_prompt_tokens for r in results),
                               "new_tokens": sum(r.stats.new_tokens for r in results)})
    ours = [samples[name] for name in setups if name.startswith("ssd")]
    return {"machine": hardware.summary(), "uptime": hardware.uptime(), "threads": torch.get_num_threads(),
            "target": f"{config.target.name} ({precision_of(pair.target)})", "n": n, "prompt_tokens": len(ids),
            "tokens": tokens, "repeats": repeats, "rows": rows, "ours_agree": all(s == ours[0] for s in ours)}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['machine']}; {result['threads']} threads; target {result['target']}; "
             f"n = {result['n']} samples at T = {SAMPLING.temperature} of a {result['prompt_tokens']}-token prompt, "
             f"up to {result['tokens']} new tokens each; {result['repeats']} repeats, interleaved; "
             f"uptime {result['uptime']}",
             "| setup | every sample's first token (s), median | all done (s), median | prompt tokens fed | "
             "new tokens / s |",
             "|---|---|---|---|---|"]
    for name, rows in result["rows"].items():
        first = statistics.median(r["all_first_tokens_s"] for r in rows)
        total = statistics.median(r["total_s"] for r in rows)
        rate = sum(r["new_tokens"] for r in rows) / sum(r["total_s"] for r in rows)
        lines.append(f"| {name} | {first:.2f} | {total:.2f} | {rows[-1]['fed']} | {rate:.1f} |")
    lines.append(f"our two engines' samples agree token for token: {result['ours_agree']}")
    return "\n".join(lines)
