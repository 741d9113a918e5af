"""The draft side of SSD at batch > 1: batched rounds sent straight to a
Speculator over the in-process channel, playing the target by hand."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import ssd.saguaro.speculator as speculator_module
from ssd.config import FanoutConfig, SamplingConfig, SpeculationConfig
from ssd.saguaro import protocol
from ssd.saguaro.protocol import ProposalReply, RoundRow, RowError
from ssd.saguaro.speculator import Speculator
from ssd.transport import inprocess_pair
from ssd.transport.channel import ChannelTimeout, Message
from ssd.transport.distributed import decode_header, encode_header

K = 3
PROMPTS = [[1, 2, 3], [5], [7, 7, 0, 1, 9]]
SAMPLINGS = [  # a greedy row (no q) between two sampled ones
    SamplingConfig(temperature=1.0, seed=1),
    SamplingConfig(temperature=0.0),
    SamplingConfig(temperature=0.7, top_k=5, seed=3),
]


def spec(budget: int = 4, batch_budget: int | None = None, **kw) -> SpeculationConfig:
    return SpeculationConfig(mode="ssd", k=K, fanout=FanoutConfig(budget=budget, batch_budget=batch_budget), **kw)


class Draft:
    """A Speculator and the target's end of its channel. Each exchange queues
    the messages and a shutdown, then lets the speculator serve them on this
    thread: deterministic, and no thread to leak."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.link, draft_end = inprocess_pair()
        self.speculator = Speculator(model, draft_end)

    def exchange(self, *messages: Message) -> list[Message]:
        for message in messages + (protocol.shutdown(),):
            self.link.send(message)
        self.speculator.serve()
        replies = []
        while True:
            try:
                replies.append(self.link.recv(timeout=0))
            except ChannelTimeout:
                return replies

    def prefill(self, settings: SpeculationConfig, rows: int = 3) -> None:
        self.exchange(*[protocol.prefill(i, PROMPTS[i], SAMPLINGS[i], settings) for i in range(rows)])

    def rounds(self, rows: list[RoundRow]) -> list[ProposalReply | RowError]:
        """One batched round; exactly one reply, carrying every row in order."""
        (reply,) = self.exchange(protocol.rounds(rows))
        replies = protocol.parse_proposals(reply)
        assert [r.seq for r in replies] == [row.seq for row in rows]
        return replies

    def outcomes(self, seq: int) -> list[tuple[int, int]]:
        return self.speculator.sequences[seq].cache.outcomes()

    def cached(self, seq: int, k: int, token: int):
        return self.speculator.sequences[seq].cache.lookup(k, token)

    def missing(self, seq: int) -> tuple[int, int]:
        """An outcome (all K accepted, then t*) whose speculation was not prepared."""
        vocab = self.speculator.vocab_size
        return next((K, t) for t in range(vocab) if (K, t) not in self.speculator.sequences[seq].cache)


def first_rounds(rows: int = 3) -> list[RoundRow]:
    """Round 0's outcomes: nothing drafted, t* = a token after each prompt."""
    return [RoundRow(i, 0, 4 + i) for i in range(rows)]


class BackupSpy:
    """Every backup proposal from now on: (kind, proposal), in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, object]] = []
        real = speculator_module.make_backup

        def make(kind, vocab_size):
            backup = real(kind, vocab_size)
            propose = backup.propose

            def spied(*args, **kwargs):
                out = propose(*args, **kwargs)
                self.calls.append((kind, out))
                return out

            backup.propose = spied
            return backup

        monkeypatch.setattr(speculator_module, "make_backup", make)

    def kinds(self) -> Counter:
        return Counter(kind for kind, _ in self.calls)


def same_q(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_hits_answer_from_the_cache_and_only_misses_run_the_backup(tiny_models, monkeypatch):
    draft = Draft(tiny_models[1])
    draft.prefill(spec())
    spy = BackupSpy(monkeypatch)
    first = draft.rounds(first_rounds())
    assert [r.hit for r in first] == [False] * 3 and spy.kinds() == {"neural": 3}  # no cache yet
    hits = [draft.outcomes(0)[0], draft.outcomes(1)[-1]]
    want = [draft.cached(0, *hits[0]), draft.cached(1, *hits[1])]
    miss = draft.missing(2)
    spy.calls.clear()
    replies = draft.rounds([RoundRow(0, *hits[0]), RoundRow(1, *hits[1]), RoundRow(2, *miss)])
    assert [r.hit for r in replies] == [True, True, False]
    assert [r.proposal.source for r in replies] == ["cache", "cache", "neural"]
    for reply, cached in zip(replies, want):
        assert reply.proposal.tokens == cached.tokens and same_q(reply.proposal.q, cached.q)
        assert reply.backup_s == 0.0
    assert len(spy.calls) == 1  # the one missed row, not the batch
    assert replies[2].proposal.tokens == spy.calls[0][1].tokens and replies[2].backup_s > 0


def test_q_rows_unpack_to_their_row(tiny_models, monkeypatch):
    draft = Draft(tiny_models[1])
    draft.prefill(spec())
    spy = BackupSpy(monkeypatch)
    message, = draft.exchange(protocol.rounds(first_rounds()))
    assert message.op == protocol.PROPOSALS and len(message.tensors) == 1
    assert message.tensors[0].shape == (2 * K, draft.speculator.vocab_size)  # rows 0 and 2: K rows each
    replies = protocol.parse_proposals(message)
    drafted = [proposal for _, proposal in spy.calls]
    assert replies[1].proposal.q is None and drafted[1].q is None  # greedy: no q on the wire
    for i in (0, 2):
        assert replies[i].proposal.tokens == drafted[i].tokens
        assert torch.equal(replies[i].proposal.q, drafted[i].q)
    assert not torch.equal(replies[0].proposal.q, replies[2].proposal.q)  # the check has power


def test_a_failing_row_returns_its_error_and_the_others_go_on(tiny_models):
    draft = Draft(tiny_models[1])
    draft.prefill(spec())
    vocab = draft.speculator.vocab_size
    # Row 1's t* is outside the draft's vocabulary: its backup fails; seq 9 was never prefilled.
    rows = [RoundRow(0, 0, 4), RoundRow(1, 0, vocab + 5), RoundRow(2, 0, 6), RoundRow(9, 0, 1)]
    replies = draft.rounds(rows)
    assert [type(r) for r in replies] == [ProposalReply, RowError, ProposalReply, RowError]
    assert "IndexError" in replies[1].error and "KeyError" in replies[3].error
    assert all(len(replies[i].proposal.tokens) == K for i in (0, 2))
    later = draft.rounds([RoundRow(0, *draft.outcomes(0)[0]), RoundRow(1, 0, 2), RoundRow(2, *draft.missing(2))])
    assert [type(r) for r in later] == [ProposalReply, RowError, ProposalReply]
    assert later[0].hit and later[1].error == replies[1].error


def test_a_row_whose_cache_build_failed_reports_it_next_round(tiny_models, monkeypatch):
    """The reply goes out before the builds, so a build failure is that row's
    answer next round; the row stays failed until released and prefilled again."""
    draft = Draft(tiny_models[1])
    draft.prefill(spec())
    real = speculator_module.build_caches

    def breaks_on_row_1(jobs):  # row 1's own work fails; the others' builds run, in one lockstep
        broken = [job.committed[: len(PROMPTS[1])] == PROMPTS[1] for job in jobs]
        for job, bad in zip(jobs, broken):
            if bad:
                job.sampling = None  # its first draw raises
        return [RuntimeError("build broke") if bad else out for bad, out in zip(broken, real(jobs))]

    monkeypatch.setattr(speculator_module, "build_caches", breaks_on_row_1)
    assert all(isinstance(r, ProposalReply) for r in draft.rounds(first_rounds()))
    monkeypatch.setattr(speculator_module, "build_caches", real)
    for _ in range(2):
        replies = draft.rounds([RoundRow(i, *draft.missing(i)) if i != 1 else RoundRow(1, 0, 2) for i in range(3)])
        assert [type(r) for r in replies] == [ProposalReply, RowError, ProposalReply]
        assert replies[1].error == "RuntimeError: build broke"
    draft.exchange(protocol.release(1), protocol.prefill(1, PROMPTS[1], SAMPLINGS[1], spec()))
    assert isinstance(draft.rounds([RoundRow(1, 0, 2)])[0], ProposalReply)


def test_the_batch_branch_cap_bounds_the_cached_outcomes(tiny_models):
    entries = {}
    for cap in (None, 6):
        draft = Draft(tiny_models[1])
        draft.prefill(spec(budget=4, batch_budget=cap))
        for _ in range(3):
            rows = [RoundRow(i, *(draft.outcomes(i)[0] if draft.outcomes(i) else (0, 4 + i))) for i in range(3)]
            draft.rounds(rows)
            entries[cap] = [len(draft.outcomes(i)) for i in range(3)]
            assert sum(entries[cap]) <= (cap or 12)
    assert entries == {None: [4, 4, 4], 6: [2, 2, 2]}  # the cap held, and it was binding


def test_a_lone_round_keeps_the_cap_for_a_batch_of_one(tiny_models):
    draft = Draft(tiny_models[1])
    draft.prefill(spec(budget=4, batch_budget=3), rows=1)
    draft.rounds([RoundRow(0, 0, 4)])
    assert len(draft.outcomes(0)) == 3


def test_the_backup_is_the_policys_at_the_batch_size(tiny_models, monkeypatch):
    draft = Draft(tiny_models[1])
    draft.prefill(spec(backup_policy={1: "neural", 3: "ngram"}))
    spy = BackupSpy(monkeypatch)
    two = draft.rounds(first_rounds(2))  # a batch of two: neural
    assert spy.kinds() == {"neural": 2} and {r.proposal.source for r in two} == {"neural"}
    spy.calls.clear()
    three = draft.rounds([RoundRow(i, *draft.missing(i)) if i < 2 else RoundRow(2, 0, 6) for i in range(3)])
    assert spy.kinds() == {"ngram": 3} and {r.proposal.source for r in three} == {"ngram"}
    spy.calls.clear()
    (lone,) = draft.rounds([RoundRow(0, *draft.missing(0))])  # a batch of one
    assert lone.proposal.source == "neural" and spy.kinds() == {"neural": 1}


def next_outcome(draft: Draft, seq: int, step: int) -> tuple[int, int]:
    """Alternate hits and misses: the cache's first outcome on odd steps, a missing one on even."""
    return draft.outcomes(seq)[0] if step % 2 else draft.missing(seq)


def test_batched_replies_equal_lone_replies_row_by_row(tiny_models):
    """Same seeds, same outcomes: a row's proposals (tokens and q) and caches do
    not depend on whether it was asked alone or in a batch."""
    lone, batched = Draft(tiny_models[1]), Draft(tiny_models[1])
    lone.prefill(spec())
    batched.prefill(spec())
    rows = first_rounds()
    hits = Counter()
    for step in range(6):
        alone = [reply for row in rows for reply in lone.rounds([row])]
        together = batched.rounds(rows)
        for a, b in zip(alone, together):
            assert (a.seq, a.hit, a.proposal.source, a.proposal.tokens) == (b.seq, b.hit, b.proposal.source, b.proposal.tokens)
            assert same_q(a.proposal.q, b.proposal.q)
            hits[a.hit] += 1
        for i in range(3):
            assert lone.outcomes(i) == batched.outcomes(i)
        rows = [RoundRow(i, *next_outcome(lone, i, step)) for i in range(3)]
    assert hits[True] > 0 and hits[False] > 0  # both paths compared


def test_proposals_round_trip_through_the_wire_header():
    """The batched messages are plain data (msgpack) plus one q tensor; parsing inverts packing."""
    vocab = 5
    q0, q2 = torch.rand(2, vocab, dtype=torch.float64), torch.rand(2, vocab, dtype=torch.float64)
    rows = [
        ProposalReply(0, True, speculator_module.Proposal([1, 2], q0, "cache"), 0.0, 0.25),
        ProposalReply(1, False, speculator_module.Proposal([3, 3], None, "ngram"), 0.5, 0.0),
        RowError(7, "IndexError: out of range"),
        ProposalReply(2, False, speculator_module.Proposal([4, 0], q2, "neural"), 0.125, 0.5),
    ]
    message = protocol.proposals(rows)
    op, header, specs = decode_header(encode_header(message))
    assert op == protocol.PROPOSALS and [list(s) for _, s in specs] == [[4, vocab]]
    back = protocol.parse_proposals(Message(op, header, message.tensors))
    assert back[2] == rows[2] and back[1].proposal.q is None
    for i in (0, 1, 3):
        assert (back[i].seq, back[i].hit, back[i].proposal.tokens, back[i].proposal.source) == (
            rows[i].seq, rows[i].hit, rows[i].proposal.tokens, rows[i].proposal.source)
        assert (back[i].backup_s, back[i].build_s) == (rows[i].backup_s, rows[i].build_s)
    assert torch.equal(back[0].proposal.q, q0) and torch.equal(back[3].proposal.q, q2)
    sent = [RoundRow(3, 1, 9), RoundRow(0, 0, 2)]
    op, header, _ = decode_header(encode_header(protocol.rounds(sent)))
    assert protocol.parse_rounds(Message(op, header)) == sent
    with pytest.raises(protocol.DraftError, match="boom"):
        protocol.parse_proposals(protocol.error(-1, "boom"))
    with pytest.raises(RuntimeError, match="expected 'proposals'"):
        protocol.parse_proposals(protocol.rounds(sent))


def test_each_prefill_epoch_of_a_row_draws_its_own_stream(tiny_models):
    """The same row prefilled at epoch 0 twice drafts the same tokens (a seed
    reproduces); at epoch 1 it starts another stream, never the first again."""
    seed = SAMPLINGS[0].seed
    assert len({speculator_module.draft_seed(seed, epoch) % 2**32 for epoch in range(1000)}) == 1000
    assert speculator_module.draft_seed(seed, 0) == speculator_module.draft_seed(seed)
    drafted = {}
    for name, epoch in (("first", 0), ("again", 0), ("next", 1)):
        draft = Draft(tiny_models[1])
        draft.exchange(protocol.prefill(0, PROMPTS[0], SAMPLINGS[0], spec(backup="random"), epoch))
        assert draft.speculator.sequences[0].gen.initial_seed() == speculator_module.draft_seed(seed, epoch)
        (reply,) = draft.rounds([RoundRow(0, 0, 4)])
        drafted[name] = reply.proposal.tokens
    assert drafted["first"] == drafted["again"] != drafted["next"]
