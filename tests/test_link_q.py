"""Less q on the draft link: bfloat16 rows, only the rows the target reads, none at T = 0,
and the output law still the target's with those rows crossing a real gloo link.

Bytes: SSD on the tiny pair through a link that counts every proposals reply
(ssd.tools.bench.q_bytes); "before" is the format before: one float32 row per
drafted token of a sampled row.

Exactness: SSD with the speculator across a two-rank gloo link (both ends in
this process; the bfloat16 rows cross it as bytes, counted), T = 1, the joint
of tokens 2, 5 and 6 of 7 on the 4-token model of test_distribution (token 2
comes from round 1, a neural backup's draft or its correction; tokens 5 and 6
from later rounds, mostly cache hits: asserted), chi-square against the
target's exact law, alpha 0.001. Power: bfloat16 rounding moves an entry by at
most 2^-8 of itself, so verifying other rows than the ones drawn from (their
float32 originals, say) shifts this law by ~1e-3, far below what SAMPLES seeds
see (nor would an output shifted that little matter, but it would not be
exact). The power check makes that same mismatch large: the draft draws from
its rows in two-bit fixed point and ships the bfloat16 rows (p ~ 1e-8).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import ssd.engine.drafting as drafting_module
import ssd.saguaro.builder as builder_module
from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.saguaro import protocol
from ssd.saguaro.cache import Proposal
from ssd.saguaro.host import serve_link
from ssd.saguaro.target import SSDEngine
from ssd.sampling import Q_DTYPE
from ssd.tools.bench.q_bytes import CountingChannel, QBytes, count_q_bytes, speculation
from ssd.tools.bench.sampling_check import run_rows
from ssd.transport.distributed import DistributedChannel, free_port, serve_store
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import PROMPT, SMALL, small_models

HOST = "127.0.0.1"
PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8]]
T1 = SamplingConfig(temperature=1.0)


# --- bytes -------------------------------------------------------------------------------


def test_a_sampled_round_ships_at_most_half_the_bytes_of_before(tiny_models):
    target, draft = tiny_models
    counts = count_q_bytes(target, draft, T1, PROMPTS, max_new_tokens=12)
    assert counts.rounds > 3 and counts.q_bytes > 0
    assert counts.q_bytes <= counts.before_bytes / 2
    assert counts.q_bytes == counts.q_rows * counts.vocab * torch.finfo(Q_DTYPE).bits // 8


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.0),
                                      SamplingConfig(temperature=1.0, coupling="gumbel")], ids=["T=0", "coupled"])
def test_greedy_and_coupled_rounds_ship_no_q(tiny_models, sampling):
    """Their verification compares the drafts with the target's own tokens: nothing to ship."""
    target, draft = tiny_models
    counts = count_q_bytes(target, draft, sampling, PROMPTS, max_new_tokens=12)
    assert counts.rounds > 3
    assert counts.q_bytes == counts.q_rows == counts.drafted == 0


def test_rows_past_max_new_tokens_are_not_shipped(tiny_models):
    """A round never verifies past max_new_tokens, so the rows the draft made for
    tokens beyond stay with the draft; its tokens are all sent, as its record."""
    target, draft = tiny_models
    counts = count_q_bytes(target, draft, T1, PROMPTS, max_new_tokens=3)  # rounds of room 1, then 0
    assert counts.rounds >= len(PROMPTS) and counts.drafted >= 4 * len(PROMPTS)
    assert counts.q_rows <= len(PROMPTS)


def test_shipped_keeps_the_tokens_and_the_rows_the_target_reads():
    q = torch.rand(4, 8).to(Q_DTYPE)
    proposal = Proposal([1, 2, 3, 4], q, "cache")
    assert protocol.shipped(proposal, None) is proposal and protocol.shipped(proposal, 9) is proposal
    cut = protocol.shipped(proposal, 2)
    assert cut.tokens == proposal.tokens and torch.equal(cut.q, q[:2])
    assert protocol.shipped(proposal, 0).q.shape == (0, 8)
    assert protocol.shipped(Proposal([1], None, "cache"), 0).q is None


def test_a_rounds_row_carries_its_room():
    sent = [protocol.RoundRow(3, 1, 7, 4, 2), protocol.RoundRow(4, 0, 1)]
    assert protocol.parse_rounds(protocol.rounds(sent)) == sent


def test_rows_mostly_zero_are_sent_as_their_nonzero_entries_bit_for_bit():
    q = torch.softmax(torch.randn(5, 64, generator=torch.Generator().manual_seed(0)), -1)
    q[:, 8:] = 0  # top-k 8
    q[2] = 0
    q[2, 3] = 1  # a one-hot row (an n-gram's)
    rows = [protocol.ProposalReply(0, True, Proposal([1, 2, 3], q[:3].to(Q_DTYPE), "cache"), 0.0, 0.0),
            protocol.ProposalReply(1, False, Proposal([4, 5], q[3:].to(Q_DTYPE), "neural"), 0.0, 0.0)]
    message = protocol.proposals(rows)
    assert message.header["q_sparse"] == [5, 64] and len(message.tensors) == 3
    assert sum(t.nbytes for t in message.tensors) < q.to(Q_DTYPE).nbytes / 2
    parsed = protocol.parse_proposals(message)
    assert torch.equal(parsed[0].proposal.q, q[:3].to(Q_DTYPE)) and torch.equal(parsed[1].proposal.q, q[3:].to(Q_DTYPE))


def test_a_sparse_reply_crosses_gloo_bit_for_bit():
    q = torch.softmax(torch.randn(3, 151936), -1)
    q[q < q.topk(20, dim=-1).values[:, -1:]] = 0  # top-k 20
    rows = [protocol.ProposalReply(0, True, Proposal([1, 2, 3], q.to(Q_DTYPE), "cache"), 0.0, 0.0)]
    port = free_port(HOST)
    serve_store(HOST, port)
    received = []
    peer = threading.Thread(target=lambda: received.append(
        DistributedChannel.connect(HOST, port, rank=1, timeout_s=30.0, prefix="sparse")), daemon=True)
    peer.start()
    ours = DistributedChannel.connect(HOST, port, rank=0, timeout_s=30.0, prefix="sparse")
    peer.join(30)
    theirs = received[0]
    try:
        message = protocol.proposals(rows)
        assert "q_sparse" in message.header and sum(t.nbytes for t in message.tensors) < 3 * 20 * 7
        ours.send(message)
        (reply,) = protocol.parse_proposals(theirs.recv(timeout=30))
    finally:
        ours.close()
        theirs.close()
    assert torch.equal(reply.proposal.q, q.to(Q_DTYPE))


def test_dense_rows_are_sent_dense():
    q = torch.softmax(torch.randn(3, 64), -1).to(Q_DTYPE)
    message = protocol.proposals([protocol.ProposalReply(0, True, Proposal([1, 2, 3], q, "cache"), 0.0, 0.0)])
    assert "q_sparse" not in message.header and [t.shape for t in message.tensors] == [q.shape]


def test_top_k_rounds_ship_fewer_bytes_and_the_same_tokens(tiny_models, monkeypatch):
    """Sparse or dense, the target gets the same rows: a seeded run gives the same tokens."""
    target, draft = tiny_models
    top_k = SamplingConfig(temperature=1.0, top_k=3)
    sparse = count_q_bytes(target, draft, top_k, PROMPTS, max_new_tokens=12)
    assert 0 < sparse.q_bytes < sparse.q_rows * sparse.vocab * 2 * 3 / 4  # 3 of 16 entries: 22 B a row, not 32
    monkeypatch.setattr(protocol, "pack_q", lambda q_all, header: [q_all])
    dense = count_q_bytes(target, draft, top_k, PROMPTS, max_new_tokens=12)
    assert dense.q_bytes == dense.q_rows * dense.vocab * 2
    assert dense.outputs == sparse.outputs


# --- exactness over gloo -------------------------------------------------------------------

SAMPLES = 800
N_TOKENS = 7
POSITIONS = [2, 5, 6]
ROWS = 16


@pytest.fixture(scope="module")
def small_pair():
    return small_models()


@contextmanager
def gloo_ssd(draft: torch.nn.Module, target: torch.nn.Module, counts: QBytes) -> Iterator[SSDEngine]:
    """SSD whose speculator serves across a two-rank gloo link (rank 1 on a thread here),
    the q it brings counted in `counts`."""
    port, prefix = free_port(HOST), "q-link"
    serve_store(HOST, port)
    thread = threading.Thread(target=serve_link, args=(draft, port, prefix, 30.0), daemon=True)
    thread.start()
    channel = CountingChannel(DistributedChannel.connect(HOST, port, rank=0, timeout_s=30.0, prefix=prefix), counts)
    spec = speculation(k=3, budget=(3 + 1) * SMALL.vocab_size)  # every outcome cached: later rounds hit
    try:
        with SSDEngine(target, TinyTokenizer(SMALL.vocab_size), spec, BatchingConfig(max_rows=ROWS),
                       channel=channel) as ssd:
            yield ssd
    finally:
        thread.join(30)


def gloo_samples(pair, samples: int) -> list[tuple[int, ...]]:
    target, draft = pair
    generation = GenerationConfig(max_new_tokens=N_TOKENS)
    requests = [GenerationRequest(PROMPT, dataclasses.replace(T1, seed=seed), generation) for seed in range(samples)]
    counts = QBytes(SMALL.vocab_size)
    with gloo_ssd(draft, target, counts) as ssd:
        outs = run_rows(ssd, requests)
    assert counts.q_bytes == counts.q_rows * SMALL.vocab_size * 2 > 0  # bfloat16 rows crossed
    assert sum(out.stats.spec.hits for out in outs) > samples  # cache hits, not only backups
    return [tuple(out.token_ids[i] for i in POSITIONS) for out in outs]


def exact_law(pair) -> dict:
    return exact_marginal(pair[0], PROMPT, N_TOKENS, T1, POSITIONS)


def coarse(q: torch.Tensor) -> torch.Tensor:
    """q in two-bit fixed point: each entry rounded down to a multiple of 1/4 (the row's largest kept)."""
    floored = torch.floor(q.to(torch.float64) * 4) / 4
    return torch.where(q == q.max(dim=-1, keepdim=True).values, q.to(torch.float64), floored)


def draws_coarse_ships_bfloat16(monkeypatch) -> None:
    """Every draft (backup chains and cache builds) drawn from coarse(q), shipped as the bfloat16 q."""
    real_sample, real_sample_ids = drafting_module.sample, builder_module.sample_ids
    monkeypatch.setattr(drafting_module, "sample", lambda q, draws: real_sample(coarse(q), draws))
    monkeypatch.setattr(builder_module, "sample_ids", lambda q, gen: real_sample_ids(coarse(q), gen))


def test_bfloat16_rows_over_gloo_keep_the_target_law(small_pair):
    p = chi_square_pvalue(gloo_samples(small_pair, SAMPLES), exact_law(small_pair))
    report_pvalue("SSD over gloo, bfloat16 q", "T=1", "exact", SAMPLES, p)
    assert p > ALPHA


def test_the_gloo_law_test_sees_rows_drawn_at_another_precision(small_pair, monkeypatch):
    draws_coarse_ships_bfloat16(monkeypatch)
    p = chi_square_pvalue(gloo_samples(small_pair, SAMPLES), exact_law(small_pair))
    report_pvalue("SSD over gloo, bfloat16 q", "T=1", "drawn at 2 bits", SAMPLES, p)
    assert p < ALPHA
