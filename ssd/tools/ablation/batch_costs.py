"""What a batched round costs on this machine, by batch size: the inputs of
the batch-aware policy (ssd.saguaro.batch_policy), and the direct measurement the K
policy is chosen from (tokens/s of batched SD at each batch size and K).

Measured on the loaded pair with the batched engines' own forwards
(ssd.models.kv.forward_rows, ssd.engine.drafting.draft_chains):
- verify(b, n): one packed target forward of n tokens for each of b rows,
  every row after its own `prefix`-token context (n = 1 is an AR step);
- draft(b, k): k batched draft steps for b rows (a chain of k after a round:
  its cache lacks only the last token).
Each is the median of `repeats` timed runs after one warm-up, all probes
timed in turn each pass (a shared host's drift moves them alike). Unmeasured
batch sizes interpolate linearly between measured ones (and extrapolate from
the last two).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ssd import hardware
from ssd.saguaro.costs import chain_rows_probe, prefilled_rows, round_robin, verify_rows_probe
from ssd.saguaro.batch_policy import k_by_batch
from ssd.config import SamplingConfig
from ssd.engine.metrics import GenerationStats

log = logging.getLogger(__name__)


@dataclass
class BatchCosts:
    """Seconds per batched round: verify[(b, n)] and draft[(b, k)] as measured."""

    verify: dict[tuple[int, int], float]
    draft: dict[tuple[int, int], float]
    meta: dict[str, Any] = field(default_factory=dict)

    def verify_s(self, b: int, tokens: int) -> float:
        return _by_batch(self.verify, b, tokens)

    def draft_s(self, b: int, k: int) -> float:
        return 0.0 if k == 0 else _by_batch(self.draft, b, k)

    def k_policy(self, acceptance: float, batch_sizes: list[int], k_max: int) -> dict[int, int]:
        """speculation.k_policy: the best K at each batch size, as thresholds
        (a batch size is listed where the choice changes)."""
        chosen = k_by_batch(self.verify_s, self.draft_s, acceptance, sorted(batch_sizes), k_max)
        policy: dict[int, int] = {}
        for b, k in chosen.items():
            if not policy or list(policy.values())[-1] != k:
                policy[b] = k
        return policy

    def table(self) -> str:
        """verify and draft seconds per batch size, in milliseconds (markdown)."""
        sizes = sorted({b for b, _ in self.verify})
        lengths = sorted({n for _, n in self.verify})
        ks = sorted({k for _, k in self.draft})
        head = ["rows"] + [f"verify {n} tok" for n in lengths] + [f"draft {k}" for k in ks]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for b in sizes:
            cells = [f"{1000 * self.verify[(b, n)]:.1f}" for n in lengths] + [f"{1000 * self.draft[(b, k)]:.1f}" for k in ks]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def acceptance_rate(stats: GenerationStats) -> float:
    """Per-token acceptance a of SD rounds: accepted drafts over drafts reached
    (a rejection ends a round's reach), the maximum-likelihood a of a
    geometric acceptance model."""
    reached = [stats.rounds] + stats.accepted_at[:-1]
    total = sum(reached[: len(stats.accepted_at)])
    return sum(stats.accepted_at) / total if total else 0.0


def _by_batch(table: dict[tuple[int, int], float], b: int, n: int) -> float:
    """Exact where measured; else linear in b between the measured sizes for this n."""
    if (b, n) in table:
        return table[(b, n)]
    points = sorted((size, s) for (size, m), s in table.items() if m == n)
    if not points:
        raise KeyError(f"no measurement with {n} tokens per row")
    sizes, seconds = zip(*points)
    if len(points) == 1:
        return seconds[0] * b / sizes[0]
    if b > sizes[-1]:  # extrapolate from the last two sizes
        slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
        return seconds[-1] + slope * (b - sizes[-1])
    return float(np.interp(b, sizes, seconds))


def measure_batch_costs(
    target: torch.nn.Module, draft: torch.nn.Module, batch_sizes: list[int], k_max: int,
    prefix: int = 64, repeats: int = 3, seed: int = 0, progress: Callable[[], None] | None = None,
) -> BatchCosts:
    """Time packed target forwards and batched draft chains on the pair (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    probes: dict[Any, tuple[Callable, Callable]] = {}
    for b in batch_sizes:
        contexts = [torch.randint(vocab, (prefix,), generator=gen).tolist() for _ in range(b)]
        targets = prefilled_rows(target, contexts)
        drafts = prefilled_rows(draft, contexts)
        for n in range(1, k_max + 2):
            probes[("verify", b, n)] = verify_rows_probe(targets, contexts, n, vocab, gen)
        for k in range(1, k_max + 1):
            probes[("draft", b, k)] = chain_rows_probe(drafts, contexts, k, seed)
    timed = round_robin(probes, repeats, progress or (lambda: None))
    return BatchCosts(
        verify={(b, n): s for (kind, b, n), s in timed.items() if kind == "verify"},
        draft={(b, k): s for (kind, b, k), s in timed.items() if kind == "draft"},
        meta={"prefix": prefix, "repeats": repeats, "machine": hardware.describe(), "threads": torch.get_num_threads()},
    )


def measure_k_throughput(
    pair, prompts: list[list[int]], batch_sizes: list[int], ks: list[int], tokens: int,
    sampling: SamplingConfig, batching, tick: Callable[[], None] = lambda: None,
) -> dict[tuple[int, int], float]:
    """Tokens/s of batched SD with draft length K (0: plain target steps) at each
    batch size: b rows of the given prompts run together for `tokens` tokens each.

    The direct measurement of what the K policy decides: it needs no cost model
    and no acceptance estimate, and it includes every per-round cost the model
    leaves out. The K values of one batch size run back to back (a drifting
    host moves the values compared together)."""
    from ssd.config import GenerationConfig, SpeculationConfig
    from ssd.factory import make_engine
    from ssd.engine.request import GenerationRequest

    generation = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    rates = {}
    for b in batch_sizes:
        for k in ks:
            spec = SpeculationConfig(mode="sd", k=max(k, 1), k_policy={1: k})
            engine = make_engine("sd", pair, spec, batching)
            for i in range(b):
                engine.admit(GenerationRequest(prompts[i % len(prompts)], sampling, generation, spec))
            started, made = time.perf_counter(), 0
            while engine.rows:
                made += sum(len(f.result.token_ids) for f in engine.step() if f.error is None)
            rates[(b, k)] = made / (time.perf_counter() - started)
            tick()
    return rates


def best_k_policy(rates: dict[tuple[int, int], float]) -> dict[int, int]:
    """speculation.k_policy from measured tokens/s: the fastest K at each batch
    size (ties to the smaller K), listed where the choice changes."""
    policy: dict[int, int] = {}
    for b in sorted({b for b, _ in rates}):
        best = max((k for bb, k in rates if bb == b), key=lambda k: (rates[(b, k)], -k))
        if not policy or list(policy.values())[-1] != best:
            policy[b] = best
    return policy


def format_k_throughput(rates: dict[tuple[int, int], float]) -> str:
    ks = sorted({k for _, k in rates})
    lines = ["| rows | " + " | ".join(f"K={k} tok/s" for k in ks) + " |", "|" + "---|" * (len(ks) + 1)]
    for b in sorted({b for b, _ in rates}):
        lines.append(f"| {b} | " + " | ".join(f"{rates[(b, k)]:.1f}" for k in ks) + " |")
    return "\n".join(lines)
