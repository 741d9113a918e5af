"""AR, SD and SSD side by side on the same prompts, in one run; prints a ratio table.

    python launch/bench.py                          # default pair: AR and SD at the config's K
    python launch/bench.py --ks 3 --ks 4 --ks 6 --prompts 3 --max-new-tokens 64
    python launch/bench.py --modes ar sd ssd --thread-counts 1 2 --cluster

--thread-counts runs the in-process modes once per thread count (each row labelled
with it), so SSD's gain over AR and SD is not an idle-core artefact.
--cluster runs SSD through the distributed runtime (target on core 0, draft
on core 1, gloo link) instead of in-process threads.

Each prompt is generated once per mode after one warm-up generation; tokens/s
counts decode only (after the first token). Ratios are against AR from the
same run, since this machine is noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from _common import ROOT, add_config_args, config_from_args

from ssd.engine.factory import encode_prompt, load_pair
from ssd.engine.metrics import GenerationStats

PROMPTS = ROOT / "configs" / "prompts" / "code.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-file", type=Path, default=PROMPTS)
    parser.add_argument("--prompts", type=int, default=3, help="how many prompts of the file")
    parser.add_argument("--ks", type=int, action="append", help="K values for SD/SSD (repeatable)")
    parser.add_argument("--modes", nargs="+", default=["ar", "sd"], choices=["ar", "sd", "ssd"])
    parser.add_argument("--json", type=Path, help="write per-run stats here")
    parser.add_argument("--thread-counts", dest="thread_counts", nargs="+", type=int,
                        help="torch thread counts for the in-process modes (default: torch's)")
    parser.add_argument("--cluster", action="store_true", help="run SSD through the distributed runtime")
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    ks = args.ks or [config.speculation.k]
    prompts = yaml.safe_load(args.prompt_file.read_text())[: args.prompts]
    runs = [dataclasses.replace(config.speculation, mode="ar")] * ("ar" in args.modes) + [
        dataclasses.replace(config.speculation, mode=mode, k=k)
        for mode in args.modes if mode != "ar" for k in ks
    ]
    local = [r for r in runs if not (args.cluster and r.mode == "ssd")]
    results: dict[str, list[GenerationStats]] = {}
    if local:
        results |= run_local(config, local, prompts, args.thread_counts or [0])
    if len(local) < len(runs):
        results |= run_cluster(config, [r for r in runs if r not in local], prompts)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({m: [s.as_dict() for s in r] for m, r in results.items()}, indent=2))


def run_local(config, runs, prompts, thread_counts) -> dict[str, list[GenerationStats]]:
    """Every run in this process, once per thread count (0: torch's default)."""
    pair = load_pair(config)
    encoded = [encode_prompt(pair.tokenizer, p) for p in prompts]
    results: dict[str, list[GenerationStats]] = {}
    with tqdm(total=len(runs) * len(encoded) * len(thread_counts), desc="bench", file=sys.stderr) as bar:
        for threads in thread_counts:
            if threads:
                torch.set_num_threads(threads)
            with pair.engine(dataclasses.replace(runs[0], mode="ar")) as warm_up:
                warm_up.generate(encoded[0], config.sampling, dataclasses.replace(config.generation, max_new_tokens=4))
            for spec in runs:
                label = _label(spec) + (f" t={threads}" if threads else "")
                with pair.engine(spec) as engine:
                    for ids in encoded:
                        results.setdefault(label, []).append(engine.generate(ids, config.sampling, config.generation).stats)
                        bar.update()
    del pair
    gc.collect()  # free the weights before a cluster loads its own copies
    return results


def run_cluster(config, runs, prompts) -> dict[str, list[GenerationStats]]:
    """SSD through Ray actors: the target on core 0, the draft on core 1."""
    from ssd.cluster.devices import default_cpu_placement
    from ssd.cluster.runtime import Cluster

    results: dict[str, list[GenerationStats]] = {}
    with Cluster(config, default_cpu_placement(os.cpu_count() or 2, with_draft=True)) as cluster:
        encoded = [cluster.encode(p) for p in prompts]
        cluster.generate(encoded[0], config.sampling, dataclasses.replace(config.generation, max_new_tokens=8), runs[0])
        with tqdm(total=len(runs) * len(encoded), desc="bench cluster", file=sys.stderr) as bar:
            for spec in runs:
                for ids in encoded:
                    stats = cluster.generate(ids, config.sampling, config.generation, spec).stats
                    results.setdefault(_label(spec) + " cluster", []).append(stats)
                    bar.update()
    return results


def _label(spec) -> str:
    return spec.mode if spec.mode == "ar" else f"{spec.mode} K={spec.k}"


def report(results: dict[str, list[GenerationStats]]) -> str:
    """A table: decode tokens/s (total tokens / total decode time), ratios to the best AR and SD."""
    rows = {label: _aggregate(stats) for label, stats in results.items()}
    ar = [v["tok_s"] for k, v in rows.items() if k.startswith("ar")]
    sd = [v["tok_s"] for k, v in rows.items() if k.startswith("sd")]
    best_ar, best_sd = (max(ar) if ar else None), (max(sd) if sd else None)
    lines = [
        f"{'mode':<22} {'tok/s':>7} {'x best AR':>9} {'x best SD':>9} {'accept':>7} "
        f"{'tok/round':>9} {'hit rate':>8} {'wait/hit':>8} {'TTFT ms':>8}"
    ]
    for label, row in rows.items():
        ssd = label.startswith("ssd")
        lines.append(
            f"{label:<22} {row['tok_s']:>7.2f} {_ratio(row['tok_s'], best_ar):>9} {_ratio(row['tok_s'], best_sd):>9} "
            f"{row['accept']:>7.3f} {row['per_round']:>9.2f} {row['hit_rate'] if ssd else '-':>8} "
            f"{row['wait_hit'] if ssd else '-':>8} {row['ttft_ms']:>8.0f}"
        )
    return "\n".join(lines)


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def _aggregate(stats: list[GenerationStats]) -> dict[str, float]:
    decode_s = sum(s.total_s - s.time_to_first_token_s for s in stats)
    decode_tokens = sum(s.new_tokens - 1 for s in stats)
    rounds = sum(s.rounds for s in stats)
    drafted = sum(s.drafted for s in stats)
    return {
        "tok_s": decode_tokens / decode_s,
        "accept": sum(s.accepted for s in stats) / drafted if drafted else 0.0,
        "per_round": decode_tokens / rounds if rounds else 0.0,
        "ttft_ms": 1000 * sum(s.time_to_first_token_s for s in stats) / len(stats),
        "hit_rate": f"{sum(s.spec.hits for s in stats) / max(1, sum(s.spec.lookups for s in stats)):.3f}",
        # Share of hit rounds' time the target spent waiting for the draft.
        "wait_hit": f"{sum(s.spec.wait_hit_s for s in stats) / max(1e-9, sum(s.spec.wait_hit_s + s.spec.verify_hit_s for s in stats)):.3f}",
    }


if __name__ == "__main__":
    main()
