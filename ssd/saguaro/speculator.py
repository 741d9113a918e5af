"""The draft side of SSD: answer each verification outcome with the next
speculation (from the cache on a hit, from a backup on a miss), then build the
cache for the outcome of that speculation while the target verifies it.

The target sends every sequence's outcome of a round in one `rounds` message
(a lone sequence: a batch of one) and gets one `proposals` reply. Every row
is answered exactly as it would be alone (same state, same random stream),
except that the backup is the one the row's settings choose for the batch
size, and the rows' cache builds share the batch's branch cap
(fanout.batch_budget). Only rows that missed run
a backup: a hit row's proposal is ready, and drafting it again would cost the
batch the time the cache saved. A row that fails is answered with its error
and stays failed until released; the other rows go on.

The prefix cache's draft side: with the engine's prefix cache on (the
prefill's `reuse`), a released row's draft cache waits (the last
KEPT_SEQUENCES of them), and a later prompt that starts the same way, as a
chat's next turn does, starts from it and feeds only the rest. Unlike the
target's (ssd.engine.prefix), these positions need not be what a fresh
prefill computes: the draft's keys and values only steer what it proposes,
and verification keeps the output the target's.

Threads: `serve` runs in one thread and owns the sequences, their KV caches
and the branch decoders; the draft model itself may be shared with other
threads (ssd.models).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from ssd.config import SamplingConfig, SpeculationConfig
from ssd.engine.prefix import common_prefix
from ssd.saguaro.fanout import FanoutPlanner, fanout_for, make_planner, share_budget
from ssd.hardware import sync
from ssd.models.backend import AnySequence, device_of, new_sequence, release, vocab_size
from ssd.sampling import make_generator
from ssd.saguaro import protocol
from ssd.saguaro.anytime import AnytimeBudget
from ssd.saguaro.backups import make_backup, ngram_candidates
from ssd.saguaro.branches import BranchDecoder, make_branch_decoder
from ssd.saguaro.builder import BuildJob, build_caches
from ssd.saguaro.cache import Proposal, SpeculationCache
from ssd.saguaro.sampling import Saguaro
from ssd.transport.channel import Channel, Message

log = logging.getLogger(__name__)
T = TypeVar("T")


# Released rows' draft caches kept for later prompts: a chat's next turn per recent chat. Few,
# as each is a whole sequence's cache (on llama.cpp, a context of its own).
KEPT_SEQUENCES = 2
EPOCH_STRIDE = 0x9E3779B97F4A7C15  # odd: epochs differ in the low 32 bits, all that mt19937 reads


def draft_seed(seed: int, epoch: int = 0) -> int:
    """The draft's own random stream for a request's `epoch`-th prefill on a draft.

    Derived from the request seed, not shared with the target: the two sides
    run concurrently, so one generator would make draws depend on timing.
    Keyed by the epoch too, which the target moves forward every time it
    prefills a running row again (parked, failed on the draft, re-linked):
    restarting the epoch's stream would replay uniforms the row's earlier
    drafts used, and correlated drafts are no longer the target's law.
    torch's CPU generator seeds mt19937 from the seed's low 32 bits, so the
    stride keeps those distinct for 2^32 epochs.
    """
    return (seed * 6364136223846793005 + 1442695040888963407 + epoch * EPOCH_STRIDE) % (1 << 63)


@dataclass
class DraftSequence:
    """What the draft keeps per sequence between rounds."""

    kv: AnySequence
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
    decoder: BranchDecoder | None = None  # its own: the rows' builds run in lockstep
    failed: str | None = None  # why this row failed in a batched round; it answers only that
    k: int = 0  # this round's speculation length (the rounds message's draft_k, else speculation.k)
    reuse: bool = False  # kept for a later prompt once released (the prefill's `reuse`)


class Speculator:
    def __init__(self, model: torch.nn.Module, channel: Channel) -> None:
        self.model = model
        self.channel = channel
        self.vocab_size = vocab_size(model)
        self.device = device_of(model)
        self.sequences: dict[int, DraftSequence] = {}
        # Anytime builds (speculation.fanout.anytime): the learnt budget offset,
        # and the last build's (planned budget, cut, seconds) until its outcome arrives.
        self.anytime: AnytimeBudget | None = None
        self._last_build: tuple[int, bool, float, float] | None = None
        self.kept: list[tuple[int, AnySequence]] = []  # released caches (branch slots, cache), oldest first
        self.keep = KEPT_SEQUENCES  # how many (0: prefill every prompt whole, as before the cache)

    def serve(self) -> None:
        """Handle messages until shutdown. A failure is reported, not swallowed:
        the target gets an error message instead of waiting forever."""
        handlers = {
            protocol.PREFILL: self._prefill, protocol.ROUNDS: self._rounds, protocol.RELEASE: self._release,
            protocol.PING: lambda msg: self.channel.send(Message(protocol.PONG)),
        }
        try:
            while (msg := self.channel.recv()).op != protocol.SHUTDOWN:
                self._outcome_arrived(msg.op)
                try:
                    handlers[msg.op](msg)
                except Exception as exc:
                    log.exception("speculator failed on %s", msg.op)
                    self.channel.send(protocol.error(msg.header.get("seq", -1), _describe(exc)))
        finally:
            for _, kv in self.kept:
                release(kv)
            self.kept.clear()

    def _prefill(self, msg: Message) -> None:
        row = protocol.parse_prefill(msg)
        branches = row.speculation.fanout.ceiling
        kv = (self._reused(row.prompt, branches) if row.reuse else None) or new_sequence(self.model, branches=branches)
        if len(row.prompt) - 1 > kv.length:
            kv.forward(row.prompt[kv.length:-1], last_only=True)  # overlaps the target's own prefill
        planner = make_planner(row.speculation, self.vocab_size)
        gen = make_generator(draft_seed(row.sampling.seed, row.epoch))
        decoder = make_branch_decoder(row.speculation.branch_decoder, sequence=kv)
        self.sequences[row.seq] = DraftSequence(
            kv, list(row.prompt), row.sampling, row.speculation, gen, planner, decoder=decoder, reuse=row.reuse
        )

    def _reused(self, prompt: list[int], branches: int) -> AnySequence | None:
        """The kept cache (with room for `branches`) sharing the longest start with `prompt`,
        rolled back to that start, leaving the prompt's last token to feed; None where none
        shares a token."""
        shares = [(common_prefix(kv.tokens, prompt), i) for i, (slots, kv) in enumerate(self.kept) if slots == branches]
        shared, index = max(shares, default=(0, -1))
        if shared == 0:
            return None
        _, kv = self.kept.pop(index)
        kv.trim_to_prefix_of(prompt)
        return kv

    def _rounds(self, msg: Message) -> None:
        """A round of every row sent (one, alone): answer them in one reply, then build every row's cache."""
        rows = protocol.parse_rounds(msg)
        replies = [self._guarded(row.seq, self._answer, row, len(rows)) for row in rows]
        self.channel.send(protocol.proposals(replies))
        self._build_all([r for r in replies if isinstance(r, protocol.ProposalReply)])

    def _guarded(self, seq_id: int, fn: Callable[..., T], *args: Any) -> T | protocol.RowError:
        """fn(*args), or this row's error: the row is marked failed so that its
        later rounds report the error instead of running on half-updated state."""
        try:
            return fn(*args)
        except protocol.DraftError as exc:  # the row failed in an earlier round, logged then
            return protocol.RowError(seq_id, str(exc))
        except Exception as exc:
            log.exception("speculator failed on sequence %s", seq_id)
            return self._fail(seq_id, _describe(exc))

    def _fail(self, seq_id: int, text: str) -> protocol.RowError:
        if (seq := self.sequences.get(seq_id)) is not None:
            seq.failed = seq.failed or text
        return protocol.RowError(seq_id, text)

    def _answer(self, row: protocol.RoundRow, batch_size: int) -> protocol.ProposalReply:
        """The row's next speculation: its cached proposal, or the backup's on a miss."""
        seq = self.sequences[row.seq]
        if seq.failed is not None:
            raise protocol.DraftError(seq.failed)
        seq.k = requested_k(row, seq.speculation)
        cached = self._commit(seq, row.k, row.token)
        if cached is not None:
            return protocol.ProposalReply(row.seq, True, protocol.shipped(cached, row.room), 0.0, seq.build_s)
        started = time.perf_counter()
        drafted = self._backup(seq, batch_size)
        sync(self.device)  # the timer covers the device's work
        return protocol.ProposalReply(row.seq, False, protocol.shipped(drafted, row.room),
                                      time.perf_counter() - started, seq.build_s)

    def _commit(self, seq: DraftSequence, k: int, token: int) -> Proposal | None:
        """Advance the committed sequence by the outcome; the cached proposal for it, if any."""
        if seq.in_flight is None:  # the first round follows the prefill's token
            seq.committed.append(token)
            return None
        cached = seq.cache.lookup(k, token)
        drafted = len(seq.in_flight.tokens)
        # The planner learns how the draft's own guesses do: a free n-gram entry's hit is its miss.
        own_hit = cached is not None and cached.source == "cache"
        after_own_hit = seq.in_flight_hit and seq.in_flight.source == "cache"
        seq.planner.observe(after_own_hit, k, seq.in_flight_fanout[k], own_hit, drafted)
        seq.committed += seq.in_flight.tokens[:k] + [token]
        return cached

    def _backup(self, seq: DraftSequence, batch_size: int) -> Proposal:
        backup = make_backup(seq.speculation.backup_for(batch_size), self.vocab_size)
        saguaro = Saguaro(seq.speculation.saguaro_c, seq.planner.schedule(after_hit=False))
        return backup.propose(seq.kv, seq.committed, seq.k, seq.sampling, seq.gen, saguaro)

    def _build_all(self, replies: list[protocol.ProposalReply]) -> None:
        """Build the cache of every answered row at once (one packed draft forward
        per step: ssd.saguaro.builder.build_caches), within the batch's shared
        branch cap; a row whose build fails is marked failed (its next round
        reports it). Every row's build_s is the whole build's time."""
        started = time.perf_counter()
        seqs = [self.sequences[r.seq] for r in replies]
        planned, budgets = self._budgets(seqs, [r.hit for r in replies])
        cut = _Cut(self.channel) if any(s.speculation.fanout.anytime for s in seqs) else None
        jobs = [self._job(seq, r.proposal, r.hit, b, cut) for seq, r, b in zip(seqs, replies, budgets)]
        results = build_caches(jobs) if jobs else []
        sync(self.device)
        elapsed = time.perf_counter() - started
        if cut is not None and jobs:  # an outcome already waiting: the build overran even if never cut
            overran = cut.fired or protocol.ROUNDS in self.channel.pending()
            self._last_build = (max(planned), overran, elapsed, time.perf_counter())
        for reply, seq, job, result in zip(replies, seqs, jobs, results):
            if isinstance(result, Exception):
                log.error("speculator failed on sequence %s: %s", reply.seq, _describe(result), exc_info=result)
                self._fail(reply.seq, _describe(result))
                continue
            if seq.speculation.ngram_candidates:
                result.update(self._free_candidates(seq, reply.proposal.tokens, result))
            seq.cache.replace(result)
            seq.in_flight, seq.in_flight_hit = reply.proposal, reply.hit
            seq.in_flight_fanout = fanout_for(job.fanout, len(reply.proposal.tokens))
            seq.build_s = elapsed

    def _free_candidates(self, seq: DraftSequence, drafted: list[int], built: dict) -> dict:
        """Outcomes the text so far predicts and the build did not prepare, with
        their n-gram continuations (ssd.saguaro.backups.ngram_candidates)."""
        return ngram_candidates(seq.committed, drafted, seq.k, self.vocab_size, seq.sampling.needs_q,
                                taken=lambda k, t: (k, t) in built)

    def _budgets(self, seqs: list[DraftSequence], hits: list[bool]) -> tuple[list[int], list[int]]:
        """Each row's planned branches this round (its own schedule's) and what
        it builds: the planned ones moved by the anytime offset (within the
        row's room), scaled under the tightest fanout.batch_budget among the
        rows (ssd.saguaro.fanout.share_budget)."""
        caps = [s.speculation.fanout.batch_budget for s in seqs if s.speculation.fanout.batch_budget is not None]
        planned = [sum(s.planner.schedule(after_hit=h)) for s, h in zip(seqs, hits)]
        own = [self._anytime_budget(s, p) for s, p in zip(seqs, planned)]
        return planned, share_budget(own, min(caps, default=None))

    def _anytime_budget(self, seq: DraftSequence, planned: int) -> int:
        fanout = seq.speculation.fanout
        if not fanout.anytime:
            return planned
        if self.anytime is None:
            self.anytime = AnytimeBudget(ceiling=fanout.ceiling)
        return min(self.anytime.budget(planned), fanout.ceiling)

    def _outcome_arrived(self, op: str) -> None:
        """The anytime budget learns from the last build once the next round's
        outcomes arrive; anything else in between (a prefill, a release) makes
        that wait meaningless, so it is dropped."""
        last, self._last_build = self._last_build, None
        if last is None or op != protocol.ROUNDS or self.anytime is None:
            return
        planned, cut, build_s, ended = last
        self.anytime.observe(planned, cut, build_s, time.perf_counter() - ended)

    def _job(
        self, seq: DraftSequence, proposal: Proposal, hit: bool, budget: int | None, stop: _Cut | None = None,
    ) -> BuildJob:
        """This row's build: its schedule (scaled to `budget`), Saguaro, decoder and the proposal's work."""
        spec = seq.speculation
        fanout = seq.planner.schedule(after_hit=hit, budget=budget)
        saguaro = Saguaro(spec.saguaro_c, seq.planner.schedule(after_hit=True, budget=budget))
        return BuildJob(seq.kv, seq.decoder, seq.committed, proposal.tokens, fanout, seq.sampling, seq.gen,
                        saguaro, proposal.work, seq.k, spec.glue, stop)

    def _release(self, msg: Message) -> None:
        seq = self.sequences.pop(msg.header["seq"], None)
        if seq is None:
            return
        if not (seq.reuse and seq.failed is None and seq.kv.keeps_prefix):
            release(seq.kv)  # a llama.cpp sequence's context goes now; torch's cache when collected
            return
        self.kept.append((seq.speculation.fanout.ceiling, seq.kv))
        while len(self.kept) > self.keep:
            release(self.kept.pop(0)[1])


class _Cut:
    """The anytime build's stop: the next round's outcomes wait on the channel.
    Once it has said so it stays so, so that every row of the build stops at
    the same step."""

    def __init__(self, channel: Channel) -> None:
        self.channel, self.fired = channel, False

    def __call__(self) -> bool:
        self.fired = self.fired or protocol.ROUNDS in self.channel.pending()
        return self.fired


def requested_k(row: protocol.RoundRow, speculation: SpeculationConfig) -> int:
    """The speculation length the target asks for this round (adaptive K), within 1..k_ceiling."""
    if row.draft_k is None:
        return speculation.k
    if not 1 <= row.draft_k <= speculation.k_ceiling:
        raise ValueError(f"draft_k {row.draft_k} outside 1..{speculation.k_ceiling}")
    return row.draft_k


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
