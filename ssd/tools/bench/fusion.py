"""What fusing the int8 projections saves: one model, fused and unfused, timed interleaved.

An int8 layer pays a fixed cost per call (the per-row scaling around
fbgemm's kernel) on top of its matmul. Fused, a decoder layer calls four
int8 matmuls (qkv, o, gate+up, down) instead of seven. Both variants carry
the same weights bit for bit and give the same logits (tests/test_quant.py);
this measures only what the saving is worth, per forward on the lean
forward: a 1-token decode step and a (K+1)-token verification after a fixed
cached context. Variants alternate repeat by repeat, so a change of load
on the host touches both alike.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ssd.models.kv import KVSequence
from ssd.models.quant import fuse_projections


@dataclass
class FusionRow:
    tokens: int  # tokens per forward
    unfused_ms: float  # medians
    fused_ms: float

    @property
    def saving(self) -> float:
        """Share of the unfused forward's time the fusion saves."""
        return 1 - self.fused_ms / self.unfused_ms


def unfused_and_fused(int8_model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model as given, with separate int8 projections; a copy with them fused)."""
    return int8_model, fuse_projections(copy.deepcopy(int8_model))


@torch.inference_mode()
def compare(
    unfused: torch.nn.Module, fused: torch.nn.Module, k: int = 4, prefix: int = 200, repeats: int = 30,
) -> list[FusionRow]:
    """Median ms of a 1-token and a (k+1)-token forward after `prefix` cached tokens, per variant."""
    vocab = unfused.config.vocab_size
    context = [(1000 + i) % vocab for i in range(prefix)]
    caches = [KVSequence(m) for m in (unfused, fused)]
    for kv in caches:
        kv.forward(context, last_only=True)
    rows = []
    for n in (1, k + 1):
        ids = [(7 + i) % vocab for i in range(n)]
        times: list[list[float]] = [[], []]
        for rep in tqdm(range(repeats + 1), desc=f"{n}-token forwards", leave=False):
            for which, kv in enumerate(caches):
                started = time.perf_counter()
                kv.forward(ids)
                elapsed = time.perf_counter() - started
                kv.rollback(prefix)
                if rep:  # the first round warms up
                    times[which].append(elapsed)
        rows.append(FusionRow(n, 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1])))
    return rows


def format_rows(name: str, rows: list[FusionRow]) -> str:
    lines = [f"{name}: tokens | unfused ms | fused ms | saved"]
    lines += [f"  {r.tokens:>2} | {r.unfused_ms:8.2f} | {r.fused_ms:8.2f} | {100 * r.saving:5.1f}%" for r in rows]
    return "\n".join(lines)
