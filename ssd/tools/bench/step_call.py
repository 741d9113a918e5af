"""Decode rate through the cluster at several cluster.step_call_s (how long one
Ray call keeps stepping), one request at a time, the settings interleaved in
each round; greedy tokens compared across settings. Run it with
launch/bench_step_call.py."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

from tqdm import tqdm

from ssd import hardware
from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import Config, GenerationConfig, SamplingConfig
from ssd.engine.request import GenerationRequest


def bench_step_call(
    config: Config, call_seconds: Sequence[float], modes: Sequence[str], prompt: str, tokens: int, rounds: int,
) -> dict[str, Any]:
    """Rates per (mode, step_call_s) over `rounds` interleaved rounds, and whether every run's
    greedy tokens agree (AR's and SSD's, at every setting)."""
    rates: dict[tuple[str, float], list[float]] = {}
    outputs: set[tuple[int, ...]] = set()
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as cluster:
        ids = cluster.encode(prompt)
        turns = [(mode, s) for _ in range(rounds) for mode in modes for s in call_seconds]
        for mode, call_s in tqdm(turns, desc="step_call_s"):
            spec = dataclasses.replace(cluster.config.speculation, mode=mode)
            request = GenerationRequest(ids, SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=tokens), spec)
            with cluster.batch_engine(mode) as engine:
                engine.call_s = call_s
                started = time.perf_counter()
                out = engine.generate(request)
                rates.setdefault((mode, call_s), []).append(len(out.token_ids) / (time.perf_counter() - started))
            outputs.add(tuple(out.token_ids))
    rows = [{"mode": mode, "step_call_s": s, "median_tok_per_s": statistics.median(r), "min": min(r), "max": max(r),
             "runs": len(r)} for (mode, s), r in rates.items()]
    return {"machine": hardware.summary(), "uptime": hardware.uptime(), "tokens": tokens, "rows": rows,
            "greedy_tokens_equal": len(outputs) == 1}


def format_table(result: dict[str, Any]) -> str:
    lines = [result["machine"], result["uptime"], "",
             "| mode | step_call_s | tok/s (median) | min | max | runs |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['mode']} | {row['step_call_s']:g} | {row['median_tok_per_s']:.1f} | {row['min']:.1f} "
                     f"| {row['max']:.1f} | {row['runs']} |")
    lines.append(f"\ngreedy tokens equal in every run (both modes, every setting): {result['greedy_tokens_equal']}")
    return "\n".join(lines)
