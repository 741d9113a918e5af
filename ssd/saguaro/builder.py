"""Building the speculation cache while the target verifies.

One draft pass over [t', s1..sK] (the "glue") gives the draft's distribution
at every acceptance length k; the top-F_k tokens there (for k < K without
s_{k+1}, which a rejection can never produce) are the guessed outcomes
(k, t*). Then K decode steps run for all guessed branches at once.

Everything stays on the draft's device: each step's sampled ids feed the next
step from there, and the host reads the guesses once and every branch's
tokens once, at the end.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.kv import KVSequence, token_tensor
from ssd.sampling import as_drawn, probs_from_logits, sample_ids
from ssd.saguaro.branches import BranchDecoder
from ssd.saguaro.cache import Proposal
from ssd.saguaro.sampling import Saguaro

Entries = dict[tuple[int, int], Proposal]


def guessed_outcomes(glue_logits: torch.Tensor, drafted: Sequence[int], fanout: Sequence[int]) -> list[tuple[int, int]]:
    """(k, t*) pairs to prepare: the top-F_k draft tokens at each acceptance length.

    Ranked by raw logits, so greedy decoding (one-hot q) still gets F_k
    distinct guesses per position. One top-k over all rows, one host read.
    """
    vocab = glue_logits.shape[-1]
    widest = max(fanout, default=0)
    if widest <= 0:
        return []
    # One spare candidate per row: a rejection never yields the drafted token.
    ranked = torch.topk(glue_logits[: len(fanout)], min(widest + 1, vocab), dim=-1).indices.tolist()
    branches = []
    for k, f in enumerate(fanout):
        if f <= 0:
            continue
        if k < len(drafted):  # V - 1 candidates here
            branches += [(k, t) for t in ranked[k] if t != drafted[k]][: min(f, vocab - 1)]
        else:
            branches += [(k, t) for t in ranked[k][: min(f, vocab)]]
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
    steps: list[torch.Tensor] = []  # [step] -> [B] ids on the draft's device
    q_steps: list[torch.Tensor] = []  # [step] -> [B, V]
    try:
        for step in range(k):
            if step:
                logits = decoder.step(steps[-1])
            if sampling.greedy:
                steps.append(logits.argmax(dim=-1))
                continue
            q = probs_from_logits(logits, sampling)
            if saguaro is not None:
                q = saguaro.apply_rows(q, step)
            q = as_drawn(q)
            steps.append(token_tensor(sample_ids(q, gen), q.device))
            q_steps.append(q)
    finally:
        decoder.finish()
    tokens = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in branches]  # [B][K]: one host read
    q_all = torch.stack(q_steps, dim=1) if q_steps else None  # [B, K, V]
    return {
        key: Proposal(tokens[b], None if q_all is None else q_all[b], "cache")
        for b, key in enumerate(branches)
    }
