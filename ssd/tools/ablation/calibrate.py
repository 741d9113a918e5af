"""speculation.k_policy for the loaded pair, two ways (launch/calibrate.py, the serving bench's --adaptive).

direct: batched SD runs at each batch size and K, each batch size taking its
fastest K (nothing modelled). model: batched forwards timed on random
contexts, K chosen by the cost model of ssd.tools.ablation.batch_costs with an
acceptance rate measured by a short SD run.
"""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from ssd.tools.ablation.batch_costs import (
    BatchCosts, acceptance_rate, best_k_policy, format_k_throughput, measure_batch_costs, measure_k_throughput,
)
from ssd.config import Config
from ssd.factory import LoadedPair, make_engine
from ssd.engine.request import GenerationRequest


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
