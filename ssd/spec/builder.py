"""Building the speculation cache while the target verifies.

One draft pass over [t', s1..sK] (the "glue") gives the draft's distribution
at every acceptance length k; the top-F_k tokens there (for k < K without
s_{k+1}, which a rejection can never produce) are the guessed outcomes
(k, t*). Then K decode steps run for all guessed branches at once.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.kv import KVSequence
from ssd.sampling import probs_from_logits, sample
from ssd.spec.branches import BranchDecoder
from ssd.spec.cache import Speculation
from ssd.spec.drafting import Saguaro

Entries = dict[tuple[int, int], Speculation]


def guessed_outcomes(glue_logits: torch.Tensor, drafted: Sequence[int], fanout: Sequence[int]) -> list[tuple[int, int]]:
    """(k, t*) pairs to prepare: the top-F_k draft tokens at each acceptance length.

    Ranked by raw logits, so greedy decoding (one-hot q) still gets F_k
    distinct guesses per position.
    """
    branches = []
    for k, f in enumerate(fanout):
        if f <= 0:
            continue
        row = glue_logits[k]
        if k < len(drafted):
            row = row.clone()
            row[drafted[k]] = float("-inf")
        branches += [(k, int(t)) for t in torch.topk(row, min(f, row.shape[-1] - 1)).indices]
    return branches


def glue_pass(kv: KVSequence, committed: Sequence[int], drafted: Sequence[int]) -> torch.Tensor:
    """Draft logits [K+1, V] after committed[-1] and after each drafted token."""
    kv.trim_to_prefix_of(committed)
    sequence = list(committed) + list(drafted)
    rows = kv.forward(sequence[kv.length :])
    return rows[-(len(drafted) + 1) :]


def build_cache(
    kv: KVSequence,
    decoder: BranchDecoder,
    committed: Sequence[int],
    drafted: Sequence[int],
    fanout: Sequence[int],
    sampling: SamplingConfig,
    gen: torch.Generator,
    saguaro: Saguaro | None = None,
) -> Entries:
    """Speculations for every guessed outcome of verifying `drafted` after `committed`.

    fanout: F_k for k = 0..K. saguaro: Saguaro sampling for the prepared
    speculations, with the schedule that will be in force when one of them is
    verified (the after-hit schedule).
    """
    k = len(drafted)
    branches = guessed_outcomes(glue_pass(kv, committed, drafted), drafted, fanout)
    if not branches:
        return {}
    prefix_lens = [len(committed) + kb for kb, _ in branches]
    logits = decoder.start(kv, prefix_lens, [t for _, t in branches])
    tokens: list[list[int]] = [[] for _ in branches]
    rows: list[list[torch.Tensor]] = [[] for _ in branches]
    try:
        for step in range(k):
            if step:
                logits = decoder.step([seq[-1] for seq in tokens])
            for b, row in enumerate(_proposals(logits, sampling, saguaro, step)):
                tokens[b].append(int(logits[b].argmax()) if row is None else sample(row, gen))
                if row is not None:
                    rows[b].append(row)
    finally:
        decoder.finish()
    return {
        key: Speculation(tokens[b], torch.stack(rows[b]) if rows[b] else None, "cache")
        for b, key in enumerate(branches)
    }


def _proposals(
    logits: torch.Tensor, sampling: SamplingConfig, saguaro: Saguaro | None, step: int
) -> list[torch.Tensor | None]:
    """Per-branch q rows to sample from (None for greedy: take the argmax)."""
    if sampling.greedy:
        return [None] * logits.shape[0]
    q = probs_from_logits(logits, sampling)
    return [row if saguaro is None else saguaro.apply(row, step) for row in q]
