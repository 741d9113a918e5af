"""SSD cache behaviour across fan-out schedules, temperatures and Saguaro C.

    python launch/ssd_sweep.py                                 # default pair, K=4, B=16
    python launch/ssd_sweep.py --fanouts uniform geometric --temperatures 0 0.7 --cs 1 0.5

Runs SSD in-process over the same prompts for every combination and prints
hit rate, tokens per round (overall, after a hit, after a miss) and
acceptance. Saguaro C has no effect under greedy decoding, so T = 0 runs only
C = 1. These are quality measures of the speculation, not speed: the two
roles share this process's cores here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import yaml
from tqdm import tqdm

from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args
from ssd.factory import load_pair, make_engine
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest
from ssd.models.tokenizer import encode_prompt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-file", type=Path, default=PROMPT_DIR / "code.yaml")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--fanouts", nargs="+", default=["uniform", "geometric"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    parser.add_argument("--cs", nargs="+", type=float, default=[1.0, 0.5])
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)

    pair = load_pair(config)
    prompts = [encode_prompt(pair.tokenizer, p) for p in yaml.safe_load(args.prompt_file.read_text())[: args.prompts]]
    grid = [
        (kind, t, c) for kind, t, c in itertools.product(args.fanouts, args.temperatures, args.cs)
        if t > 0 or c == 1.0
    ]
    rows = []
    with tqdm(total=len(grid) * len(prompts), desc="sweep", file=sys.stderr) as bar, \
            make_engine("ssd", pair, config.speculation) as engine:
        for kind, temperature, c in grid:
            speculation = dataclasses.replace(
                config.speculation, mode="ssd", saguaro_c=c,
                fanout=dataclasses.replace(config.speculation.fanout, kind=kind),
            )
            sampling = dataclasses.replace(config.sampling, temperature=temperature)
            stats = []
            for seed, ids in enumerate(prompts):
                request = GenerationRequest(ids, dataclasses.replace(sampling, seed=seed), config.generation, speculation)
                stats.append(engine.generate(request).stats)
                bar.update()
            rows.append({"fanout": kind, "temperature": temperature, "c": c, **summarise(stats)})
    print(f"K={config.speculation.k}, budget B={config.speculation.fanout.budget}, "
          f"{len(prompts)} prompts x {config.generation.max_new_tokens} tokens")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def summarise(stats: list[GenerationStats]) -> dict[str, float]:
    t = total(stats)
    return {
        "hit_rate": t.spec.hit_rate,
        "tokens_per_round": (t.new_tokens - t.requests) / max(1, t.rounds),
        "after_hit": t.spec.tokens_per_round_after_hit,
        "after_miss": t.spec.tokens_per_round_after_miss,
        "acceptance": t.acceptance_rate,
    }


def table(rows: list[dict]) -> str:
    head = f"{'fanout':<10} {'T':>4} {'C':>4} {'hit rate':>8} {'tok/round':>9} {'after hit':>9} {'after miss':>10} {'accept':>7}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['fanout']:<10} {r['temperature']:>4.1f} {r['c']:>4.1f} {r['hit_rate']:>8.3f} "
            f"{r['tokens_per_round']:>9.2f} {r['after_hit']:>9.2f} {r['after_miss']:>10.2f} {r['acceptance']:>7.3f}"
        )
    return "\n".join(lines)

