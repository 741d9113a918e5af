"""The draft side of SSD: answer each verification outcome with the next
speculation (from the cache on a hit, from a backup on a miss), then build the
cache for the outcome of that speculation while the target verifies it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ssd.config import SamplingConfig, SpeculationConfig
from ssd.fanout import FanoutPlanner, make_planner
from ssd.hardware import sync
from ssd.models.kv import KVSequence
from ssd.sampling import make_generator
from ssd.speculation import protocol
from ssd.speculation.backups import make_backup
from ssd.speculation.branches import BRANCH_DECODERS, BranchDecoder, make_branch_decoder
from ssd.speculation.builder import build_cache
from ssd.speculation.cache import Proposal, SpeculationCache
from ssd.speculation.drafting import Saguaro
from ssd.transport.channel import Channel, Message

log = logging.getLogger(__name__)


def draft_seed(seed: int) -> int:
    """The draft's own random stream, derived from the request seed: the two
    sides run concurrently, so sharing one generator would make draws depend
    on timing."""
    return (seed * 6364136223846793005 + 1442695040888963407) % (1 << 63)


@dataclass
class DraftSequence:
    """What the draft keeps per sequence between rounds."""

    kv: KVSequence
    committed: list[int]
    sampling: SamplingConfig
    speculation: SpeculationConfig
    gen: torch.Generator
    planner: FanoutPlanner
    cache: SpeculationCache = field(default_factory=SpeculationCache)
    in_flight: Proposal | None = None  # the proposal the target is verifying
    in_flight_hit: bool = False
    in_flight_fanout: list[int] = field(default_factory=list)
    build_s: float = 0.0


class Speculator:
    def __init__(self, model: torch.nn.Module, channel: Channel) -> None:
        self.model = model
        self.channel = channel
        self.vocab_size = model.config.vocab_size
        self.sequences: dict[int, DraftSequence] = {}
        # Decoders keep their mask buffers between rounds: one of each kind.
        self.decoders: dict[str, BranchDecoder] = {kind: make_branch_decoder(kind) for kind in BRANCH_DECODERS}

    def serve(self) -> None:
        """Handle messages until shutdown. A failure is reported, not swallowed:
        the target gets an error message instead of waiting forever."""
        handlers = {protocol.PREFILL: self._prefill, protocol.ROUND: self._round, protocol.RELEASE: self._release}
        while (msg := self.channel.recv()).op != protocol.SHUTDOWN:
            try:
                handlers[msg.op](msg)
            except Exception as exc:
                log.exception("speculator failed on %s", msg.op)
                self.channel.send(protocol.error(msg.header.get("seq", -1), f"{type(exc).__name__}: {exc}"))

    def _prefill(self, msg: Message) -> None:
        seq_id, prompt, sampling, speculation = protocol.parse_prefill(msg)
        kv = KVSequence(self.model)
        if len(prompt) > 1:
            kv.forward(prompt[:-1], last_only=True)  # overlaps the target's own prefill
        planner = make_planner(speculation, self.vocab_size)
        gen = make_generator(draft_seed(sampling.seed))
        self.sequences[seq_id] = DraftSequence(kv, list(prompt), sampling, speculation, gen, planner)

    def _round(self, msg: Message) -> None:
        seq_id, k, token = msg.header["seq"], msg.header["k"], msg.header["token"]
        seq = self.sequences[seq_id]
        cached = self._commit(seq, k, token)
        started = time.perf_counter()
        proposal = cached or self._backup(seq)
        sync(self.model.device)  # the timers cover the device's work
        backup_s = 0.0 if cached else time.perf_counter() - started
        reply = protocol.ProposalReply(seq_id, cached is not None, proposal, backup_s, seq.build_s)
        self.channel.send(protocol.proposal(reply))
        self._build(seq, proposal, hit=cached is not None)

    def _commit(self, seq: DraftSequence, k: int, token: int) -> Proposal | None:
        """Advance the committed sequence by the outcome; the cached proposal for it, if any."""
        if seq.in_flight is None:  # the first round follows the prefill's token
            seq.committed.append(token)
            return None
        cached = seq.cache.lookup(k, token)
        seq.planner.observe(seq.in_flight_hit, k, seq.in_flight_fanout[k], cached is not None)
        seq.committed += seq.in_flight.tokens[:k] + [token]
        return cached

    def _backup(self, seq: DraftSequence) -> Proposal:
        backup = make_backup(seq.speculation.backup_for(batch_size=1), self.vocab_size)
        saguaro = Saguaro(seq.speculation.saguaro_c, seq.planner.schedule(after_hit=False))
        return backup.propose(seq.kv, seq.committed, seq.speculation.k, seq.sampling, seq.gen, saguaro)

    def _build(self, seq: DraftSequence, proposal: Proposal, hit: bool) -> None:
        started = time.perf_counter()
        fanout = seq.planner.schedule(after_hit=hit)
        saguaro = Saguaro(seq.speculation.saguaro_c, seq.planner.schedule(after_hit=True))
        decoder = self.decoders[seq.speculation.branch_decoder]
        entries = build_cache(seq.kv, decoder, seq.committed, proposal.tokens, fanout, seq.sampling, seq.gen, saguaro)
        seq.cache.replace(entries)
        seq.in_flight, seq.in_flight_hit, seq.in_flight_fanout = proposal, hit, fanout
        sync(self.model.device)
        seq.build_s = time.perf_counter() - started

    def _release(self, msg: Message) -> None:
        self.sequences.pop(msg.header["seq"], None)
