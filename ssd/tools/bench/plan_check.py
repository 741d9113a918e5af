"""Does the start-up plan pick well? SSD through the cluster with no flags
against SD and AR in process and a (K, budget) grid of SSD, in one run.

    python launch/bench_plan.py                                  # code and chat prompts, T = 0 and 0.7
    python launch/bench_plan.py --prompts 2 --max-new-tokens 48 --background-load --json plan_check.json

The cluster starts in SSD mode and plans (runtime.plan; the probes are cached
per host).

Rows, all on the same prompts, interleaved prompt by prompt (a shared host's
swings touch every row alike):
- AR and SD at K = 4 in process, on 1 and on 2 torch threads (SD on one
  thread is the paper's setting for SSD's target device; two threads is
  equal total hardware: SSD uses two cores);
- "ssd plan": the cluster's own defaults, which the plan chose at start;
- "ssd K=k B=b": the grid, through the same cluster, per-request settings
  (ssd.tools.bench.runner.fixed_ssd: that K and budget, nothing adaptive).
Decode tokens/s summed over the prompts (tokens after the first / decode
time). `background`: one nice-19 busy process for the whole run
(ssd.tools.bench.background).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args
from ssd.cluster.devices import default_cpu_placement
from ssd.cluster.runtime import Cluster
from ssd.config import Config, SamplingConfig, SpeculationConfig
from ssd.factory import LoadedPair, load_pair, make_engine
from ssd.engine.request import GenerationRequest, Generator
from ssd.tools.bench.background import busy_background
from ssd.tools.bench.report import machine_info
from ssd.tools.bench.runner import fixed_ssd
from ssd.tools.prompts import load_prompt_set

log = logging.getLogger(__name__)


@dataclass
class Row:
    label: str
    generator: Generator
    speculation: SpeculationConfig | None
    threads: int = 0  # in-process torch threads; 0: the cluster (pinned actors)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def rows_for(pair: LoadedPair, cluster, config: Config, grid: Sequence[tuple[int, int]], threads=(1, 2)) -> list[Row]:
    rows = []
    for t in threads:
        rows.append(Row(f"ar {t}t", make_engine("ar", pair, config.speculation), None, t))
        sd = dataclasses.replace(config.speculation, mode="sd", k=4)
        rows.append(Row(f"sd K=4 {t}t", make_engine("sd", pair, sd), sd, t))
    rows.append(Row("ssd plan", cluster, None))
    for k, b in grid:  # that K and budget, nothing adaptive, speculating whatever the plan's k_policy
        rows.append(Row(f"ssd K={k} B={b}", cluster, fixed_ssd(cluster.config.speculation, k, b)))
    return rows


def run(rows: list[Row], prompts: Sequence[list[int]], sampling: SamplingConfig, config: Config,
        temperature: float, tick: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Every row on every prompt, interleaved; one warm-up generation per row first."""
    for row in rows:
        row.tokens, row.seconds = 0, 0.0
        _generate(row, prompts[0], sampling, config, temperature, 0, max_new_tokens=8)
    for i, ids in enumerate(prompts):
        for row in rows:
            stats = _generate(row, ids, sampling, config, temperature, i)
            row.tokens += stats.new_tokens - 1
            row.seconds += stats.total_s - stats.time_to_first_token_s
            tick()
    return [{"row": r.label, "threads": r.threads, "tok_s": r.tok_s, "temperature": temperature} for r in rows]


def _generate(row: Row, ids, sampling, config, temperature: float, i: int, max_new_tokens: int | None = None):
    saved = torch.get_num_threads()
    if row.threads:
        torch.set_num_threads(row.threads)
    try:
        generation = config.generation if max_new_tokens is None else dataclasses.replace(
            config.generation, max_new_tokens=max_new_tokens)
        seeded = dataclasses.replace(sampling, temperature=temperature, seed=sampling.seed + i)
        return row.generator.generate(GenerationRequest(list(ids), seeded, generation, row.speculation)).stats
    finally:
        torch.set_num_threads(saved)


def format_table(results: list[dict[str, Any]], title: str) -> str:
    by_label = {r["row"]: r["tok_s"] for r in results}
    sd1, sd2 = by_label.get("sd K=4 1t"), max(by_label.get("sd K=4 1t", 0), by_label.get("sd K=4 2t", 0))
    grid = [v for k, v in by_label.items() if k.startswith("ssd K=")]
    lines = [title, f"{'row':<16} {'tok/s':>7} {'x SD 1t':>8} {'x best SD':>9}"]
    for label, v in by_label.items():
        lines.append(f"{label:<16} {v:7.2f} {v / sd1 if sd1 else 0:8.2f} {v / sd2 if sd2 else 0:9.2f}")
    if grid and "ssd plan" in by_label:
        lines.append(f"plan / best grid point: {by_label['ssd plan'] / max(grid):.2f}")
    return "\n".join(lines)


# --- launch/bench_plan.py -----------------------------------------------------------------

GRID = [(2, 2), (2, 4), (3, 4), (3, 8), (4, 4), (4, 8)]  # the SSD (K, budget) rows beside the plan's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-sets", nargs="+", default=["code", "chat"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    parser.add_argument("--background-load", action="store_true", help="one nice-19 busy process throughout")
    parser.add_argument("--json", type=Path)
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    config = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, mode="ssd"))
    pair = load_pair(config)
    sets = {name: [p.encode(pair.tokenizer) for p in load_prompt_set(PROMPT_DIR / f"{name}.yaml", args.prompts)]
            for name in args.prompt_sets}
    out: dict = {"machine": machine_info(), "background_load": args.background_load, "tables": []}
    with Cluster(config, default_cpu_placement(os.cpu_count() or 2, with_draft=True)) as cluster:
        if cluster.plan is not None:
            print(cluster.plan.summary())
            out["plan"] = dataclasses.asdict(cluster.plan.best) | {"sd_k": cluster.plan.sd_k,
                                                                 "sd_tokens_per_s": cluster.plan.sd_tokens_per_s}
        rows = rows_for(pair, cluster, config, GRID)
        out["tables"] = _tables(rows, sets, config, args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return out


def _tables(rows: list[Row], sets: dict[str, list[list[int]]], config: Config,
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every prompt set at every temperature, each table printed as it is done."""
    tables = []
    total = len(rows) * sum(len(p) for p in sets.values()) * len(args.temperatures)
    with busy_background(args.background_load), tqdm(total=total, desc="plan check", file=sys.stderr) as bar:
        for name, prompts in sets.items():
            for t in args.temperatures:
                results = run(rows, prompts, config.sampling, config, t, bar.update)
                title = f"{name}, T={t}, {'one busy background process' if args.background_load else 'quiet'}"
                print(format_table(results, title), flush=True)
                tables.append({"prompt_set": name, "temperature": t, "rows": results})
    return tables
