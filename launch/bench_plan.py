"""Check SSD's start-up plan: the cluster with no flags against SD, AR and an SSD (K, budget) grid.

    python launch/bench_plan.py                                  # code and chat prompts, T = 0 and 0.7
    python launch/bench_plan.py --prompts 2 --max-new-tokens 48 --background-load --json plan_check.json

The cluster starts in SSD mode and plans (runtime.plan; the probes are cached
per host); AR and SD run in process on 1 and 2 threads (ssd.tools.bench.plan_check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from _bootstrap import ROOT  # noqa: E402 - first: the repository root on sys.path

from tqdm import tqdm  # noqa: E402

from ssd.tools.bench.background import busy_background  # noqa: E402
from ssd.tools.bench.plan_check import format_table, rows_for, run  # noqa: E402
from ssd.tools.prompts import load_prompt_set  # noqa: E402
from ssd.tools.bench.report import machine_info  # noqa: E402
from ssd.app.cli import add_config_args, config_from_args  # noqa: E402
from ssd.cluster.devices import default_cpu_placement  # noqa: E402
from ssd.cluster.runtime import Cluster  # noqa: E402
from ssd.factory import load_pair  # noqa: E402

GRID = [(2, 2), (2, 4), (3, 4), (3, 8), (4, 4), (4, 8)]


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
    sets = {name: [p.encode(pair.tokenizer) for p in load_prompt_set(ROOT / "configs" / "prompts" / f"{name}.yaml", args.prompts)]
            for name in args.prompt_sets}
    out: dict = {"machine": machine_info(), "background_load": args.background_load, "tables": []}
    with Cluster(config, default_cpu_placement(os.cpu_count() or 2, with_draft=True)) as cluster:
        if cluster.plan is not None:
            print(cluster.plan.summary())
            out["plan"] = dataclasses.asdict(cluster.plan.best) | {"sd_k": cluster.plan.sd_k,
                                                                 "sd_tokens_per_s": cluster.plan.sd_tokens_per_s}
        rows = rows_for(pair, cluster, config, GRID)
        total = len(rows) * sum(len(p) for p in sets.values()) * len(args.temperatures)
        with busy_background(args.background_load), tqdm(total=total, desc="plan check", file=sys.stderr) as bar:
            for name, prompts in sets.items():
                for t in args.temperatures:
                    results = run(rows, prompts, config.sampling, config, t, bar.update)
                    title = f"{name}, T={t}, {'one busy background process' if args.background_load else 'quiet'}"
                    print(format_table(results, title), flush=True)
                    out["tables"].append({"prompt_set": name, "temperature": t, "rows": results})
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
