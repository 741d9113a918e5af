"""speculation.k_policy for the loaded pair, two ways: measure batched SD here and print the
K-by-batch-size policy that gives it the most tokens per second (also the serving bench's --adaptive).

    python launch/calibrate.py                           # the real pair, batch sizes 1 2 4 8, K 0 2 4 6
    python launch/calibrate.py --batch-sizes 1 2 4 8 16 --ks 0 2 4 --yaml k_policy.yaml
    python launch/calibrate.py --method model --k-max 6  # from the cost model instead

--method direct (the default): b rows of code prompts run together through
the batched SD engine for --tokens tokens at each K (K = 0: plain target
steps), and each batch size takes its fastest K: nothing is modelled, so
speculation never costs throughput where the measurement holds.
--method model: verify(b, n) and draft(b, k) are timed on random contexts
and the policy maximises b * E_SD(a, K) / (verify(b, K + 1) + draft(b, K)),
with a from a short SD run on the config's prompt (per token, the
maximum-likelihood a of a geometric acceptance model) or --acceptance; the
cost model is ssd.tools.ablation.batch_costs'. The model leaves out
per-round costs beyond the forwards, so it speculates more than the direct
method where the two disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import yaml
from tqdm import tqdm

from ssd import hardware
from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args

from ssd.tools.ablation.batch_costs import (
    BatchCosts, acceptance_rate, best_k_policy, format_k_throughput, measure_batch_costs, measure_k_throughput,
)
from ssd.config import Config
from ssd.factory import LoadedPair, load_pair, make_engine
from ssd.engine.request import GenerationRequest
from ssd.tools.prompts import load_prompt_set


def measure_acceptance(pair: LoadedPair, config: Config, k: int) -> float:
    """Per-token acceptance of SD at K on the config's prompt."""
    engine = make_engine("sd", pair, dataclasses.replace(config.speculation, k=k))
    prompt = pair.tokenizer.encode(config.prompt, add_special_tokens=False)
    out = engine.generate(GenerationRequest(prompt, config.sampling, config.generation))
    return acceptance_rate(out.stats)


def calibrate(pair: LoadedPair, config: Config, batch_sizes: list[int], k_max: int, acceptance: float | None,
              repeats: int = 3, progress: bool = True) -> tuple[BatchCosts, float, dict[int, int]]:
    """(costs, a, k_policy) for the loaded pair, from the cost model."""
    a = acceptance if acceptance is not None else measure_acceptance(pair, config, config.speculation.k)
    probes = len(batch_sizes) * (2 * k_max + 1)
    with tqdm(total=repeats + 1, desc=f"timing {probes} batched forwards", disable=not progress) as bar:
        costs = measure_batch_costs(pair.target, pair.draft, batch_sizes, k_max, repeats=repeats, progress=bar.update)
    return costs, a, costs.k_policy(a, batch_sizes, k_max)


def calibrate_direct(pair: LoadedPair, config: Config, prompts: list[list[int]], batch_sizes: list[int],
                     ks: list[int], tokens: int, progress: bool = True) -> tuple[str, dict[int, int]]:
    """(the measured tokens/s table, k_policy) from batched SD runs at each batch size and K."""
    with tqdm(total=len(batch_sizes) * len(ks), desc="batched SD by batch size and K", disable=not progress) as bar:
        rates = measure_k_throughput(pair, prompts, batch_sizes, ks, tokens, config.sampling, config.batching,
                                     bar.update)
    return format_k_throughput(rates), best_k_policy(rates)


# --- launch/calibrate.py ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--method", choices=["direct", "model"], default="direct")
    parser.add_argument("--ks", nargs="+", type=int, default=[0, 2, 4, 6], help="direct: the K values to run")
    parser.add_argument("--tokens", type=int, default=32, help="direct: tokens per row and run")
    parser.add_argument("--prompts", type=int, default=4, help="direct: prompts the rows cycle through")
    parser.add_argument("--prompt-file", type=Path, default=PROMPT_DIR / "code.yaml", help="direct: YAML prompt set")
    parser.add_argument("--k-max", type=int, default=6, help="model: the largest K considered")
    parser.add_argument("--acceptance", type=float, help="per-token acceptance rate (default: measured)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--yaml", help="write {speculation: {k_policy: ...}} here")
    parser.add_argument("--no-progress", action="store_true")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[int, int]:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    pair = load_pair(config)
    if args.method == "direct":
        prompts = [p.encode(pair.tokenizer) for p in load_prompt_set(args.prompt_file, args.prompts)]
        table, policy = calibrate_direct(pair, config, prompts, args.batch_sizes, args.ks, args.tokens,
                                         not args.no_progress)
        print(hardware.summary())
        print(table)
    else:
        costs, a, policy = calibrate(pair, config, args.batch_sizes, args.k_max, args.acceptance, args.repeats,
                                     not args.no_progress)
        print(hardware.summary())
        print(costs.table())
        print(f"acceptance a = {a:.3f}")
    print(f"k_policy = {policy}")
    if args.yaml:
        with open(args.yaml, "w") as f:
            yaml.safe_dump({"speculation": {"k_policy": policy}}, f)
    return policy
