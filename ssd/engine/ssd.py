"""SSD, the target side: send each verification outcome to the draft, receive
the next speculation (ready at once on a cache hit), verify it. Written only
against the Channel interface; the draft side is ssd.saguaro.speculator.

A draft that fails, disconnects or stalls past `draft_timeout_s` never costs
a request: the round it happened in has verified nothing yet, so the target
continues alone (plain decoding, counted as degraded rounds) until `attach`
hands it a new link, from any thread: the engine adopts it before its next
round, mid-request too, by prefilling the new speculator with the sequence
so far.

The link handling (`DraftLinked`), a sequence's place on the link
(`DraftCursor`) and the per-round accounting (`record_speculation`) are
shared with the batched engine (ssd.engine.batch_ssd).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Engine, SequenceState, Verifier
from ssd.models.kv import KVSequence
from ssd.models.tokenizer import Tokenizer
from ssd.saguaro import protocol
from ssd.transport.channel import Channel, ChannelClosed, ChannelTimeout, Message
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

LINK_FAILURES = (ChannelTimeout, ChannelClosed, protocol.DraftError, ConnectionError)


@dataclass
class DraftCursor:
    """One sequence as the speculator knows it: its seq id on the current link
    and the outcome its next round reports. A (re)prefill starts a cursor whose
    first round is no cache lookup (no cache exists yet)."""

    seq: int
    outcome: Outcome = Outcome(0, 0)
    first_round: bool = True

    def restart(self, token: int) -> None:
        """The speculator holds the sequence before `token`: its next round reports (0, token)."""
        self.outcome = Outcome(0, token)
        self.first_round = True

    @property
    def lookup_k(self) -> int | None:
        """The acceptance length the next round looks up (None: the first round looks nothing up)."""
        return None if self.first_round else self.outcome.k

    def round_row(self) -> protocol.RoundRow:
        return protocol.RoundRow(self.seq, self.outcome.k, self.outcome.token)

    def advance(self, outcome: Outcome) -> None:
        self.outcome, self.first_round = outcome, False


def cut_proposal(reply: protocol.ProposalReply, remaining: int) -> tuple[list[int], torch.Tensor | None]:
    """The proposal's tokens and q rows, never verified past max_new_tokens (a round adds up to K + 1)."""
    k = min(len(reply.proposal.tokens), remaining - 1)
    q = reply.proposal.q
    return reply.proposal.tokens[:k], None if q is None else q[:k]


def record_speculation(
    req: SequenceState, reply: protocol.ProposalReply, lookup_k: int | None, outcome: Outcome,
    wait_s: float, verify_s: float,
) -> None:
    """SSD's per-round measures, the same for a lone sequence and a batch row."""
    req.stats.spec.record(
        lookup_k=lookup_k, hit=reply.hit, source=reply.proposal.source,
        tokens=outcome.k + 1, wait_s=wait_s, verify_s=verify_s,
        backup_s=reply.backup_s, build_s=reply.build_s,
    )


class DraftLinked:
    """The target's end of the draft link: a link handed over from any thread
    is adopted between rounds; a failed send takes the link down instead of
    the request; `stop_draft` ends the speculator at shutdown."""

    channel: Channel | None
    draft_timeout_s: float | None
    precision: str

    def _init_link(self, channel: Channel | None, draft_timeout_s: float | None, draft_precision: str | None) -> None:
        if draft_precision:  # the draft lives elsewhere: whoever placed it says what it is
            self.precision += f", draft {draft_precision}"
        self.channel = channel
        self.draft_timeout_s = draft_timeout_s
        self._pending: Channel | None = None  # a new link, adopted before the next round
        self._pending_lock = threading.Lock()
        self._seq_ids = itertools.count()

    @property
    def link_up(self) -> bool:
        return self.channel is not None or self._pending is not None

    def attach(self, channel: Channel) -> None:
        """Use a (new) draft link from the next round on; safe from any thread."""
        with self._pending_lock:
            old, self._pending = self._pending, channel
        if old is not None:
            _close_quietly(old)

    def stop_draft(self) -> None:
        """Tell the speculator to stop serving and close the link (shutdown)."""
        self._adopt()
        self._send(protocol.shutdown())
        if self.channel is not None:
            channel, self.channel = self.channel, None
            _close_quietly(channel)

    def _adopt(self) -> bool:
        """Switch to a pending link, if one came; True if it did."""
        with self._pending_lock:
            channel, self._pending = self._pending, None
        if channel is None:
            return False
        if self.channel is not None:
            _close_quietly(self.channel)
        self.channel = channel
        return True

    def _start_on_draft(self, sequence: list[int], req: SequenceState) -> DraftCursor:
        """Start `sequence` on the speculator under a new seq id (sent only while a link is up)."""
        cursor = DraftCursor(next(self._seq_ids))
        self._send(protocol.prefill(cursor.seq, sequence, req.sampling, req.speculation))
        return cursor

    def _send(self, message: Message) -> None:
        if self.channel is None:
            return
        try:
            self.channel.send(message)
        except LINK_FAILURES as exc:
            self._link_down(exc)

    def _link_down(self, exc: BaseException) -> None:
        log.warning("draft link lost (%s: %s); the target continues alone", type(exc).__name__, exc)
        channel, self.channel = self.channel, None
        _close_quietly(channel)


class SSDEngine(DraftLinked, Engine):
    mode = "ssd"

    def __init__(
        self,
        target: torch.nn.Module | KVSequence,
        tokenizer: Tokenizer,
        channel: Channel | None,
        speculation: SpeculationConfig,
        verifier: Verifier = verify,
        draft_timeout_s: float | None = None,
        draft_precision: str | None = None,
    ) -> None:
        """`speculation`: the settings for requests that bring none of their own."""
        super().__init__(target, tokenizer, verifier, speculation)
        self._init_link(channel, draft_timeout_s, draft_precision)
        self._cursor = DraftCursor(-1)

    def _start(self, req: SequenceState) -> None:
        super()._start(req)
        self._adopt()
        self._cursor = self._start_on_draft(req.sequence, req)

    def _first_token(self, req: SequenceState) -> int:
        token = super()._first_token(req)
        self._cursor.restart(token)  # the prefill is round 0: nothing drafted, t* = token
        return token

    def _round(self, req: SequenceState) -> list[int]:
        if self._adopt():  # a new link mid-request: the new speculator starts from here
            self._resume(req)
        if self.channel is not None:
            try:
                return self._speculative_round(req)
            except LINK_FAILURES as exc:
                self._link_down(exc)
        req.stats.spec.degraded_rounds += 1
        return self._target_step(req)

    def _resume(self, req: SequenceState) -> None:
        """Prefill a new speculator with the sequence so far, as if its last token were the first."""
        self._cursor = self._start_on_draft(req.sequence[:-1], req)
        self._cursor.restart(req.sequence[-1])
        log.info("draft link adopted mid-request at token %d", len(req.sequence))

    def _speculative_round(self, req: SequenceState) -> list[int]:
        lookup_k = self._cursor.lookup_k
        started = time.perf_counter()
        row = self._cursor.round_row()
        self.channel.send(protocol.round_(row.seq, row.k, row.token))
        reply = protocol.parse_proposal(self.channel.recv(self.draft_timeout_s))
        waited = time.perf_counter() - started
        drafted, q = cut_proposal(reply, req.output.remaining)
        target_before = req.stats.target_s
        outcome = self._verify(req, drafted, q)
        self._cursor.advance(outcome)
        record_speculation(req, reply, lookup_k, outcome, waited, req.stats.target_s - target_before)
        return outcome.tokens(drafted)

    def _finish(self, req: SequenceState) -> None:
        self._send(protocol.release(self._cursor.seq))


def _close_quietly(channel: Channel) -> None:
    try:
        channel.close()
    except Exception:  # noqa: BLE001 - the link may be broken already; closing is best effort
        log.debug("closing a draft link failed", exc_info=True)
