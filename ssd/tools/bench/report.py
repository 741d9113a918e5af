"""Benchmark results -> aggregate rows, ratio tables, the physical limit, JSON / CSV / PNG.

Rows are grouped by (prompt set, temperature). Within a group every row gets
its speed over the best AR row ("x AR") and two SD baselines, because two
questions are asked of SSD (which holds one core for the target and one for
the draft):
- "x SD1": over SD on one core, the paper's setting (AR and SD on the
  target's devices; SSD adds one device for the draft);
- "x SDbest": over the best SD at any thread count, i.e. equal total hardware
  when SD may use both cores.
Each row names its precision (target/draft) and its cores ("1+1": one each).

Physical limit of the pair on this machine: if every round were a cache hit,
a round would cost one verification and nothing else, so

    limit tok/s = E[tokens per round] / T_verify

with both measured on the group's SSD row (the fastest, if several), or on
the SD row when SSD was not run. "x limit" is each row's share of it.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ssd import hardware
from ssd.tools.bench.runner import MODES, Results, RunKey, Sample
from ssd.engine.metrics import total

log = logging.getLogger(__name__)

# Aggregate row fields, in CSV column order.
FIELDS = (
    "prompt_set", "temperature", "mode", "name", "label", "precision", "k", "threads", "prompts", "new_tokens",
    "tok_s", "ms_per_token", "ttft_ms", "accepted_len", "acceptance", "tokens_per_round",
    "hit_rate", "wait_hit", "t_verify_ms", "x_ar", "x_sd1", "x_sd", "x_limit",
)


@dataclass(frozen=True)
class Limit:
    """The physical limit of one (prompt set, temperature) group."""

    tokens_per_round: float
    t_verify_s: float
    source: str  # the row it was measured on

    @property
    def tok_s(self) -> float:
        return self.tokens_per_round / self.t_verify_s


def aggregate(key: RunKey, samples: list[Sample]) -> dict[str, Any]:
    """One row: totals over the prompts (decode tokens / decode time, not a mean of rates)."""
    stats = total((s.stats for s in samples), mode=key.mode)
    decode_tokens = sum(s.decode_tokens for s in samples)
    decode_s = sum(s.decode_s for s in samples)
    tok_s = decode_tokens / decode_s if decode_s > 0 else 0.0
    ssd = key.mode == "ssd"
    spec, rounds = stats.spec, stats.rounds
    hit_busy = spec.wait_hit_s + spec.verify_hit_s
    return {
        "prompt_set": key.prompt_set,
        "temperature": key.temperature,
        "mode": key.mode,
        "name": key.name,
        "label": key.label,
        "precision": _short_precision(stats.precision),
        "k": key.k,
        "threads": key.threads_label,
        "prompts": len(samples),
        "new_tokens": stats.new_tokens,
        "tok_s": tok_s,
        "ms_per_token": 1000 / tok_s if tok_s else None,
        "ttft_ms": 1000 * stats.time_to_first_token_s / stats.requests if stats.requests else None,
        "accepted_len": stats.mean_accepted_length if key.k and rounds else None,
        "acceptance": stats.acceptance_rate if stats.drafted else None,
        "tokens_per_round": decode_tokens / rounds if rounds else None,
        "hit_rate": spec.hit_rate if ssd and spec.lookups else None,
        # Share of hit rounds' time the target spent waiting for the draft.
        "wait_hit": spec.wait_fraction_on_hits if ssd and hit_busy else None,
        # The target's time per round; the physical limit uses it from SD/SSD rows.
        "t_verify_ms": 1000 * stats.target_s / rounds if key.k and stats.target_s and rounds else None,
    }


def summarize(results: Results) -> tuple[list[dict[str, Any]], dict[tuple[str, float], Limit | None]]:
    """Aggregate rows with ratios and limit fractions, and each group's limit."""
    order = {mode: i for i, mode in enumerate(MODES)}
    keys = sorted(
        (k for k, v in results.items() if v),
        key=lambda k: (order.get(k.mode, len(order)), k.k, k.cluster, k.threads),
    )
    rows = [aggregate(key, results[key]) for key in keys]
    limits: dict[tuple[str, float], Limit | None] = {}
    for group, members in _groups(rows).items():
        best_ar = _best(members, "ar")
        best_sd = _best(members, "sd")
        sd_one_core = _best([r for r in members if r["threads"] == "1"], "sd")
        limit = limits[group] = physical_limit(members)
        for row in members:
            row["x_ar"] = row["tok_s"] / best_ar if best_ar else None
            row["x_sd"] = row["tok_s"] / best_sd if best_sd else None
            row["x_sd1"] = row["tok_s"] / sd_one_core if sd_one_core else None
            row["x_limit"] = row["tok_s"] / limit.tok_s if limit else None
    return rows, limits


def physical_limit(rows: list[dict[str, Any]]) -> Limit | None:
    """E[tokens/round] / T_verify from the fastest SSD row with timings, else the fastest SD row."""
    for mode in ("ssd", "sd"):
        timed = [r for r in rows if r["mode"] == mode and r["t_verify_ms"] and r["tokens_per_round"]]
        if timed:
            row = max(timed, key=lambda r: r["tok_s"])
            return Limit(row["tokens_per_round"], row["t_verify_ms"] / 1000, row["label"])
    return None


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["prompt_set"], row["temperature"]), []).append(row)
    return groups


def _short_precision(precision: str) -> str:
    """ "target int8, draft int8" -> "int8/int8"; "target bf16" -> "bf16"; other text as is."""
    parts = [p.split()[-1] for p in precision.split(", ") if p.startswith(("target ", "draft "))]
    return "/".join(parts) if parts else precision


def _best(rows: list[dict[str, Any]], mode: str) -> float | None:
    speeds = [r["tok_s"] for r in rows if r["mode"] == mode and r["tok_s"]]
    return max(speeds) if speeds else None


# ------------------------------------------------------------------ text table

_COLUMNS = (  # header, field, width, format
    ("mode", "name", 16, "{}"),
    ("precision", "precision", 9, "{}"),
    ("cores", "threads", 7, "{}"),
    ("tok/s", "tok_s", 7, "{:.2f}"),
    ("ms/tok", "ms_per_token", 7, "{:.1f}"),
    ("TTFT ms", "ttft_ms", 8, "{:.0f}"),
    ("acc len", "accepted_len", 7, "{:.2f}"),
    ("accept", "acceptance", 6, "{:.3f}"),
    ("tok/round", "tokens_per_round", 9, "{:.2f}"),
    ("hit rate", "hit_rate", 8, "{:.3f}"),
    ("wait/hit", "wait_hit", 8, "{:.1%}"),
    ("x AR", "x_ar", 5, "{:.2f}"),
    ("x SD1", "x_sd1", 5, "{:.2f}"),
    ("x SDbest", "x_sd", 8, "{:.2f}"),
    ("x limit", "x_limit", 7, "{:.2f}"),
)


def format_tables(rows: list[dict[str, Any]], limits: dict[tuple[str, float], Limit | None]) -> str:
    """One table per (prompt set, temperature), after a line naming the machine; '-' where a measure does not apply."""
    blocks = [f"machine: {hardware.summary()}"]
    for group, members in _groups(rows).items():
        blocks.append("\n".join([_title(group, limits.get(group)), _header(), *(_line(r) for r in members)]))
    return "\n\n".join(blocks)


def _title(group: tuple[str, float], limit: Limit | None) -> str:
    title = f"prompt set {group[0]!r}, temperature {group[1]:g}"
    if limit is None:
        return title + ": physical limit - (needs an SD or SSD row)"
    return (
        f"{title}: physical limit {limit.tok_s:.2f} tok/s = {limit.tokens_per_round:.2f} tok/round"
        f" / {1000 * limit.t_verify_s:.0f} ms verify (from {limit.source})"
    )


def _header() -> str:
    return " ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, _, w, _) in enumerate(_COLUMNS))


def _line(row: dict[str, Any]) -> str:
    cells = []
    for i, (_, name, width, fmt) in enumerate(_COLUMNS):
        value = row.get(name)
        text = "-" if value is None else fmt.format(value)
        cells.append(f"{text:<{width}}" if i == 0 else f"{text:>{width}}")
    return " ".join(cells)


# ------------------------------------------------------------------ files


def machine_info() -> dict[str, Any]:
    import transformers

    return {
        **hardware.describe(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def write_json(
    path: Path, results: Results, rows: list[dict[str, Any]],
    limits: dict[tuple[str, float], Limit | None], settings: dict[str, Any] | None = None,
) -> None:
    """Everything: machine, settings, aggregates, limits and every generation's stats."""
    payload = {
        "machine": machine_info(),
        "settings": settings or {},
        "aggregates": rows,
        "limits": [
            {"prompt_set": g[0], "temperature": g[1], **({
                "tok_s": lim.tok_s, "tokens_per_round": lim.tokens_per_round,
                "t_verify_s": lim.t_verify_s, "source": lim.source,
            } if lim else {"tok_s": None})}
            for g, lim in limits.items()
        ],
        "runs": [
            {
                **{f: getattr(key, f) for f in ("prompt_set", "temperature", "mode", "k", "threads", "cluster")},
                "label": key.label,
                "samples": [
                    {"prompt_index": s.prompt_index, "first_tokens": s.first_tokens,
                     "token_ids": s.token_ids, "stats": s.stats.as_dict()}
                    for s in samples
                ],
            }
            for key, samples in results.items()
        ],
    }
    Path(path).write_text(json.dumps(payload, indent=2))


def small_bench_parser(doc: str | None, config: Path) -> Any:
    """A small bench's command line: --config (default `config`), --backend, --threads,
    --no-llamacpp (leave the plain llama.cpp peer out) and --out; the bench adds its own."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--backend", choices=["auto", "llamacpp", "torch"], default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llamacpp", action="store_true", help="leave plain llama.cpp out")
    parser.add_argument("--out", type=Path, help="write OUT.txt (the table) and OUT.json")
    return parser


def small_bench_config(args: Any) -> Any:
    """A small bench's config: `args.config` with `args.backend` for the target and
    `args.threads`; warnings logged."""
    from ssd.config import load_config

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return load_config(args.config, {"target": {"backend": args.backend}, "runtime": {"threads": args.threads}})


def command_line(script: str, argv: list[str] | None) -> str:
    """The command a small bench's report names: `script` (launch/NAME.py) and its arguments
    (sys.argv's, when main() was not handed its own)."""
    return " ".join([f"python {script}", *(sys.argv[1:] if argv is None else argv)])


def print_and_save(command: str, table: str, result: dict[str, Any], out: Path | None) -> None:
    """A small bench's report: the command line that made it, then its table; with `out`,
    also OUT.txt (the same) and OUT.json (`result`)."""
    text = f"$ {command}\n{table}"
    print(text)
    if out:
        out.with_suffix(".txt").write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """The aggregate rows, one per (prompt set, temperature, mode run); empty cell = n/a."""
    with Path(path).open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({f: "" if row.get(f) is None else row[f] for f in FIELDS})


def plot_throughput(
    path: Path, rows: list[dict[str, Any]], limits: dict[tuple[str, float], Limit | None] | None = None
) -> None:
    """Grouped bars: decode tok/s per row label, one group per (prompt set, temperature);
    a dashed line over each group marks its physical limit.

    Uses the Agg canvas directly, so no pyplot backend or global figure state.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = _groups(rows)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / max(1, len(labels))
    fig = Figure(figsize=(max(7.0, 3.0 + 0.4 * len(groups) * len(labels)), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    palette = matplotlib.colormaps["tab20"]  # 20 distinct colours: rows must not share one
    for j, label in enumerate(labels):
        speeds = [next((r["tok_s"] for r in members if r["label"] == label), 0.0) for members in groups.values()]
        ax.bar([i + (j - (len(labels) - 1) / 2) * width for i in range(len(groups))], speeds, width, label=label,
               color=palette(j % palette.N))
    marked = [(i, limits[g]) for i, g in enumerate(groups) if limits and limits.get(g)]
    for n, (i, limit) in enumerate(marked):
        ax.hlines(limit.tok_s, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                  label=None if n else "physical limit")
    ax.set_xticks(range(len(groups)), [f"{name}\nT={t:g}" for name, t in groups])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Throughput by mode")
    fig.legend(loc="outside right upper", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)
