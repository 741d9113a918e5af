"""SSD, the target side: send each verification outcome to the draft, receive
the next speculation (ready at once on a cache hit), verify it. Written only
against the Channel interface; the draft side is ssd.speculation.speculator.

A draft that fails, disconnects or stalls past `draft_timeout_s` never costs
a request: the round it happened in has verified nothing yet, so the target
continues alone (plain decoding, counted as degraded rounds) until `attach`
hands it a new link, from any thread: the engine adopts it before its next
round, mid-request too, by prefilling the new speculator with the sequence
so far.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Engine, SequenceState, Verifier
from ssd.models.kv import KVSequence
from ssd.models.tokenizer import Tokenizer
from ssd.speculation import protocol
from ssd.transport.channel import Channel, ChannelClosed, ChannelTimeout, Message
from ssd.verify import Outcome, verify

log = logging.getLogger(__name__)

LINK_FAILURES = (ChannelTimeout, ChannelClosed, protocol.DraftError, ConnectionError)


class SSDEngine(Engine):
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
        if draft_precision:  # the draft lives elsewhere: whoever placed it says what it is
            self.precision += f", draft {draft_precision}"
        self.channel = channel
        self.draft_timeout_s = draft_timeout_s
        self._pending: Channel | None = None  # a new link, adopted before the next round
        self._pending_lock = threading.Lock()
        self._seq_ids = itertools.count()
        self._seq = -1
        self._outcome = Outcome(0, 0)
        self._first_round = True

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

    def _start(self, req: SequenceState) -> None:
        super()._start(req)
        self._adopt()
        self._seq = next(self._seq_ids)
        self._send(protocol.prefill(self._seq, req.sequence, req.sampling, req.speculation))

    def _first_token(self, req: SequenceState) -> int:
        token = super()._first_token(req)
        self._outcome = Outcome(0, token)  # the prefill is round 0: nothing drafted, t* = token
        self._first_round = True  # no cache exists yet: not a lookup
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
        self._seq = next(self._seq_ids)
        self._send(protocol.prefill(self._seq, req.sequence[:-1], req.sampling, req.speculation))
        self._outcome = Outcome(0, req.sequence[-1])
        self._first_round = True
        log.info("draft link adopted mid-request at token %d", len(req.sequence))

    def _speculative_round(self, req: SequenceState) -> list[int]:
        lookup_k = None if self._first_round else self._outcome.k
        started = time.perf_counter()
        self.channel.send(protocol.round_(self._seq, self._outcome.k, self._outcome.token))
        reply = protocol.parse_proposal(self.channel.recv(self.draft_timeout_s))
        waited = time.perf_counter() - started
        self._first_round = False
        # Never verify past max_new_tokens: the round adds up to K + 1 tokens.
        k = min(len(reply.proposal.tokens), req.output.remaining - 1)
        drafted = reply.proposal.tokens[:k]
        q = None if reply.proposal.q is None else reply.proposal.q[:k]
        target_before = req.stats.target_s
        self._outcome = self._verify(req, drafted, q)
        req.stats.spec.record(
            lookup_k=lookup_k, hit=reply.hit, source=reply.proposal.source,
            tokens=self._outcome.k + 1, wait_s=waited, verify_s=req.stats.target_s - target_before,
            backup_s=reply.backup_s, build_s=reply.build_s,
        )
        return self._outcome.tokens(drafted)

    def _finish(self, req: SequenceState) -> None:
        self._send(protocol.release(self._seq))

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


def _close_quietly(channel: Channel) -> None:
    try:
        channel.close()
    except Exception:  # noqa: BLE001 - the link may be broken already; closing is best effort
        log.debug("closing a draft link failed", exc_info=True)
