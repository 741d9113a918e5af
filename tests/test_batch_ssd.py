"""SSD at batch > 1, the target side: SSDEngine over a speculator thread.

Greedy rows equal AR token for token, with one rounds message per step and
backups only for the rows that missed; sampled rows of different settings
follow the target's exact law (chi-square per row, from cache-hit rounds,
with a power check); a row the draft fails, a link that dies and a link
attached mid-batch lose no request; rows joining and leaving leave the
others' outputs alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from typing import Callable, Iterator

import pytest

import ssd.saguaro.protocol as protocol_module
import ssd.saguaro.speculator as speculator_module
from ssd.config import BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine
from ssd.factory import LoadedPair, make_engine
from ssd.saguaro.host import DraftThread
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.saguaro.protocol import ProposalReply
from ssd.transport.channel import Channel, ChannelClosed, Message
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import SMALL, small_models
from tests.test_speculator_batch import BackupSpy
from tests.spies import slow_draft_counting_cuts

GREEDY = SamplingConfig(temperature=0.0)


def ssd_spec(k: int = 4, budget: int = 8, kind: str = "geometric", adaptive: bool = False) -> SpeculationConfig:
    """adaptive: the defaults (anytime builds, free n-gram entries); off, each
    build runs to its budget and the cache holds the draft's entries only."""
    fanout = FanoutConfig(kind=kind, budget=budget, anytime=adaptive)
    return SpeculationConfig(mode="ssd", k=k, fanout=fanout, ngram_candidates=adaptive)


def request(prompt, n=20, sampling=GREEDY, k=4, budget=8, stop=(), kind="geometric", adaptive=False,
            **kw) -> GenerationRequest:
    generation = GenerationConfig(max_new_tokens=n, stop=list(stop))
    return GenerationRequest(prompt, sampling, generation, ssd_spec(k, budget, kind, adaptive), **kw)


def ar_ids(target, tokenizer, r: GenerationRequest) -> tuple[list[int], str]:
    alone = dataclasses.replace(r, speculation=None, on_tokens=None, cancelled=None)
    out = AREngine(target, tokenizer).generate(alone)
    return out.token_ids, out.finish_reason


class SpyChannel(Channel):
    """The target's end of the link: counts what the engine sends by op, and can die (ChannelClosed)."""

    def __init__(self, inner: Channel) -> None:
        self.inner = inner
        self.sent: Counter = Counter()
        self.prefills: list[dict] = []
        self.dead = False

    def send(self, message: Message) -> None:
        if self.dead:
            raise ChannelClosed("the draft side closed the link")
        self.sent[message.op] += 1
        if message.op == protocol_module.PREFILL:
            self.prefills.append(message.header)
        self.inner.send(message)

    def recv(self, timeout: float | None = None) -> Message:
        if self.dead:
            raise ChannelClosed("the draft side closed the link")
        return self.inner.recv(timeout)


def epochs_by_head(spy: SpyChannel) -> dict[int, list[int]]:
    """The epoch of each prefill the engine sent, by the first token of the row's prompt."""
    epochs: dict[int, list[int]] = {}
    for header in spy.prefills:
        epochs.setdefault(header["prompt"][0], []).append(header["epoch"])
    return epochs


@contextlib.contextmanager
def linked(
    target, draft, tokenizer, batching: BatchingConfig | None = None, timeout_s: float | None = None
) -> Iterator[tuple[SSDEngine, SpyChannel, DraftThread]]:
    """A batched SSD engine over a speculator thread, the link spied on; the thread stops after."""
    serving = DraftThread(draft)
    spy = SpyChannel(serving.channel)
    engine = SSDEngine(target, tokenizer, ssd_spec(), batching, channel=spy, draft_timeout_s=timeout_s)
    try:
        yield engine, spy, serving
    finally:
        serving.stop()


def run_batch(engine, requests, admit_at: dict[int, list] | None = None, after_step: Callable | None = None):
    """Admit `requests` (and admit_at[step] later), step until every row left; Finished in request order."""
    results, admit_at = {}, admit_at or {}
    for r in requests:
        engine.admit(r)
    step = 0
    while engine.rows or any(s >= step for s in admit_at):
        for r in admit_at.get(step, []):
            engine.admit(r)
        for finished in engine.step():
            results[id(finished.request)] = finished
        step += 1
        if after_step:
            after_step(step)
    return [results[id(r)] for r in [*requests, *(x for rs in admit_at.values() for x in rs)]]


def ok(finished):
    assert finished.error is None, finished.error
    return finished.result


def one_rounds_message_per_step(engine: SSDEngine, spy: SpyChannel) -> tuple[Callable, list[int]]:
    """An after_step hook checking that a step with decoding rows sent exactly one
    rounds message (and one without sent none); returns (hook, batch sizes seen)."""
    state = {"decoding": 0, "rounds": 0}
    sizes: list[int] = []

    def check(step: int) -> None:
        sent = spy.sent[protocol_module.ROUNDS] - state["rounds"]
        assert sent == (1 if state["decoding"] else 0), f"step {step}: {sent} rounds messages"
        sizes.append(state["decoding"])
        state["rounds"] += sent
        state["decoding"] = sum(row.decoding for row in engine.scheduler.rows) if engine.link_up else 0

    return check, sizes


# --- greedy: each row is AR alone ---------------------------------------------------------

def greedy_rows(tokenizer, target, adaptive: bool = False) -> list[GenerationRequest]:
    reference = ar_ids(target, tokenizer, request([1, 2, 3], 40))[0]
    stop = tokenizer.decode(reference)[5:7]  # completes inside a round
    return [
        request([1, 2, 3], 40, k=4, budget=8, stop=[stop], adaptive=adaptive),
        request([5], 17, k=2, budget=3, adaptive=adaptive),
        request([7, 7, 7, 7, 0, 1, 9, 12, 15], 30, k=6, budget=16, adaptive=adaptive),
        # 72 tokens: prefilled in chunks of 16
        request([3, 1, 4, 1, 5, 9, 2, 6] * 9, 25, k=3, budget=6, adaptive=adaptive),
        request([11, 4], 1, k=5, adaptive=adaptive),
    ]


def test_greedy_rows_equal_ar_with_anytime_builds_and_ngram_entries(tiny_models, tiny_tokenizer, monkeypatch):
    """The defaults, rows together: builds that the next round cuts short (every
    row's at the same step; the draft slowed here so that cuts happen) and free
    n-gram entries leave every row's output AR's."""
    target, draft = tiny_models
    cuts = slow_draft_counting_cuts(monkeypatch)
    rows = greedy_rows(tiny_tokenizer, target, adaptive=True)
    with linked(target, draft, tiny_tokenizer, BatchingConfig(prefill_chunk=16)) as (engine, _, _):
        outs = [ok(f) for f in run_batch(engine, rows)]
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
    assert any(cuts) and sum(out.stats.spec.hits for out in outs) > 0


def test_greedy_rows_equal_ar_with_one_exchange_per_step(tiny_models, tiny_tokenizer, monkeypatch):
    target, draft = tiny_models
    rows = greedy_rows(tiny_tokenizer, target)
    backups = BackupSpy(monkeypatch)
    with linked(target, draft, tiny_tokenizer, BatchingConfig(prefill_chunk=16)) as (engine, spy, serving):
        check, sizes = one_rounds_message_per_step(engine, spy)
        outs = [ok(f) for f in run_batch(engine, rows, after_step=check)]
    # Stopped, the speculator has handled every message: each row was released as it left.
    assert spy.sent[protocol_module.RELEASE] == len(rows) and not serving.speculator.sequences
    assert outs[0].finish_reason == "stop" and outs[1].finish_reason == "length"
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
        assert out.stats.mode == "ssd" and out.stats.k == r.speculation.k
        assert len(out.stats.drafted_at) <= r.speculation.k and out.stats.spec.degraded_rounds == 0
        assert out.stats.spec.rounds_after_hit + out.stats.spec.rounds_after_miss == out.stats.rounds
    assert max(sizes) >= 3  # rows really ran together
    spec = [out.stats.spec for out in outs]
    assert sum(s.hits for s in spec) > 0 and sum(s.lookups for s in spec) > sum(s.hits for s in spec)
    for s in spec:  # the shared wait, the draft's timings and the verification, recorded per row
        if s.rounds_after_hit + s.rounds_after_miss:
            assert s.wait_s > 0 and s.verify_s > 0 and s.backup_s > 0 and s.build_s > 0
    # Only rows that missed ran the backup: one backup per round that followed a miss.
    assert len(backups.calls) == sum(s.rounds_after_miss for s in spec)


# --- sampled: each row follows the target's exact law -----------------------------------
# The 4-token models of tests/test_distribution.py, K = 3, every outcome cached
# (budget (K + 1) * V): every round after the first is a hit. Tokens 5-7 of 8
# come after round 1 (which ends by token K + 1 = 4), so from hit rounds only.

CHI_K = 3
CHI_FULL = (CHI_K + 1) * SMALL.vocab_size
CHI_TOKENS = 8
CHI_POSITIONS = (5, 6, 7)
CHI_ROWS = [
    ([0, 1, 2], SamplingConfig(temperature=0.6)),
    ([3, 1], SamplingConfig(temperature=1.0, top_k=2)),
    ([2, 2, 0, 1, 3], SamplingConfig(temperature=1.0, top_p=0.8)),
    ([1], SamplingConfig(temperature=1.0)),
]
UNTRUNCATED = [0, 3]  # rows whose q has full support: a broken variant may swap theirs
CHI_SAMPLES = 250
CHI_BROKEN_SAMPLES = 200


@pytest.fixture(scope="module")
def chi_pair():
    return small_models()


def chi_draws(pair, samples: int) -> list[list[tuple[int, ...]]]:
    """Per row, its tokens at CHI_POSITIONS in `samples` batches, each row with its own seed.

    Asserts where they came from: hit rounds after the first."""
    target, draft = pair
    tokenizer = TinyTokenizer(SMALL.vocab_size)
    draws: list[list[tuple[int, ...]]] = [[] for _ in CHI_ROWS]
    hits = lookups = early = 0
    with SSDEngine.in_process(target, draft, tokenizer, ssd_spec(CHI_K, CHI_FULL, "uniform")) as engine:
        for seed in range(samples):
            rounds: list[list[list[int]]] = [[] for _ in CHI_ROWS]
            rows = [
                request(prompt, CHI_TOKENS, dataclasses.replace(sampling, seed=seed * len(CHI_ROWS) + i),
                        k=CHI_K, budget=CHI_FULL, kind="uniform", on_tokens=rounds[i].append)
                for i, (prompt, sampling) in enumerate(CHI_ROWS)
            ]
            for i, finished in enumerate(run_batch(engine, rows)):
                out = ok(finished)
                draws[i].append(tuple(out.token_ids[p] for p in CHI_POSITIONS))
                hits, lookups = hits + out.stats.spec.hits, lookups + out.stats.spec.lookups
                origin = [r for r, tokens in enumerate(rounds[i]) for _ in tokens]
                early += sum(origin[p] <= 1 for p in CHI_POSITIONS)
    assert lookups > 0 and hits == lookups and early == 0, (hits, lookups, early)
    return draws


def chi_pvalues(pair, draws, variant: str) -> list[float]:
    pvalues = []
    for samples, (prompt, sampling) in zip(draws, CHI_ROWS):
        exact = exact_marginal(pair[0], prompt, CHI_TOKENS, sampling, list(CHI_POSITIONS))
        pvalues.append(chi_square_pvalue(samples, exact))
        report_pvalue("batched ssd", f"{prompt} {sampling}", variant, len(samples), pvalues[-1])
    return pvalues


def test_each_sampled_row_matches_the_target_law(chi_pair):
    pvalues = chi_pvalues(chi_pair, chi_draws(chi_pair, CHI_SAMPLES), "exact")
    assert min(pvalues) > ALPHA, f"a row deviates from the target's law: {pvalues}"


def rotate_q_rows(parse):
    """An unpacking bug: each row of a proposals reply gets the next row's q rows.

    Only among rows whose q has full support and the same shape: a drafted
    token with q = 0 is refused by verify outright, which would hide the
    break from the law test instead of testing its power."""

    def broken(msg):
        replies = parse(msg)
        rows = [r for r in replies if isinstance(r, ProposalReply) and r.proposal.q is not None
                and bool((r.proposal.q > 0).all())]
        if len(rows) > 1 and len({r.proposal.q.shape for r in rows}) == 1:
            qs = [r.proposal.q for r in rows]
            for reply, q in zip(rows, qs[1:] + qs[:1]):
                reply.proposal = dataclasses.replace(reply.proposal, q=q)
        return replies

    return broken


def test_the_law_test_catches_q_rows_unpacked_to_the_wrong_row(chi_pair, monkeypatch):
    """The T = 0.6 row verified against the T = 1 row's q fails (measured p ~ 5e-8 at
    200 seeds); the other way round the two laws are too close to show."""
    monkeypatch.setattr(protocol_module, "parse_proposals", rotate_q_rows(protocol_module.parse_proposals))
    pvalues = chi_pvalues(chi_pair, chi_draws(chi_pair, CHI_BROKEN_SAMPLES), "q rows rotated")
    assert min(pvalues[i] for i in UNTRUNCATED) < ALPHA, f"rotated q rows went undetected: {pvalues}"


# --- the draft failing: no request is lost -------------------------------------------------

def three_rows(n: int = 30) -> list[GenerationRequest]:
    """Rows told apart on the draft side by their first prompt token."""
    return [request([1, 2, 3], n, k=3), request([5], n, k=4), request([7, 7, 7, 7, 0, 1, 9, 12, 15], n, k=2)]


def fail_row_once(monkeypatch, head: int, at_round: int) -> dict:
    """The speculator fails the row whose sequence starts with `head` on its
    `at_round`-th round, once; every answer after is recorded as (seq, head, hit)."""
    real = speculator_module.Speculator._answer
    seen: dict = {"rounds": 0, "failed_seq": None, "answers": []}

    def answer(self, row, batch_size):
        first = self.sequences[row.seq].committed[0]
        if first == head and seen["failed_seq"] is None:
            seen["rounds"] += 1
            if seen["rounds"] == at_round:
                seen["failed_seq"] = row.seq
                raise RuntimeError("injected draft failure")
        reply = real(self, row, batch_size)
        seen["answers"].append((row.seq, first, reply.hit))
        return reply

    monkeypatch.setattr(speculator_module.Speculator, "_answer", answer)
    return seen


def test_a_row_the_draft_fails_runs_one_plain_step_then_speculates_again(tiny_models, tiny_tokenizer, monkeypatch):
    target, draft = tiny_models
    rows = three_rows()
    seen = fail_row_once(monkeypatch, head=5, at_round=3)
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        outs = [ok(f) for f in run_batch(engine, rows)]
        assert engine.link_up  # one row's failure is not the link's
    assert seen["failed_seq"] is not None and not serving.speculator.sequences
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
    assert [out.stats.spec.degraded_rounds for out in outs] == [0, 1, 0]
    # Prefilled again under a new seq id, the row hit the cache again.
    assert spy.sent[protocol_module.PREFILL] == len(rows) + 1
    assert any(seq > seen["failed_seq"] and head == 5 and hit for seq, head, hit in seen["answers"])
    assert epochs_by_head(spy) == {1: [0], 5: [0, 1], 7: [0]}  # its second prefill starts a new draft stream


@pytest.mark.parametrize("how", ["closed", "speculator gone"])
def test_a_link_that_dies_mid_batch_loses_no_row(tiny_models, tiny_tokenizer, how):
    """The link closes (ChannelClosed), or the speculator stops answering (a
    timeout): every row goes on target-only and ends with AR's output."""
    target, draft = tiny_models
    rows = three_rows()
    with linked(target, draft, tiny_tokenizer, timeout_s=0.5) as (engine, spy, serving):

        def kill(step: int) -> None:
            if step == 4:
                if how == "closed":
                    spy.dead = True
                else:
                    serving.stop()

        outs = [ok(f) for f in run_batch(engine, rows, after_step=kill)]
        assert not engine.link_up
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
        spec = out.stats.spec
        assert spec.rounds_after_hit + spec.rounds_after_miss >= 3  # it speculated before the link died
        assert 0 < spec.degraded_rounds < out.stats.rounds


def test_a_link_attached_mid_batch_is_adopted(tiny_models, tiny_tokenizer):
    """The batch starts without a link; one attached (from another thread) after
    step 3 is adopted before step 4: every running row is prefilled on it, the
    one still prefilling its prompt too, and each speculates and hits from then on."""
    target, draft = tiny_models
    rows = [*three_rows()[:2], request([(3 * i + 1) % 16 for i in range(40)], 20, k=3)]  # 40 tokens: 5 chunks
    engine = SSDEngine(target, tiny_tokenizer, ssd_spec(), BatchingConfig(prefill_chunk=8))
    serving = DraftThread(draft)
    spy = SpyChannel(serving.channel)

    def attach(step: int) -> None:
        if step == 3:
            helper = threading.Thread(target=engine.attach, args=(spy,))
            helper.start()
            helper.join()

    try:
        assert not engine.link_up
        outs = [ok(f) for f in run_batch(engine, rows, after_step=attach)]
    finally:
        serving.stop()
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
        assert out.stats.spec.hits > 0
    # Steps 1 and 2 ran the decoding rows alone; the long row first decoded after the adoption.
    assert [out.stats.spec.degraded_rounds for out in outs] == [2, 2, 0]
    assert spy.sent[protocol_module.PREFILL] == len(rows) and not serving.speculator.sequences


# --- joining and leaving ---------------------------------------------------------------------

def test_rows_joining_and_leaving_mid_run_do_not_change_the_others(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    cancelled_rounds: list[list[int]] = []
    stays = request([1, 2, 3], 30, k=3)
    leaves = request([4, 5], 30, k=2, on_tokens=cancelled_rounds.append, cancelled=lambda: len(cancelled_rounds) >= 3)
    joins = request([6, 7, 8], 30, k=4, budget=12)
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        out_stays, out_leaves, out_joins = run_batch(engine, [stays, leaves], admit_at={3: [joins]})
    assert not serving.speculator.sequences  # the cancelled row was released too
    for r, finished in ((stays, out_stays), (joins, out_joins)):
        assert ok(finished).token_ids == ar_ids(target, tiny_tokenizer, r)[0]
        spec = ok(finished).stats.spec
        assert spec.hits > 0 and spec.degraded_rounds == 0  # the others' comings and goings never cost it the draft
    left = ok(out_leaves)
    assert left.finish_reason == "aborted" and len(cancelled_rounds) == 3
    assert left.token_ids == [t for r in cancelled_rounds for t in r]
    assert left.token_ids == ar_ids(target, tiny_tokenizer, leaves)[0][: len(left.token_ids)]


# --- the factory -----------------------------------------------------------------------------

def test_the_factory_builds_batched_ssd_with_its_own_speculator_thread(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = make_engine("ssd", LoadedPair(target, draft, tiny_tokenizer), ssd_spec(k=3), BatchingConfig(max_rows=3))
    try:
        assert isinstance(engine, SSDEngine) and engine.host is not None
        assert engine.batching.max_rows == 3
        plain = GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=20))
        out = engine.generate(plain)
        assert out.token_ids == ar_ids(target, tiny_tokenizer, plain)[0]
        assert out.stats.k == 3 and out.stats.spec.lookups > 0 and "draft" in out.stats.precision
    finally:
        engine.close()
    assert not engine.host.thread.is_alive()


def test_a_row_that_may_not_speculate_leaves_the_draft_idle(tiny_models, tiny_tokenizer):
    """k_policy {1: 0} (the plan where the draft's core is worth more to the target): the
    row is never prefilled on the draft nor sent a round, and the engine says it does not
    speculate (the cluster then lends the draft's core to the target). Output stays AR's."""
    target, draft = tiny_models
    r = request([5, 6, 7], 12)
    r = dataclasses.replace(r, speculation=dataclasses.replace(r.speculation, k_policy={1: 0}))
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        engine.admit(r)
        assert not engine.speculating()
        outs = []
        while engine.rows:
            outs += engine.step()
    assert (ok(outs[0]).token_ids, ok(outs[0]).finish_reason) == ar_ids(target, tiny_tokenizer, r)
    assert spy.sent[protocol_module.PREFILL] == spy.sent[protocol_module.ROUNDS] == 0


def test_past_the_k_policy_s_batch_size_rows_run_plain_steps_then_speculate_again(tiny_models, tiny_tokenizer):
    """k_policy {1: 4, 3: 0}: with three rows every row runs plain target steps
    (no rounds message, its draft state released); once one row leaves, the
    other two are prefilled on the draft again and speculate. Output stays AR's."""
    target, draft = tiny_models
    policy = {1: 4, 3: 0}
    rows = [dataclasses.replace(r, speculation=dataclasses.replace(r.speculation, k_policy=policy))
            for r in (request([1, 2, 3], 6), request([5], 30), request([7, 7, 7, 7, 0, 1], 30))]
    with linked(target, draft, tiny_tokenizer) as (engine, spy, serving):
        rounds_while_three = []
        outs = [ok(f) for f in run_batch(
            engine, rows, after_step=lambda step: rounds_while_three.append(
                (len(engine.scheduler.rows), spy.sent[protocol_module.ROUNDS])))]
    for r, out in zip(rows, outs):
        assert (out.token_ids, out.finish_reason) == ar_ids(target, tiny_tokenizer, r)
        assert out.stats.spec.degraded_rounds == 0  # parked is not degraded: the link was fine
    three = [sent for n, sent in rounds_while_three if n == 3]
    assert len(set(three)) == 1  # no rounds message while three rows ran
    # the third row, admitted where K is 0, is not prefilled on the draft until it may speculate;
    # the second, admitted at two rows, is, and again (on a new draft stream) after it was parked
    assert spy.sent[protocol_module.PREFILL] == 2 + 2
    assert epochs_by_head(spy) == {1: [0], 5: [0, 1], 7: [0]}
    assert spy.sent[protocol_module.RELEASE] == 2 + 2 and not serving.speculator.sequences  # parked, then left
    assert sum(out.stats.spec.hits for out in outs[1:]) > 0  # and they hit the cache again
