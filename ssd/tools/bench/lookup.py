"""What prompt lookup (ssd.engine.lookup) buys the target alone on this host: plain decoding (AR)
against the same target whose rounds verify what the text so far predicts (an SD
engine with no draft model: speculation.prompt_lookup), one request at a time, the
two interleaved per prompt in each round.

    python launch/bench_lookup.py --prompt-file PROMPTS.yaml                   # llama.cpp, 2 threads
    python launch/bench_lookup.py --prompt-file PROMPTS.yaml --backend torch --out docs/results/lookup_torch

Decode tok/s (after the first token) per prompt, the lookups' accepted share, and whether
greedy tokens agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.app.cli import DEFAULT_CONFIG, PROMPT_DIR
from ssd.config import Config, GenerationConfig, SamplingConfig, load_config
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.factory import load_pair
from ssd.models.backend import forward_rows, new_sequence, precision_of, release, sequence_source
from ssd.tools.bench.report import command_line, print_and_save
from ssd.tools.prompts import Prompt, load_prompt_set


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


# --- launch/bench_lookup.py ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--backend", choices=["auto", "llamacpp", "torch"], default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-file", type=Path, default=PROMPT_DIR / "code.yaml")
    parser.add_argument("--prompts", type=int, help="the first N prompts of the file")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--lookup-tokens", type=int, default=8,
                        help="speculation.prompt_lookup.max_tokens (the longest lookup a round verifies)")
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    overrides = {"target": {"backend": args.backend}, "runtime": {"threads": args.threads},
                 "speculation": {"prompt_lookup": {"max_tokens": args.lookup_tokens}}}
    config = load_config(args.config, overrides)
    prompts = load_prompt_set(args.prompt_file, args.prompts)
    result = bench_lookup(config, prompts, args.max_new_tokens, args.rounds, args.temperature)
    command = command_line("launch/bench_lookup.py", argv)
    print_and_save(command, format_table(result), result, args.out)
