"""What prompt lookup (ssd.engine.lookup) buys the target alone: plain decoding (AR)
against the same target whose rounds verify what the text so far predicts (an SD
engine with no draft model), one request at a time, the two interleaved per prompt
in each round; greedy tokens compared. Run it with launch/bench_lookup.py."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.config import Config, GenerationConfig, SamplingConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.factory import load_pair
from ssd.models.backend import forward_rows, new_sequence, precision_of, release, sequence_source
from ssd.tools.prompts import Prompt


COST_COUNTS = (1, 2, 3, 4, 5, 7)  # token counts whose forward is timed (verification sizes)


def forward_costs(
    model: Any, tokens: Sequence[int], counts: Sequence[int] = COST_COUNTS, context: int = 300, repeats: int = 7,
) -> dict[int, float]:
    """Median seconds of one forward of n tokens after a `context`-token prefix, per n, the
    counts interleaved; the ids are `tokens` over and over (attention cost depends on length)."""
    seq = new_sequence(sequence_source(model, 1, max(context, max(counts)), context + max(counts) + 1))
    ids = [tokens[i % len(tokens)] for i in range(context + max(counts))]
    forward_rows([seq], [ids[:context]], last_only=True)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            seq.rollback(context)
            started = time.perf_counter()
            forward_rows([seq], [ids[context : context + n]])
            times[n].append(time.perf_counter() - started)
    release(seq)
    return {n: statistics.median(t) for n, t in times.items()}


def bench_lookup(config: Config, prompts: Sequence[Prompt], tokens: int, rounds: int, temperature: float) -> dict[str, Any]:
    """Per prompt: median decode tok/s of AR and of AR with prompt lookup over `rounds`
    interleaved rounds, the lookups' acceptance, and whether greedy tokens agree."""
    pair = load_pair(config, with_draft=False)
    speculation = dataclasses.replace(config.speculation, mode="sd")
    engines = {"ar": AREngine(pair.target, pair.tokenizer, config.batching),
               "lookup": SDEngine(pair.target, None, pair.tokenizer, speculation, config.batching)}
    sampling = SamplingConfig(temperature=temperature, seed=0)
    rows, seen = [], []
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        ids = prompt.encode(pair.tokenizer)
        seen += ids
        rates: dict[str, list[float]] = {"ar": [], "lookup": []}
        outputs, looked_up, accepted = set(), 0, 0
        for r in range(rounds):
            for name, engine in list(engines.items())[:: 1 if r % 2 == 0 else -1]:  # each first in turn
                spec = speculation if name == "lookup" else None
                out = engine.generate(GenerationRequest(ids, sampling, GenerationConfig(max_new_tokens=tokens), spec))
                rates[name].append(out.stats.decode_tokens_per_s)
                outputs.add(tuple(out.token_ids))
                looked_up += out.stats.looked_up
                accepted += out.stats.lookup_accepted
        ar, lookup = statistics.median(rates["ar"]), statistics.median(rates["lookup"])
        rows.append({"prompt": i, "prompt_tokens": len(ids), "ar_tok_per_s": ar, "lookup_tok_per_s": lookup,
                     "ratio": lookup / ar, "looked_up": looked_up, "accepted": accepted,
                     "greedy_equal": None if temperature else len(outputs) == 1})
    ratios = [row["ratio"] for row in rows]
    costs = forward_costs(pair.target, seen)
    return {"forward_s": costs, "machine": hardware.summary(), "uptime": hardware.uptime(), "threads": torch.get_num_threads(),
            "target": f"{config.target.name} ({precision_of(pair.target)})", "tokens": tokens, "rounds": rounds,
            "temperature": temperature, "lookup": dataclasses.asdict(speculation.prompt_lookup),
            "lookup_ceiling": speculation.lookup_ceiling, "rows": rows,
            "geomean_ratio": statistics.geometric_mean(ratios) if ratios else None}


def format_table(result: dict[str, Any]) -> str:
    lines = [result["machine"], result["uptime"],
             f"target {result['target']}, {result['threads']} threads, {result['tokens']} tokens, T={result['temperature']}, "
             f"medians of {result['rounds']} interleaved rounds; lookup {result['lookup']} (up to "
             f"{result['lookup_ceiling']} tokens a round)",
             "forward of n tokens after 300, x one token: " + ", ".join(
                 f"n={n}: {float(t) * 1000:.1f} ms ({float(t) / float(result['forward_s'][one]):.2f}x)"
                 for one in [next(iter(result["forward_s"]))] for n, t in result["forward_s"].items()), "",
             "| prompt | prompt tokens | AR tok/s | AR + lookup tok/s | x AR | looked-up tokens accepted | greedy equal |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        share = f"{row['accepted']}/{row['looked_up']}"
        lines.append(f"| {row['prompt']} | {row['prompt_tokens']} | {row['ar_tok_per_s']:.2f} | {row['lookup_tok_per_s']:.2f} "
                     f"| {row['ratio']:.2f} | {share} | {row['greedy_equal']} |")
    if result["geomean_ratio"]:
        lines.append(f"\ngeometric mean x AR: {result['geomean_ratio']:.3f}")
    return "\n".join(lines)
