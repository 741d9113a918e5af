"""The q bytes an SSD round sends over the draft link, before and now.

SSD runs as it serves (the speculator in a thread, SSDEngine on the target's
end) and the target's end of the link counts every proposals reply: the rounds,
the q rows and bytes it brought, and the tokens whose q crossed in the format
before (one float32 row per drafted token of a sampled row; greedy and coupled
rows shipped none then either). Run it with `launch/bench_link.py --bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from ssd.config import FanoutConfig, GenerationConfig, PromptLookupConfig, SamplingConfig, SpeculationConfig
from ssd.engine.request import GenerationRequest
from ssd.models.backend import vocab_size
from ssd.models.tokenizer import TinyTokenizer
from ssd.saguaro import protocol
from ssd.saguaro.host import DraftThread
from ssd.saguaro.target import SSDEngine
from ssd.transport.channel import Channel, Message

BEFORE_ITEMSIZE = 4  # float32 q rows, one per drafted token (ssd.sampling.Q_DTYPE before bfloat16)


@dataclass
class QBytes:
    """What the proposals replies of a run carried."""

    vocab: int
    rounds: int = 0  # proposals replies
    q_rows: int = 0  # rows of q shipped
    q_bytes: int = 0  # their bytes
    drafted: int = 0  # drafted tokens of rows that shipped q: one float32 row each before
    outputs: list[list[int]] = dataclasses.field(default_factory=list)  # each request's tokens

    def add(self, message: Message) -> None:
        shipping = [row for row in message.header["rows"] if row.get("q") is not None]
        self.rounds += 1
        self.q_rows += sum(row["q"][1] - row["q"][0] for row in shipping)
        self.q_bytes += sum(t.numel() * t.element_size() for t in message.tensors)
        self.drafted += sum(len(row["tokens"]) for row in shipping)

    @property
    def before_bytes(self) -> int:
        return self.drafted * self.vocab * BEFORE_ITEMSIZE

    def per_round(self) -> dict[str, float]:
        rounds = max(self.rounds, 1)
        return {"rounds": self.rounds, "q_rows": self.q_rows / rounds, "q_bytes": self.q_bytes / rounds,
                "before_rows": self.drafted / rounds, "before_bytes": self.before_bytes / rounds}


class CountingChannel(Channel):
    """The target's end of the link, counting what each proposals reply brings."""

    def __init__(self, inner: Channel, counts: QBytes) -> None:
        self.inner, self.counts = inner, counts

    def send(self, message: Message) -> None:
        self.inner.send(message)

    def recv(self, timeout: float | None = None) -> Message:
        message = self.inner.recv(timeout)
        if message.op == protocol.PROPOSALS:
            self.counts.add(message)
        return message

    def pending(self) -> list[str]:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


def speculation(k: int, budget: int) -> SpeculationConfig:
    """SSD at K = k, builds run to `budget` (no anytime cut): rounds are the draft's, not timing's."""
    return SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(budget=budget, anytime=False),
                             prompt_lookup=PromptLookupConfig(max_tokens=0))


def count_q_bytes(
    target: torch.nn.Module, draft: torch.nn.Module, sampling: SamplingConfig, prompts: Sequence[Sequence[int]],
    max_new_tokens: int, k: int = 4, budget: int = 8,
) -> QBytes:
    """Generate each prompt with SSD (seeds 0, 1, ...) and count the q its rounds brought."""
    counts = QBytes(vocab_size(draft))
    host = DraftThread(draft)
    channel = CountingChannel(host.channel, counts)
    with SSDEngine(target, TinyTokenizer(counts.vocab), speculation(k, budget), channel=channel, host=host) as ssd:
        for seed, prompt in enumerate(prompts):
            request = GenerationRequest(list(prompt), dataclasses.replace(sampling, seed=seed),
                                        GenerationConfig(max_new_tokens=max_new_tokens))
            counts.outputs.append(ssd.generate(request).token_ids)
    return counts
