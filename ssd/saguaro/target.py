"""SSD, the target side: every decoding row's last verification outcome goes to
the draft in ONE `rounds` message, ONE `proposals` reply brings every row's
next speculation (ready at once on a cache hit), and the packed target forward
verifies them all; each row then settles on its own with the shared `verify`.
A round costs one message each way whatever the batch size, and a single
request is a batch of one. Written only against the Channel interface; the
draft side is ssd.saguaro.speculator, hosted by ssd.saguaro.host.

The draft never costs a request:
- one row failing on the draft (a RowError in the reply) runs a plain target
  step inside the same packed forward, then is released and prefilled again
  under a new seq id, so it speculates again from the next step;
- a draft that fails, disconnects or stalls past `draft_timeout_s` degrades
  every row (the step has verified nothing yet): the batch goes on
  target-only, counted as degraded rounds, until `attach` hands over a new
  link from any thread; it is adopted before the next step, every running
  row prefilled on it, mid-request too.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.batch import BatchedEngine, Finished
from ssd.engine.proposers import Proposal
from ssd.engine.rows import Row, SequenceState, Verifier
from ssd.engine.request import GenerationRequest
from ssd.models.backend import Model, precision_of
from ssd.models.tokenizer import Tokenizer
from ssd.saguaro import protocol
from ssd.saguaro.adaptive_k import KController
from ssd.saguaro.host import DraftThread
from ssd.saguaro.protocol import ProposalReply, RowError, RowReply
from ssd.saguaro.speculator import Speculator
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

    def round_row(self, draft_k: int | None = None, room: int | None = None) -> protocol.RoundRow:
        return protocol.RoundRow(self.seq, self.outcome.k, self.outcome.token, draft_k, room)

    def advance(self, outcome: Outcome) -> None:
        self.outcome, self.first_round = outcome, False


@dataclass
class RowLink:
    """A row on the draft link: where the speculator holds it, and this step's speculation.

    `reply` is None in a step where the row runs without the draft (link
    down, or its row failed on the draft: then `restart` is set and the row
    is prefilled again after its plain step).
    """

    cursor: DraftCursor | None = None
    reply: ProposalReply | None = None
    drafted: tuple[int, ...] = ()
    q: torch.Tensor | None = None
    wait_s: float = 0.0
    restart: bool = False
    parked: bool = False  # this step runs without the draft: speculation.k_policy says K 0 here
    prefills: int = 0  # times the row was prefilled on a draft: the next prefill's epoch

    def clear(self) -> None:
        self.reply, self.drafted, self.q, self.wait_s = None, (), None, 0.0

    def take(self, reply: ProposalReply, room: int, wait_s: float) -> None:
        """This step's proposal, never verified past `room` drafted tokens (`verified_room`)."""
        k = min(len(reply.proposal.tokens), room)
        q = reply.proposal.q
        self.reply, self.drafted, self.q, self.wait_s = reply, tuple(reply.proposal.tokens[:k]), None if q is None else q[:k], wait_s


def verified_room(row: Row) -> int:
    """The most drafted tokens the row's round verifies: a round adds one token past
    what it accepts, and never runs past max_new_tokens. The draft ships q for these only."""
    return row.state.output.remaining - 1


def record_speculation(
    req: SequenceState, reply: ProposalReply, lookup_k: int | None, outcome: Outcome, wait_s: float, verify_s: float,
) -> None:
    """SSD's per-round measures of one row."""
    req.stats.spec.record(
        lookup_k=lookup_k, hit=reply.hit, source=reply.proposal.source,
        tokens=outcome.k + 1, wait_s=wait_s, verify_s=verify_s,
        backup_s=reply.backup_s, build_s=reply.build_s,
    )


class SSDEngine(BatchedEngine):
    """Continuous batching with SSD: one rounds/proposals exchange per step, one packed verification."""

    mode = "ssd"

    def __init__(
        self,
        target: Model,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        channel: Channel | None = None,
        draft_timeout_s: float | None = None,
        draft_precision: str | None = None,
        host: DraftThread | None = None,
    ) -> None:
        """`speculation`: the settings for requests that bring none; the draft's
        caches live with the speculator, so admission reserves target KV only.

        `channel`: the link to the speculator (None: none yet; `attach` one).
        `host`: the in-process draft side this engine owns (ssd.saguaro.host);
        close() stops it. `draft_precision`: what the draft runs in, for the
        stats line (whoever placed the draft knows it).
        """
        super().__init__(target, tokenizer, speculation, batching, verifier)
        self._target_precision = self.precision
        self._name_draft(draft_precision)
        self.channel = channel
        self.draft_timeout_s = draft_timeout_s
        self.host = host
        self._pending: Channel | None = None  # a new link, adopted before the next step
        self._pending_lock = threading.Lock()
        self._seq_ids = itertools.count()
        # Adaptive K (speculation.adaptive_k): one controller for the engine's
        # rounds, made at the first row that asks for it (ssd.saguaro.adaptive_k).
        self.k_control: KController | None = None

    @classmethod
    def in_process(
        cls,
        target: Model,
        draft: torch.nn.Module,
        tokenizer: Tokenizer,
        speculation: SpeculationConfig | None = None,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        draft_stream: torch.cuda.Stream | None = None,
        speculator: Callable[[torch.nn.Module, Channel], Speculator] = Speculator,
    ) -> "SSDEngine":
        """SSD in one process: the speculator serves `draft` from a thread of this
        process (ssd.saguaro.host.DraftThread), which close() stops; `draft_stream`:
        the CUDA stream it computes on (None: the thread's default); `speculator`:
        what serves there (a benchmark's instrumented one; the Speculator itself)."""
        host = DraftThread(draft, draft_stream, speculator)
        return cls(target, tokenizer, speculation, batching, verifier,
                   channel=host.channel, draft_precision=precision_of(draft), host=host)

    # --- the link -----------------------------------------------------------------------

    @property
    def link_up(self) -> bool:
        return self.channel is not None or self._pending is not None

    def speculating(self) -> bool:
        """Whether the next step gives the draft work: a link, and a row whose
        speculation.k_policy says K > 0 at the current batch size."""
        return self.link_up and any(self._speculates(row) for row in self.scheduler.rows)

    def _speculates(self, row: Row) -> bool:
        """Whether speculation.k_policy gives the row a K above 0 at the current batch size."""
        return row.state.speculation.k_for(len(self.scheduler.rows)) > 0

    def attach(self, channel: Channel, draft_precision: str | None = None) -> None:
        """Use a (new) draft link from the next step on; safe from any thread.
        `draft_precision`: what the speculator across it loaded, when it says."""
        self._name_draft(draft_precision)
        with self._pending_lock:
            old, self._pending = self._pending, channel
        if old is not None:
            _close_quietly(old)

    def _name_draft(self, draft_precision: str | None) -> None:
        if draft_precision:
            self.precision = f"{self._target_precision}, draft {draft_precision}"

    def stop_draft(self) -> None:
        """Tell the speculator to stop serving and close the link (shutdown)."""
        self._adopt()
        self._send(protocol.shutdown())
        if self.channel is not None:
            channel, self.channel = self.channel, None
            _close_quietly(channel)

    def close(self) -> None:
        """Stop the draft side: the speculator across the link, and the host this engine owns."""
        self.stop_draft()
        if self.host is not None:
            self.host.stop()

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

    def _send(self, message: Message) -> None:
        """Send if a link is up; a failed send takes the link down instead of the request."""
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

    # --- rows on the link ---------------------------------------------------------------

    def admit(self, request: GenerationRequest) -> None:
        """Add a row and prefill the draft at once: its prefill overlaps the target's chunked one.
        A row that speculation.k_policy keeps off the draft at this batch size is not (a draft
        that lent its core to the target would take it back for nothing); `_draft` links it
        when its K is above 0."""
        super().admit(request)
        row = self.scheduler.rows[-1]
        row.link = RowLink()
        if self._speculates(row):
            self._link_row(row)

    def step(self) -> list[Finished]:
        if self._adopt():
            linked = [row for row in self.scheduler.rows if self._speculates(row)]
            log.info("draft link adopted with %d running rows; %d speculating, each prefilled on it",
                     len(self.scheduler.rows), len(linked))
            for row in linked:
                self._link_row(row)
        before = list(self.scheduler.rows)
        left = super().step()
        self._release_left(before)
        return left

    def _link_row(self, row: Row) -> None:
        """Start the row on the speculator under a new seq id: its prompt while it
        prefills, else the sequence so far, whose last token the next round reports.
        Each prefill of the row carries the next epoch, so the draft never
        restarts a random stream the row drew from before."""
        state, link = row.state, row.link
        prefix = state.sequence if not row.decoding else state.sequence[:-1]
        link.cursor = DraftCursor(next(self._seq_ids))
        self._send(protocol.prefill(link.cursor.seq, prefix, state.sampling, state.speculation, link.prefills,
                                    reuse=self.batching.prefix_cache))
        link.prefills += 1
        if row.decoding:
            row.link.cursor.restart(state.sequence[-1])

    def _release_left(self, before: list[Row]) -> None:
        """Rows that left this step (finished, cancelled, failed) free their draft state."""
        staying = {id(row) for row in self.scheduler.rows}
        for row in before:
            if id(row) not in staying and row.link.cursor is not None:
                self._send(protocol.release(row.link.cursor.seq))

    def _park(self, row: Row) -> None:
        """Speculation is off for this row at this batch size: free its draft state once;
        it is prefilled again (`_draft`) when its K is above 0 again."""
        if row.link.cursor is not None:
            self._send(protocol.release(row.link.cursor.seq))
            row.link.cursor = None
        row.link.parked = True

    def _row_failed(self, row: Row, reply: RowError) -> None:
        """The draft failed this row alone: drop its draft state; it is prefilled again after this step."""
        log.warning("draft failed request %r (seq %d): %s; it runs a plain step, then is prefilled again",
                    row.request.request_id, reply.seq, reply.error)
        self._send(protocol.release(reply.seq))
        row.link.cursor, row.link.restart = None, True

    def _exchange(self, rows: list[Row]) -> list[RowReply]:
        """One rounds message for `rows`, one proposals reply, its rows in the same order."""
        self.channel.send(protocol.rounds([row.link.cursor.round_row(self._draft_k(row), verified_room(row))
                                           for row in rows]))
        msg = self.channel.recv(self.draft_timeout_s)
        try:
            replies = protocol.parse_proposals(msg)
        except protocol.DraftError:
            raise
        except (RuntimeError, KeyError) as exc:  # a reply of the wrong kind: the link is not to be trusted
            raise protocol.DraftError(f"malformed proposals reply: {exc!r}") from exc
        sent = [row.link.cursor.seq for row in rows]
        if [reply.seq for reply in replies] != sent:
            raise protocol.DraftError(f"proposals for seqs {[r.seq for r in replies]}, rounds sent for {sent}")
        return replies

    # --- what the mode says -------------------------------------------------------------

    def _round_cost(self, row: Row) -> int:
        """The most tokens a round of the row scores: its longest speculation or prompt lookup,
        never past max_new_tokens."""
        return min(row.state.speculation.round_ceiling, row.state.output.remaining - 1) + 1

    def _draft_k(self, row: Row) -> int | None:
        """The K the row's next speculations have: the controller's under
        speculation.adaptive_k, else None (the draft uses the row's speculation.k)."""
        spec = row.state.speculation
        if not spec.adaptive_k:
            return None
        if self.k_control is None:
            self.k_control = KController(spec.k, spec.k_ceiling)
        return min(max(1, self.k_control.next_k()), spec.k_ceiling)

    def _draft(self, rows: list[Row]) -> None:
        """Every decoding row's speculation for this step, from one exchange; a link
        failure leaves every row without one (plain target steps). A row whose
        speculation.k_policy says K 0 at this batch size runs a plain target step
        and leaves the draft (`_park`) until speculation pays again."""
        for row in rows:
            row.link.clear()
        if self.channel is None or not rows:
            return
        off = [row for row in rows if not self._speculates(row)]
        for row in off:
            self._park(row)
        rows = [row for row in rows if not row.link.parked]
        for row in rows:
            if row.link.cursor is None and not row.link.restart:  # back from parking: prefilled on the draft again
                self._link_row(row)
        if not rows:
            return
        started = time.perf_counter()
        try:
            replies = self._exchange(rows)
        except LINK_FAILURES as exc:
            self._link_down(exc)
            return
        waited = time.perf_counter() - started  # one wait for the whole batch: each row records it
        for row, reply in zip(rows, replies):
            if isinstance(reply, RowError):
                self._row_failed(row, reply)
            else:
                row.link.take(reply, verified_room(row), waited)

    def _proposal(self, row: Row) -> Proposal | None:
        link = row.link
        return None if link.reply is None else Proposal(link.drafted, link.q)

    def _drafts_nothing(self, row: Row) -> bool:
        return row.link.reply is None  # a plain step: parked, or without the draft

    def _prefilled(self, row: Row, fed: int, logits: torch.Tensor) -> None:
        super()._prefilled(row, fed, logits)
        if row.decoding and row.link.cursor is not None:
            row.link.cursor.restart(row.state.sequence[-1])  # the prefill is round 0: t* = the first token

    def _settled(self, row: Row, outcome: Outcome | None, seconds: float) -> None:
        link = row.link
        if outcome is not None:
            lookup_k = link.cursor.lookup_k
            link.cursor.advance(outcome)
            record_speculation(row.state, link.reply, lookup_k, outcome, link.wait_s, seconds)
            if row.state.speculation.adaptive_k and self.k_control is not None:
                self.k_control.observe(len(link.drafted), outcome.k, link.wait_s + seconds)
        elif link.parked:  # speculation off at this batch size: a plain step, not a degraded one
            link.parked = False
        else:  # a round without the draft (counted degraded); a row the draft failed is prefilled again after it
            row.state.stats.spec.degraded_rounds += 1
            if link.restart and not row.state.output.finished:
                link.restart = False
                self._link_row(row)


def _close_quietly(channel: Channel | None) -> None:
    if channel is None:
        return
    try:
        channel.close()
    except Exception:  # noqa: BLE001 - the link may be broken already; closing is best effort
        log.debug("closing a draft link failed", exc_info=True)
