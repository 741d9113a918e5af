"""AR, SD (and SSD) side by side on the same prompts, in one run; prints a ratio table.

    python launch/bench.py                          # default pair: AR and SD at the config's K
    python launch/bench.py --ks 3 --ks 4 --ks 6 --prompts 3 --max-new-tokens 64
    python launch/bench.py --modes ar sd ssd --budget 8

Each prompt is generated once per mode after one warm-up generation; tokens/s
counts decode only (after the first token). Ratios are against AR from the
same run, since this machine is noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

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
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    ks = args.ks or [config.speculation.k]

    pair = load_pair(config)
    prompts = yaml.safe_load(args.prompt_file.read_text())[: args.prompts]
    encoded = [encode_prompt(pair.tokenizer, p) for p in prompts]
    runs = [dataclasses.replace(config.speculation, mode="ar")] * ("ar" in args.modes) + [
        dataclasses.replace(config.speculation, mode=mode, k=k)
        for mode in args.modes if mode != "ar" for k in ks
    ]
    warm_up = pair.engine(dataclasses.replace(config.speculation, mode="sd"))
    warm_up.generate(encoded[0], config.sampling, config.generation)
    warm_up.close()
    results: dict[str, list[GenerationStats]] = {}
    with tqdm(total=len(runs) * len(encoded), desc="bench", file=sys.stderr) as bar:
        for spec in runs:
            engine = pair.engine(spec)
            label = spec.mode if spec.mode == "ar" else f"{spec.mode} K={spec.k}"
            for ids in encoded:
                stats = engine.generate(ids, config.sampling, config.generation).stats
                results.setdefault(label, []).append(stats)
                bar.update()
            engine.close()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({m: [s.as_dict() for s in r] for m, r in results.items()}, indent=2))


def report(results: dict[str, list[GenerationStats]]) -> str:
    """A table: decode tokens/s (total tokens / total decode time), acceptance, ratio to AR."""
    rows = {label: _aggregate(stats) for label, stats in results.items()}
    base = rows.get("ar", next(iter(rows.values())))["tok_s"]
    lines = [
        f"{'mode':<10} {'tok/s':>7} {'x' + ('AR' if 'ar' in rows else 'first'):>7} {'accept':>7} "
        f"{'tok/round':>9} {'hit rate':>8} {'TTFT ms':>8}"
    ]
    for label, row in rows.items():
        hit = f"{row['hit_rate']:.3f}" if label.startswith("ssd") else "-"
        lines.append(
            f"{label:<10} {row['tok_s']:>7.2f} {row['tok_s'] / base:>7.2f} "
            f"{row['accept']:>7.3f} {row['per_round']:>9.2f} {hit:>8} {row['ttft_ms']:>8.0f}"
        )
    return "\n".join(lines)


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
        "hit_rate": sum(s.spec.hits for s in stats) / max(1, sum(s.spec.lookups for s in stats)),
    }


if __name__ == "__main__":
    main()
