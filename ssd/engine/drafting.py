"""Drafting a chain of K tokens with the draft model: plain SD's proposer and
SSD's neural backup, written once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from ssd.config import SamplingConfig
from ssd.models.backend import AnySequence, forward_rows
from ssd.sampling import DRAFT_CANDIDATES, as_drawn, draws_at, probs_from_logits, sample



class Reshape(Protocol):
    """What a chain may draw its tokens from instead of q: SSD's neural backup
    drafts under Saguaro sampling (ssd.saguaro.sampling.Saguaro); SD never does."""

    def apply(self, q: torch.Tensor, position: int) -> torch.Tensor:
        """The law [V] the token at `position` (0: the first drafted) is drawn from."""


@dataclass
class Chain:
    """One sequence's share of a batched draft (`draft_chains`): what to draft and what came out.

    `error` is set when this sequence's own work failed (its sampling, say);
    its chain stops there and the others go on.
    """

    kv: AnySequence
    sequence: Sequence[int]
    k: int
    sampling: SamplingConfig
    gen: torch.Generator
    saguaro: Reshape | None = None
    tokens: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    logit_rows: list[torch.Tensor] = field(default_factory=list)  # what each token was drawn from, before sampling
    error: Exception | None = None
    # SD: the request's logits processing (ssd.engine.processing); the draft proposes under it,
    # tentatively advancing it, and verification rolls it back. None: the draft's logits as they are.
    processor: Any = None

    @property
    def drafting(self) -> bool:
        return self.error is None and len(self.tokens) < self.k

    def next_ids(self) -> list[int]:
        """What the draft must be fed before its next token: the tail of the
        sequence its cache lacks (first step), then the last drafted token."""
        if self.tokens:
            return [self.tokens[-1]]
        self.kv.trim_to_prefix_of(self.sequence)
        return list(self.sequence[self.kv.length :])

    def take(self, logits: torch.Tensor) -> None:
        """Draw the next drafted token from the draft's logits [V] after the fed tokens.

        Coupled: the Gumbel-max of q under the request's noise at the token's
        position, the noise the target's own token there uses, over q's
        DRAFT_CANDIDATES likeliest tokens; Saguaro's reshaping is for the
        ratio test and is not applied. With logits processing, q is the draft's
        processed law (the target's is verified against)."""
        bias = self.processor.bias(logits.shape[-1]) if self.processor is not None else None
        q = probs_from_logits(logits, self.sampling, bias)
        if self.saguaro is not None and self.sampling.needs_q:
            q = self.saguaro.apply(q, len(self.tokens))
        q = as_drawn(q)
        draws = draws_at(self.sampling, self.gen, [len(self.sequence) + len(self.tokens)], DRAFT_CANDIDATES)
        self.tokens.append(sample(q, draws))
        if self.processor is not None:
            self.processor.push(self.tokens[-1])
        self.q_rows.append(q)
        self.logit_rows.append(logits)


def draft_chains(chains: Sequence[Chain]) -> None:
    """Draft every chain's k tokens, one batched draft forward per step.

    Step i feeds each chain still drafting its missing tokens and draws its
    next token with its own sampling settings and generator, so a chain's
    draws are those it makes alone. The chains' caches must be distinct
    sequences of one draft model. A chain whose own draw fails records the
    error and stops; a failed forward raises (it is every chain's).
    """
    while active := [c for c in chains if c.drafting]:
        logits = forward_rows([c.kv for c in active], [c.next_ids() for c in active], last_only=True)
        for chain, rows in zip(active, logits):
            try:
                chain.take(rows[-1])
            except Exception as error:  # noqa: BLE001 - the chain's own failure, reported with it
                chain.error = error


def drafted_chain(
    kv: AnySequence,
    sequence: Sequence[int],
    k: int,
    sampling: SamplingConfig,
    gen: torch.Generator,
    saguaro: Reshape | None = None,
) -> Chain:
    """The finished Chain of k tokens drafted after `sequence` (its error raised).

    Whatever `kv` holds beyond its longest common prefix with `sequence` is
    dropped; afterwards it holds sequence + the first k-1 drafted tokens (the
    last is never fed). The q rows stay on the draft's device; each drafted
    id is read by the host once, since the next forward needs it.
    """
    chain = Chain(kv, sequence, k, sampling, gen, saguaro)
    draft_chains([chain])
    if chain.error is not None:
        raise chain.error
    return chain
