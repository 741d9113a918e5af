"""Does the start-up plan pick well? SSD through the cluster with no flags
against SD and AR in process and a (K, budget) grid of SSD, in one run.

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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ssd.config import Config, SamplingConfig, SpeculationConfig
from ssd.factory import LoadedPair, make_engine
from ssd.engine.request import GenerationRequest, Generator
from ssd.tools.bench.runner import fixed_ssd

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
