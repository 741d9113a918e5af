"""The SSD wire protocol between target rank 0 and the draft, as Messages.

Ops target -> draft: prefill(seq, prompt, settings), round(seq, k, t*),
release(seq), shutdown. Draft -> target: proposal(seq, hit, tokens, q), or error.
Headers hold only plain data (msgpack-able); q rows travel as a tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ssd.config import SamplingConfig, SpeculationConfig, from_dict
from ssd.speculation.cache import Proposal
from ssd.transport.channel import Message

PREFILL, ROUND, RELEASE, SHUTDOWN = "prefill", "round", "release", "shutdown"
PROPOSAL, ERROR = "proposal", "error"


class DraftError(RuntimeError):
    """The draft side failed while handling a message; the text is its error."""


def prefill(seq: int, prompt: list[int], sampling: SamplingConfig, speculation: SpeculationConfig) -> Message:
    return Message(PREFILL, {
        "seq": seq, "prompt": list(prompt),
        "sampling": dataclasses.asdict(sampling), "speculation": dataclasses.asdict(speculation),
    })


def parse_prefill(msg: Message) -> tuple[int, list[int], SamplingConfig, SpeculationConfig]:
    h = msg.header
    speculation = from_dict(SpeculationConfig, h["speculation"])
    return h["seq"], h["prompt"], from_dict(SamplingConfig, h["sampling"]), speculation


def round_(seq: int, k: int, token: int) -> Message:
    return Message(ROUND, {"seq": seq, "k": k, "token": token})


def release(seq: int) -> Message:
    return Message(RELEASE, {"seq": seq})


def shutdown() -> Message:
    return Message(SHUTDOWN)


@dataclass
class ProposalReply:
    seq: int
    hit: bool
    proposal: Proposal
    backup_s: float  # time spent on the backup this round (0 on a hit)
    build_s: float  # time the previous cache build took


def proposal(reply: ProposalReply) -> Message:
    drafted = reply.proposal
    header = {
        "seq": reply.seq, "hit": reply.hit, "source": drafted.source, "tokens": drafted.tokens,
        "backup_s": reply.backup_s, "build_s": reply.build_s,
    }
    return Message(PROPOSAL, header, [] if drafted.q is None else [drafted.q])


def error(seq: int, text: str) -> Message:
    return Message(ERROR, {"seq": seq, "error": text})


def parse_proposal(msg: Message) -> ProposalReply:
    if msg.op == ERROR:
        raise DraftError(msg.header["error"])
    if msg.op != PROPOSAL:
        raise RuntimeError(f"protocol error: expected {PROPOSAL!r}, got {msg.op!r}")
    h = msg.header
    q = msg.tensors[0] if msg.tensors else None
    return ProposalReply(h["seq"], h["hit"], Proposal(h["tokens"], q, h["source"]), h["backup_s"], h["build_s"])
