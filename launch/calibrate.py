"""Measure what batched rounds cost here and print the K-by-batch-size policy
(speculation.k_policy) that gives batched SD the most tokens per second.

    python launch/calibrate.py                           # the real pair, batch sizes 1 2 4 8, K up to 6
    python launch/calibrate.py --batch-sizes 1 2 4 8 16 --k-max 8 --yaml k_policy.yaml

The acceptance rate a comes from a short SD run on the config's prompt
(per-token, the maximum-likelihood a of a geometric acceptance model), or
--acceptance. The policy maximises b * E_SD(a, K) / (verify(b, K + 1) +
draft(b, K)) per batch size b, with K = 0 (plain AR) a candidate, so
speculation never costs throughput where the measurements hold.
"""

from __future__ import annotations

import argparse
import logging
import sys

import yaml
from _common import add_config_args, config_from_args
from tqdm import tqdm

from ssd import hardware
from ssd.ablation.batch_costs import BatchCosts, acceptance_rate, measure_batch_costs
from ssd.engine.factory import LoadedPair, load_pair
from ssd.engine.request import GenerationRequest

log = logging.getLogger("calibrate")


def measure_acceptance(pair: LoadedPair, config, k: int) -> float:
    from dataclasses import replace

    engine = pair.engine(replace(config.speculation, mode="sd", k=k))
    prompt = pair.tokenizer.encode(config.prompt, add_special_tokens=False)
    out = engine.generate(GenerationRequest(prompt, config.sampling, config.generation))
    return acceptance_rate(out.stats)


def calibrate(pair: LoadedPair, config, batch_sizes: list[int], k_max: int, acceptance: float | None,
              repeats: int = 3, progress: bool = True) -> tuple[BatchCosts, float, dict[int, int]]:
    """(costs, a, k_policy) for the loaded pair."""
    a = acceptance if acceptance is not None else measure_acceptance(pair, config, config.speculation.k)
    probes = len(batch_sizes) * (2 * k_max + 1)
    with tqdm(total=repeats + 1, desc=f"timing {probes} batched forwards", disable=not progress) as bar:
        costs = measure_batch_costs(pair.target, pair.draft, batch_sizes, k_max, repeats=repeats, progress=bar.update)
    return costs, a, costs.k_policy(a, batch_sizes, k_max)


def main(argv: list[str] | None = None) -> dict[int, int]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--k-max", type=int, default=6)
    parser.add_argument("--acceptance", type=float, help="per-token acceptance rate (default: measured)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--yaml", help="write {speculation: {k_policy: ...}} here")
    parser.add_argument("--no-progress", action="store_true")
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    pair = load_pair(config)
    costs, a, policy = calibrate(pair, config, args.batch_sizes, args.k_max, args.acceptance, args.repeats,
                                 not args.no_progress)
    print(hardware.summary())
    print(costs.table())
    print(f"acceptance a = {a:.3f}; k_policy = {policy}")
    if args.yaml:
        with open(args.yaml, "w") as f:
            yaml.safe_dump({"speculation": {"k_policy": policy}}, f)
    return policy


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
