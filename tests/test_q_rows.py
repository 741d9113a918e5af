"""What crosses the draft link as q: bfloat16 rows, the very rows each token was drawn from.

Verification's exactness with rounded rows is tested in
tests/test_verify.py::test_shipped_rows_are_verified_as_the_law_they_were_drawn_from
and end to end by the chi-square tests of tests/test_ssd_distribution.py.
"""

from __future__ import annotations

import torch

from ssd.config import SamplingConfig
from ssd.engine.drafting import drafted_chain
from ssd.models.kv import KVSequence
from ssd.saguaro import protocol
from ssd.saguaro.backups import make_backup
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import build_cache
from ssd.saguaro.cache import Proposal
from ssd.sampling import Q_DTYPE, make_generator

SAMPLED = SamplingConfig(temperature=0.8, top_k=10)
CONTEXT = [1, 2, 3, 4, 5]


def test_every_q_source_makes_bfloat16_rows(tiny_models):
    draft = tiny_models[1]  # fp64: the rows are rounded even where the model is not
    vocab = draft.config.vocab_size
    chain = drafted_chain(KVSequence(draft), CONTEXT, 3, SAMPLED, make_generator(0))
    tokens, rows = chain.tokens, chain.q_rows
    assert {row.dtype for row in rows} == {Q_DTYPE}
    entries = build_cache(KVSequence(draft), TreeBranchDecoder(), CONTEXT, tokens, [2, 1, 1, 1], SAMPLED,
                          make_generator(1))
    assert entries and {e.q.dtype for e in entries.values()} == {Q_DTYPE}
    for kind in ("neural", "ngram", "random"):
        proposal = make_backup(kind, vocab).propose(KVSequence(draft), CONTEXT, 3, SAMPLED, make_generator(2), None)
        assert proposal.q.dtype == Q_DTYPE, kind


def test_a_proposals_message_ships_bfloat16():
    rows = [protocol.ProposalReply(s, False, Proposal([1, 2], torch.full((2, 8), 0.125, dtype=Q_DTYPE), "random"),
                                   0.0, 0.0) for s in range(2)]
    message = protocol.proposals(rows)
    assert [t.dtype for t in message.tensors] == [torch.bfloat16]
    assert all(r.proposal.q.dtype == torch.bfloat16 for r in protocol.parse_proposals(message))
