"""SSD at batch > 1, the target side: the rows of a continuous batch share one
draft link. Each step sends every decoding row's last outcome in ONE `rounds`
message and receives ONE `proposals` reply, so a round costs one message each
way whatever the batch size; then the packed target forward verifies every
row's speculation and each row settles on its own with the shared `verify`.

The draft never costs a request, as with one sequence (ssd.engine.ssd):
- one row failing on the draft (a RowError in the reply) runs a plain target
  step inside the same packed forward, then is released and prefilled again
  under a new seq id, so it speculates again from the next step;
- a link that times out or closes degrades every row: the batch goes on
  target-only until `attach` hands over a new link (from any thread), which
  is adopted before the next step, every running row prefilled on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ssd.config import BatchingConfig, SpeculationConfig
from ssd.engine.base import Verifier
from ssd.engine.batch import BatchedEngine, Finished, Row
from ssd.engine.request import GenerationRequest
from ssd.engine.sd import draft_length
from ssd.engine.ssd import LINK_FAILURES, DraftCursor, DraftLinked, cut_proposal, record_speculation
from ssd.models.tokenizer import Tokenizer
from ssd.saguaro import protocol
from ssd.saguaro.protocol import ProposalReply, RowError, RowReply
from ssd.transport.channel import Channel
from ssd.verify import verify

log = logging.getLogger(__name__)


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

    def clear(self) -> None:
        self.reply, self.drafted, self.q, self.wait_s = None, (), None, 0.0

    def take(self, reply: ProposalReply, remaining: int, wait_s: float) -> None:
        drafted, self.q = cut_proposal(reply, remaining)
        self.reply, self.drafted, self.wait_s = reply, tuple(drafted), wait_s


class BatchedSSDEngine(DraftLinked, BatchedEngine):
    """Continuous batching with SSD: one rounds/proposals exchange per step, one packed verification."""

    mode = "ssd"

    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Tokenizer,
        channel: Channel | None,
        speculation: SpeculationConfig,
        batching: BatchingConfig | None = None,
        verifier: Verifier = verify,
        draft_timeout_s: float | None = None,
        draft_precision: str | None = None,
    ) -> None:
        """`speculation`: the settings for requests that bring none; the draft's
        caches live with the speculator, so admission reserves target KV only."""
        super().__init__(target, tokenizer, batching, verifier, speculation)
        self._init_link(channel, draft_timeout_s, draft_precision)

    def admit(self, request: GenerationRequest) -> None:
        """Add a row and prefill the draft at once: its prefill overlaps the target's chunked one."""
        super().admit(request)
        row = self._rows[-1]
        row.link = RowLink()
        self._link_row(row)

    def step(self) -> list[Finished]:
        if self._adopt():
            log.info("draft link adopted with %d running rows; each is prefilled on it", len(self._rows))
            for row in self._rows:
                self._link_row(row)
        before = list(self._rows)
        left = super().step()
        self._release_left(before)
        return left

    # --- the draft link, per row --------------------------------------------------------

    def _link_row(self, row: Row) -> None:
        """Start the row on the speculator under a new seq id: its prompt while it
        prefills, else the sequence so far, whose last token the next round reports."""
        state = row.state
        if not row.decoding:
            row.link.cursor = self._start_on_draft(state.sequence, state)
            return
        row.link.cursor = self._start_on_draft(state.sequence[:-1], state)
        row.link.cursor.restart(state.sequence[-1])

    def _release_left(self, before: list[Row]) -> None:
        """Rows that left this step (finished, cancelled, failed) free their draft state."""
        staying = {id(row) for row in self._rows}
        for row in before:
            if id(row) not in staying and row.link.cursor is not None:
                self._send(protocol.release(row.link.cursor.seq))

    def _row_failed(self, row: Row, reply: RowError) -> None:
        """The draft failed this row alone: drop its draft state; it is prefilled again after this step."""
        log.warning("draft failed request %r (seq %d): %s; it runs a plain step, then is prefilled again",
                    row.request.request_id, reply.seq, reply.error)
        self._send(protocol.release(reply.seq))
        row.link.cursor, row.link.restart = None, True

    def _exchange(self, rows: list[Row]) -> list[RowReply]:
        """One rounds message for `rows`, one proposals reply, its rows in the same order."""
        self.channel.send(protocol.rounds([row.link.cursor.round_row() for row in rows]))
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
        return draft_length(row.state) + 1

    def _draft(self, rows: list[Row]) -> None:
        """Every decoding row's speculation for this step, from one exchange; a link
        failure leaves every row without one (plain target steps)."""
        for row in rows:
            row.link.clear()
        if self.channel is None or not rows:
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
                row.link.take(reply, row.state.output.remaining, waited)

    def _scored(self, row: Row) -> list[int]:
        return [*row.state.sequence, *row.link.drafted][row.target.length :]

    def _prefilled(self, row: Row, fed: int, logits: torch.Tensor) -> None:
        super()._prefilled(row, fed, logits)
        if row.decoding and row.link.cursor is not None:
            row.link.cursor.restart(row.state.sequence[-1])  # the prefill is round 0: t* = the first token

    def _settle(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        if row.link.reply is None:
            self._plain_step(row, logits, forward_s)
        else:
            self._verify_speculation(row, logits, forward_s)

    def _verify_speculation(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        started = time.perf_counter()
        state, link = row.state, row.link
        drafted, k = list(link.drafted), len(link.drafted)
        outcome = self._judge(state, drafted, link.q, logits[-(k + 1) :])
        row.target.rollback(len(state.sequence) + outcome.k)
        verify_s = forward_s + time.perf_counter() - started
        state.stats.record_round(drafted=k, accepted=outcome.k, target_s=verify_s)
        record_speculation(state, link.reply, link.cursor.lookup_k, outcome, link.wait_s, verify_s)
        link.cursor.advance(outcome)
        self._emit(state, outcome.tokens(drafted))

    def _plain_step(self, row: Row, logits: torch.Tensor, forward_s: float) -> None:
        """A round without the draft (counted degraded); a row the draft failed is prefilled again after it."""
        started = time.perf_counter()
        state = row.state
        token = self._next_token(state, logits[-1])
        state.stats.record_round(drafted=0, accepted=0, target_s=forward_s + time.perf_counter() - started)
        state.stats.spec.degraded_rounds += 1
        self._emit(state, [token])
        if row.link.restart and not state.output.finished:
            row.link.restart = False
            self._link_row(row)
