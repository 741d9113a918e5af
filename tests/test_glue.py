"""A cache build that starts from the draft's own work (glue "reuse" and "fold")
prepares what a build from a fresh cache and a full glue pass prepares.

fp64 tiny draft: only summation order may differ, so greedy tokens and cached
outcomes are equal and logits agree to 1e-10. Every outcome of a build is
followed (a rejection at every k, the bonus), and so are the paths on which
the kept entries could go stale: a miss after a build, a proposal whose work
no longer matches the cache, and a cache on transformers' carrier.
"""

from __future__ import annotations

import pytest
import torch

from ssd.config import SamplingConfig, TinyModelConfig
from ssd.models import build_tiny_model
from ssd.models.kv import KVSequence
from ssd.saguaro.backups import NeuralBackup
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import build_cache
from ssd.saguaro.cache import DraftWork

CONTEXT = [1, 2, 3, 4, 5, 6, 7]
K = 3
FANOUT = [2, 2, 2, 3]  # F_0..F_K
GREEDY = SamplingConfig(temperature=0.0)
TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def draft():
    return build_tiny_model(TinyModelConfig(vocab_size=16, seed=1), torch.float64)


def first_round(draft, fast: bool | None = None):
    """The state after round 1: a backup chain's proposal, then its cache built (entries kept)."""
    kv = KVSequence(draft, fast)
    kv.forward(CONTEXT[:-1])
    proposal = NeuralBackup().propose(kv, CONTEXT, K, GREEDY, torch.Generator(), None)
    entries = build(kv, CONTEXT, proposal.tokens, proposal.work, "fold")
    return kv, proposal, entries


def build(kv, committed, drafted, work, glue):
    return build_cache(kv, TreeBranchDecoder(), committed, drafted, FANOUT, GREEDY, torch.Generator(),
                       work=work, depth=K, glue=glue)


def fresh(draft, committed, drafted):
    """The reference: a new cache holding committed[:-1], a full glue pass."""
    kv = KVSequence(draft)
    kv.forward(committed[:-1])
    return kv, build(kv, committed, drafted, None, "full")


def assert_same_cache(kv, ref_kv) -> None:
    assert kv.tokens == ref_kv.tokens
    for (k, v), (k0, v0) in zip(kv.prefix_kv(kv.length), ref_kv.prefix_kv(ref_kv.length)):
        torch.testing.assert_close(k, k0, **TOL)
        torch.testing.assert_close(v, v0, **TOL)


def assert_same_entries(got, want, drafted, folded: bool) -> None:
    """Same outcomes; same tokens, except that a folded bonus branch drafts one fewer."""
    assert list(got) == list(want)
    for (k, t), entry in got.items():
        expected = want[(k, t)].tokens
        if folded and k == len(drafted):
            expected = expected[:-1]
        assert entry.tokens == expected, (k, t)


def test_the_first_build_keeps_every_branch_work(draft):
    kv, proposal, entries = first_round(draft)
    assert sorted(k for k, _ in entries) == [0, 0, 1, 1, 2, 2, 3, 3, 3]  # FANOUT, the bonus folded in
    for (k, _), entry in entries.items():
        depth = K - 1 if k == K else K
        assert len(entry.tokens) == depth and len(entry.work.logits) == depth == len(entry.work.indices)
    assert kv.tokens == CONTEXT + proposal.tokens and kv.cached > kv.length  # branch entries kept


@pytest.mark.parametrize("glue", ["fold", "reuse"])
@pytest.mark.parametrize("outcome", range(9))  # every entry of the first build: rejection at each k, the bonus
def test_a_hit_resumes_from_its_branch_and_builds_what_a_full_glue_builds(draft, glue, outcome):
    kv, proposal, entries = first_round(draft)
    (k, t), entry = list(entries.items())[outcome]
    committed = CONTEXT + proposal.tokens[:k] + [t]
    got = build(kv, committed, entry.tokens, entry.work, glue)
    ref_kv, want = fresh(draft, committed, entry.tokens)
    assert_same_cache(kv, ref_kv)
    assert_same_entries(got, want, entry.tokens, folded=glue == "fold")
    for key, e in got.items():  # the logits kept for the round after agree with a fresh pass over that branch
        history = committed + entry.tokens[: key[0]] + [key[1]]
        for i, row in enumerate(e.work.logits):
            with torch.inference_mode():
                fresh_row = draft(input_ids=torch.tensor([history + e.tokens[:i]])).logits[0, -1]
            torch.testing.assert_close(row, fresh_row, **TOL)


def test_a_miss_after_a_build_drops_the_kept_branches(draft):
    kv, proposal, entries = first_round(draft)
    missed = next(t for t in range(16) if (1, t) not in entries and t != proposal.tokens[1])
    committed = CONTEXT + proposal.tokens[:1] + [missed]  # rejected at k = 1 with a t* nobody guessed
    backup = NeuralBackup().propose(kv, committed, K, GREEDY, torch.Generator(), None)
    got = build(kv, committed, backup.tokens, backup.work, "fold")
    ref_kv, want = fresh(draft, committed, backup.tokens)
    assert_same_cache(kv, ref_kv)
    assert_same_entries(got, want, backup.tokens, folded=True)


def test_work_that_does_not_match_the_cache_is_not_used(draft):
    """A branch's work offered for another sequence state (stale) falls back to a full glue pass."""
    kv, proposal, entries = first_round(draft)
    (k, t), entry = next(iter(entries.items()))
    committed = CONTEXT[:-1] + [9] + proposal.tokens[:k] + [t]  # the history differs before the branch
    got = build(kv, committed, entry.tokens, entry.work, "fold")
    ref_kv, want = fresh(draft, committed, entry.tokens)
    assert_same_cache(kv, ref_kv)
    assert_same_entries(got, want, entry.tokens, folded=False)  # no fold: the work was refused


def test_transformers_carrier_builds_without_keeping(draft):
    kv, proposal, entries = first_round(draft, fast=False)
    assert kv.cached == kv.length and all(e.work is None for e in entries.values())
    (k, t), entry = next(iter(entries.items()))
    committed = CONTEXT + proposal.tokens[:k] + [t]
    got = build(kv, committed, entry.tokens, entry.work, "fold")
    assert_same_entries(got, fresh(draft, committed, entry.tokens)[1], entry.tokens, folded=False)


def test_keep_branch_refuses_entries_that_are_not_uncommitted(draft):
    kv = KVSequence(draft)
    kv.forward(CONTEXT)
    with pytest.raises(ValueError, match="uncommitted"):
        kv.keep_branch(3, [2], [9])
    with pytest.raises(ValueError, match="indices"):
        kv.keep_branch(3, [7, 8], [9])
    with pytest.raises(NotImplementedError):
        KVSequence(draft, fast=False).keep_branch(0, [], [])
    assert DraftWork([]).indices is None


def test_a_backup_chain_s_work_for_another_history_is_not_used(draft):
    kv = KVSequence(draft)
    kv.forward(CONTEXT[:-1])
    backup = NeuralBackup().propose(kv, CONTEXT, K, GREEDY, torch.Generator(), None)
    committed = CONTEXT[:-1] + [(CONTEXT[-1] + 5) % 16]  # t* differs from what the chain followed
    got = build(kv, committed, backup.tokens, backup.work, "fold")
    ref_kv, want = fresh(draft, committed, backup.tokens)
    assert_same_cache(kv, ref_kv)
    assert_same_entries(got, want, backup.tokens, folded=False)


def _after_backup(draft, context):
    kv = KVSequence(draft)
    kv.forward(context[:-1])
    return kv, NeuralBackup().propose(kv, context, K, GREEDY, torch.Generator(), None)


@pytest.mark.parametrize("glue", ["fold", "reuse", "full"])
def test_rows_build_in_lockstep_as_each_would_alone_in_one_forward_a_step(draft, glue, monkeypatch):
    from ssd.models.fast import FastForward
    from ssd.saguaro.builder import BuildJob, build_caches

    contexts = [CONTEXT, [9, 8, 7, 6], [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]]
    alone = []
    for context in contexts:
        kv, proposal = _after_backup(draft, context)
        alone.append(build(kv, context, proposal.tokens, proposal.work, glue))
    jobs = []
    for context in contexts:
        kv, proposal = _after_backup(draft, context)
        jobs.append(BuildJob(kv, TreeBranchDecoder(), context, proposal.tokens, FANOUT, GREEDY, torch.Generator(),
                             work=proposal.work, depth=K, glue=glue))
    forwards = []
    real = FastForward.packed
    monkeypatch.setattr(FastForward, "packed", lambda self, segments, *a, **kw: (forwards.append(len(segments)), real(self, segments, *a, **kw))[1])
    together = build_caches(jobs)
    for got, want in zip(together, alone):
        assert {key: e.tokens for key, e in got.items()} == {key: e.tokens for key, e in want.items()}
    assert forwards == [3] * (K if glue == "fold" else K + 1)  # every step: one forward holding all three rows


def test_a_row_whose_own_draw_fails_fails_alone(draft):
    from ssd.saguaro.builder import BuildJob, build_caches

    jobs = []
    for context in (CONTEXT, [9, 8, 7, 6]):
        kv, proposal = _after_backup(draft, context)
        jobs.append(BuildJob(kv, TreeBranchDecoder(), context, proposal.tokens, FANOUT, GREEDY, torch.Generator(),
                             work=proposal.work, depth=K))
    jobs[1].sampling = None  # its first draw raises
    ok, failed = build_caches(jobs)
    assert isinstance(failed, AttributeError) and isinstance(ok, dict) and len(ok) == sum(FANOUT)
    assert jobs[1].kv.cached == jobs[1].kv.length  # the failed row's branch entries were dropped
