"""The SSD wire protocol between target rank 0 and the draft, as Messages.

Ops target -> draft: prefill(seq, prompt, settings, epoch), rounds([(seq, k, t*,
draft_k, room), ...]), release(seq), shutdown. Draft -> target: proposals(rows) answers a
rounds message with one row per round row, in order; error(seq, text) is a
whole message failing. Headers hold only plain data (msgpack-able); q rows
travel as a tensor.

Every round is one rounds/proposals exchange, one row per sequence (a lone
request is a batch of one), so a round costs one message each way whatever
the batch size:

    rounds     header {"rows": [{"seq", "k", "token", "draft_k", "room"}, ...]}, no tensors
               draft_k: the length of the speculations the draft makes for
               this message (a miss's backup, the cache it builds next);
               None: the row's speculation.k (ssd.saguaro.adaptive_k sets it)
               room: the most drafted tokens the target verifies this round
               (its max_new_tokens left, less the token a round adds); None: all
    proposals  header {"rows": [row, ...], "q_sparse"?: [rows, V]},
               tensors [q_all] or [] (all greedy or coupled), or with q_sparse
               q_all's nonzero entries [per-row counts, column ids, values]
               row = {"seq", "hit", "source", "tokens", "backup_s", "build_s",
                      "q": [start, stop] | None}   q rows = q_all[start:stop]
                   | {"seq", "error"}              this row alone failed
               q_all: bfloat16 (ssd.sampling.Q_DTYPE), the rows the tokens were
               drawn from; a row's q covers its first min(len(tokens), room)
               tokens, the ones the target reads (`shipped`); sent as its
               nonzero entries where those take fewer bytes (top-k, top-p,
               min-p rows), bit for bit the same rows once unpacked

A row error leaves the other rows' proposals valid: the target runs that row
without the draft (and may prefill it again under a new seq id).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ssd.config import SamplingConfig, SpeculationConfig, from_dict
from ssd.saguaro.cache import Proposal
from ssd.transport.channel import Channel, Message

PREFILL, ROUNDS, RELEASE, SHUTDOWN, PING = "prefill", "rounds", "release", "shutdown", "ping"
PROPOSALS, ERROR, PONG = "proposals", "error", "pong"


class DraftError(RuntimeError):
    """The draft side failed while handling a message; the text is its error."""


@dataclass(frozen=True)
class Prefill:
    """A sequence to hold on the draft: its prompt (or the sequence so far) and settings.

    `epoch` counts the times this request was prefilled on a draft before
    (0 at admission; a parked, failed or re-linked row comes back with the
    next one): the draft keys the row's random stream by (seed, epoch), so a
    row prefilled again never replays draws it used before.

    `reuse`: the engine's prefix cache is on (batching.prefix_cache), so the
    draft may start the sequence from a released one's cache that shares the
    prompt's start, and keep this one's when it is released.
    """

    seq: int
    prompt: list[int]
    sampling: SamplingConfig
    speculation: SpeculationConfig
    epoch: int = 0
    reuse: bool = False


def prefill(
    seq: int, prompt: list[int], sampling: SamplingConfig, speculation: SpeculationConfig, epoch: int = 0,
    reuse: bool = False,
) -> Message:
    return Message(PREFILL, {
        "seq": seq, "prompt": list(prompt), "epoch": epoch, "reuse": reuse,
        "sampling": dataclasses.asdict(sampling), "speculation": dataclasses.asdict(speculation),
    })


def parse_prefill(msg: Message) -> Prefill:
    h = msg.header
    speculation = from_dict(SpeculationConfig, h["speculation"])
    return Prefill(h["seq"], h["prompt"], from_dict(SamplingConfig, h["sampling"]), speculation, h["epoch"],
                   h.get("reuse", False))


@dataclass(frozen=True)
class RoundRow:
    """One sequence's verification outcome: k drafts accepted, then token t*;
    the K the draft's next speculations have (None: the row's speculation.k);
    and the most drafted tokens the target verifies this round (None: all)."""

    seq: int
    k: int
    token: int
    draft_k: int | None = None
    room: int | None = None


def rounds(rows: Sequence[RoundRow]) -> Message:
    """Every row's outcome of one batched verification, in one message."""
    return Message(ROUNDS, {"rows": [_round_header(row) for row in rows]})


def parse_rounds(msg: Message) -> list[RoundRow]:
    return [_round_row(h) for h in msg.header["rows"]]


def _round_header(row: RoundRow) -> dict[str, int | None]:
    return {"seq": row.seq, "k": row.k, "token": row.token, "draft_k": row.draft_k, "room": row.room}


def _round_row(h: dict[str, Any]) -> RoundRow:
    return RoundRow(h["seq"], h["k"], h["token"], h.get("draft_k"), h.get("room"))


def shipped(proposal: Proposal, room: int | None) -> Proposal:
    """`proposal` as it crosses the link: q only for the tokens the target reads.

    The target verifies the first min(len(tokens), room) drafted tokens (a round
    never runs past max_new_tokens), so q rows past them would never be read;
    the tokens stay whole, as the draft's own record of what it proposed.
    """
    if proposal.q is None or room is None or room >= proposal.q.shape[0]:
        return proposal
    return dataclasses.replace(proposal, q=proposal.q[: max(room, 0)])


def release(seq: int) -> Message:
    return Message(RELEASE, {"seq": seq})


def shutdown() -> Message:
    return Message(SHUTDOWN)


def ping() -> Message:
    """Answered at once with a pong: times the link's round trip."""
    return Message(PING)


def round_trip_s(channel: Channel, times: int = 20) -> float:
    """The median seconds of `times` ping-pongs over a link no engine uses yet."""
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        channel.send(ping())
        reply = channel.recv()
        if reply.op != PONG:
            raise DraftError(f"expected a pong, got {reply.op!r}")
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


@dataclass
class ProposalReply:
    seq: int
    hit: bool
    proposal: Proposal
    backup_s: float  # time spent on the backup this round (0 on a hit)
    build_s: float  # time the previous cache build took


@dataclass
class RowError:
    """One row of a round failed on the draft; its text says how."""

    seq: int
    error: str


RowReply = ProposalReply | RowError


def error(seq: int, text: str) -> Message:
    return Message(ERROR, {"seq": seq, "error": text})


def proposals(rows: Sequence[RowReply]) -> Message:
    """One reply for a whole rounds message: the rows' q stacked into one
    tensor (one transfer instead of one per row), each row's span in its header."""
    headers: list[dict[str, Any]] = []
    qs: list[torch.Tensor] = []
    offset = 0
    for row in rows:
        if isinstance(row, RowError):
            headers.append({"seq": row.seq, "error": row.error})
            continue
        header, q = _reply_header(row), row.proposal.q
        header["q"] = None if q is None else [offset, offset + q.shape[0]]
        if q is not None:
            qs.append(q)
            offset += q.shape[0]
        headers.append(header)
    header: dict[str, Any] = {"rows": headers}
    tensors = pack_q(torch.cat([q.to(qs[0].device) for q in qs]), header) if qs else []
    return Message(PROPOSALS, header, tensors)


# A sparse q costs, besides each nonzero value, its column id and each row's count (int32).
_INDEX_BYTES = 4
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_q(q_all: torch.Tensor, header: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors that carry q_all: the dense rows, or, where they take fewer bytes,
    the nonzero entries (per-row counts, column ids, values; header["q_sparse"] set
    to the shape). Rows drawn under top-k, top-p or min-p are mostly zeros; a
    T = 1 row has next to none, and is sent dense after one count of its nonzeros."""
    bits = q_all.view(_SAME_WIDTH_INT[q_all.element_size()])  # an exact count: no float compare, -0.0 kept
    nonzero = int(torch.count_nonzero(bits))
    sparse_bytes = nonzero * (_INDEX_BYTES + q_all.element_size()) + q_all.shape[0] * _INDEX_BYTES
    if sparse_bytes >= q_all.numel() * q_all.element_size():
        return [q_all]
    header["q_sparse"] = list(q_all.shape)
    rows, columns = bits.nonzero(as_tuple=True)
    counts = torch.count_nonzero(bits, dim=-1)
    return [counts.to(torch.int32), columns.to(torch.int32), q_all[rows, columns]]


def unpack_q(tensors: Sequence[torch.Tensor], header: dict[str, Any]) -> torch.Tensor | None:
    """q_all from the tensors `pack_q` made (None: there were none)."""
    if not tensors:
        return None
    if "q_sparse" not in header:
        return tensors[0]
    counts, columns, values = tensors
    rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts.long())
    q_all = values.new_zeros(header["q_sparse"])
    q_all[rows, columns.long()] = values
    return q_all


def parse_proposals(msg: Message) -> list[RowReply]:
    """The rows of a proposals message, in order; a whole-message error raises DraftError."""
    _expect(msg, PROPOSALS)
    packed = unpack_q(msg.tensors, msg.header)
    return [_row_reply(h, packed) for h in msg.header["rows"]]


def _row_reply(h: dict[str, Any], packed: torch.Tensor | None) -> RowReply:
    if "error" in h:
        return RowError(h["seq"], h["error"])
    span = h["q"]
    if span is not None and packed is None:
        raise RuntimeError(f"protocol error: row {h['seq']} has q rows {span} but the message has no q")
    return _reply(h, None if span is None else packed[span[0] : span[1]])


def _reply_header(reply: ProposalReply) -> dict[str, Any]:
    drafted = reply.proposal
    return {
        "seq": reply.seq, "hit": reply.hit, "source": drafted.source, "tokens": drafted.tokens,
        "backup_s": reply.backup_s, "build_s": reply.build_s,
    }


def _reply(h: dict[str, Any], q: torch.Tensor | None) -> ProposalReply:
    return ProposalReply(h["seq"], h["hit"], Proposal(h["tokens"], q, h["source"]), h["backup_s"], h["build_s"])


def _expect(msg: Message, op: str) -> None:
    """Raise the draft's error, or on a reply of the wrong kind."""
    if msg.op == ERROR:
        raise DraftError(msg.header["error"])
    if msg.op != op:
        raise RuntimeError(f"protocol error: expected {op!r}, got {msg.op!r}")
