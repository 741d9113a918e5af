"""The anytime build and the free n-gram candidates (issue: adaptive SSD).

- AnytimeBudget: a cut shrinks the budget by a quarter, slack worth one more
  branch grows it by one, within [floor, ceiling].
- A build cut after step s holds, for every branch, exactly the first s
  tokens (and q rows) of the uncut build from the same state and stream: a cut
  build is a shorter speculation, not a different one; a cut build's kept
  entries are the next build's start as a full one's are.
- The speculator cuts its build when the next round's outcome is already
  waiting, and not for any other message; the budget follows the round.
- n-gram matches and candidates: latest occurrence first, never the drafted
  token at a rejection, never over the draft's own entries, one-hot q.
Greedy equality and chi-square with these on: tests/test_ssd.py,
tests/test_ssd_distribution.py (paths "anytime" and "n-gram candidates").
"""

from __future__ import annotations

import dataclasses

import queue

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd.config import FanoutConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.models import build_tiny_model
from ssd.models.kv import KVSequence
from ssd.saguaro import protocol
from ssd.saguaro.anytime import AnytimeBudget
from ssd.saguaro.backups import NeuralBackup, ngram_candidates, ngram_match
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import MIN_CUT_STEPS, BuildJob, build_caches
from ssd.transport import inprocess_pair
from ssd.transport.channel import Message

CONTEXT = [1, 2, 3, 4, 5, 6, 7]
K = 4
FANOUT = [2, 2, 1, 1, 3]
SAMPLED = SamplingConfig(temperature=1.0, seed=3)


# --- the budget ---------------------------------------------------------------

def test_a_cut_takes_one_off_and_slack_adds_one():
    budget = AnytimeBudget(ceiling=12)
    assert budget.budget(8) == 8
    budget.observe(8, cut=True, build_s=0.2, wait_s=0.0)
    assert budget.budget(8) == 7
    budget.observe(8, cut=False, build_s=0.2, wait_s=0.05)  # 0.05 > 0.2 / 8: room for one more
    assert budget.budget(8) == 8
    budget.observe(8, cut=False, build_s=0.2, wait_s=0.01)  # less than one branch's share: stays
    assert budget.budget(8) == 8
    for _ in range(10):
        budget.observe(8, cut=True, build_s=0.2, wait_s=0.0)
    assert budget.budget(8) == 4  # never below half the planned budget


def test_the_budget_stays_within_floor_and_ceiling():
    budget = AnytimeBudget(ceiling=5, floor=2)
    for _ in range(10):
        budget.observe(4, cut=False, build_s=0.1, wait_s=1.0)
    assert budget.budget(4) == 5
    for _ in range(10):
        budget.observe(4, cut=True, build_s=0.1, wait_s=0.0)
    assert budget.budget(4) == 2
    assert budget.budget(1) == 2  # another row's planned budget moves by the same offset, within bounds
    with pytest.raises(ValueError):
        AnytimeBudget(ceiling=0)


def test_max_budget_is_the_ceiling_and_anytime_off_keeps_the_budget():
    assert FanoutConfig(budget=3).ceiling == 7
    assert FanoutConfig(budget=10).ceiling == 20
    assert FanoutConfig(budget=3, max_budget=4).ceiling == 4
    assert FanoutConfig(budget=3, anytime=False).ceiling == 3
    from ssd.config import ConfigError
    with pytest.raises(ConfigError, match="max_budget"):
        FanoutConfig(budget=3, max_budget=2)


# --- a cut build ----------------------------------------------------------------

@pytest.fixture(scope="module")
def draft():
    return build_tiny_model(TinyModelConfig(vocab_size=16, seed=1), torch.float64)


def _built(draft, stop_after: int | None):
    """One build after a backup chain, from the same state and stream; cut before step `stop_after`."""
    kv = KVSequence(draft)
    kv.forward(CONTEXT[:-1])
    proposal = NeuralBackup().propose(kv, CONTEXT, K, SAMPLED, torch.Generator().manual_seed(1), None)
    asked = []

    def stop() -> bool:
        asked.append(True)
        return stop_after is not None and len(asked) >= stop_after

    job = BuildJob(kv, TreeBranchDecoder(), CONTEXT, proposal.tokens, FANOUT, SAMPLED,
                   torch.Generator().manual_seed(2), work=proposal.work, depth=K, glue="full", stop=stop)
    (entries,) = build_caches([job])
    return entries, len(asked)


@pytest.mark.parametrize("cut_at", [1, 2])
def test_a_cut_build_is_the_full_build_cut_short(draft, cut_at):
    full, asked = _built(draft, None)
    assert asked == K - MIN_CUT_STEPS  # asked before every step from MIN_CUT_STEPS on
    cut, _ = _built(draft, cut_at)
    depth = MIN_CUT_STEPS + cut_at - 1
    assert cut.keys() == full.keys()
    for key, entry in cut.items():
        assert entry.tokens == full[key].tokens[:depth]
        torch.testing.assert_close(entry.q, full[key].q[:depth])
        assert len(entry.work.logits) == depth == len(entry.work.indices)


# --- the speculator -----------------------------------------------------------

def _speculator(draft, anytime: bool = True, budget: int = 6):
    from ssd.saguaro.speculator import Speculator

    target_end, draft_end = inprocess_pair()
    spec = SpeculationConfig(mode="ssd", k=K, fanout=FanoutConfig(budget=budget, anytime=anytime),
                             ngram_candidates=False)
    speculator = Speculator(draft, draft_end)
    speculator._prefill(protocol.prefill(0, CONTEXT, SAMPLED, spec))
    return speculator, target_end


def _deepest(speculator) -> int:
    cache = speculator.sequences[0].cache
    return max(len(cache.lookup(*key).tokens) for key in cache.outcomes())


def test_the_speculator_cuts_its_build_when_the_outcome_waits(draft, monkeypatch):
    speculator, target_end = _speculator(draft)
    import ssd.saguaro.builder as builder

    steps = []
    real = builder._Grower._draw

    def draw_and_send_the_outcome(self, logits, step, *args):
        steps.append(step)
        if step == 1:  # the target's next round arrives while the build is on its second step
            speculator.channel._inbox.put(Message(protocol.ROUNDS, {"rows": []}))
        return real(self, logits, step, *args)

    monkeypatch.setattr(builder._Grower, "_draw", draw_and_send_the_outcome)
    speculator._rounds(protocol.rounds([protocol.RoundRow(0, 0, 9)]))
    assert steps == [0, 1]  # cut before step 2
    assert _deepest(speculator) == 2
    assert speculator._last_build[1] is True
    speculator._outcome_arrived(protocol.ROUNDS)
    assert speculator.anytime.budget(6) == 5  # one off
    target_end.recv(timeout=1)  # the round's reply went out first


def test_other_messages_never_cut_a_build(draft):
    speculator, _ = _speculator(draft)
    speculator.channel._inbox.put(Message(protocol.PREFILL, {}))
    speculator.channel._inbox.put(Message(protocol.RELEASE, {"seq": 5}))
    speculator._rounds(protocol.rounds([protocol.RoundRow(0, 0, 9)]))
    assert _deepest(speculator) == K
    assert speculator._last_build[1] is False
    speculator._outcome_arrived(protocol.PREFILL)  # the wait is meaningless then: no change
    assert speculator._last_build is None and speculator.anytime.extra == 0


def test_without_anytime_the_build_runs_to_its_budget(draft):
    speculator, _ = _speculator(draft, anytime=False)
    speculator.channel._inbox.put(Message(protocol.ROUNDS, {"rows": []}))
    speculator._rounds(protocol.rounds([protocol.RoundRow(0, 0, 9)]))
    assert len(speculator.sequences[0].cache) == 6 and _deepest(speculator) == K
    assert speculator.anytime is None


def test_pending_lists_waiting_ops_without_taking_them():
    a, b = inprocess_pair()
    assert b.pending() == []
    a.send(Message(protocol.PREFILL))
    a.send(Message(protocol.ROUNDS))
    assert b.pending() == [protocol.PREFILL, protocol.ROUNDS]
    assert b.recv().op == protocol.PREFILL and b.pending() == [protocol.ROUNDS]
    assert isinstance(b._inbox, queue.Queue)


# --- n-gram candidates ---------------------------------------------------------

def test_ngram_match_takes_the_latest_longest_occurrence():
    assert ngram_match([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], 2, max_n=3) == [8, 2]
    assert ngram_match([1, 2, 3, 9, 2, 3], 3, max_n=3) == [9, 2, 3]
    assert ngram_match([1, 2, 3, 4], 2, max_n=3) == []
    assert ngram_match([1, 2, 9, 2], 2, max_n=3, min_n=2) == []  # a 1-token match is not enough
    assert ngram_match([4, 4, 4], 5, max_n=3) == [4]  # what is there, never padded


def _ngram_match_by_slices(context, k, max_n, min_n=1, window=4096):
    """The plain definition: compare the suffix with the slice at every start, latest first."""
    ctx = list(context[-window:])
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] == ctx[-n:]:
                return ctx[start + n : start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 2**20), max_size=60), st.lists(st.integers(0, 2**20), max_size=6),
       st.integers(1, 5), st.integers(1, 4), st.integers(1, 3), st.integers(4, 70))
def test_ngram_search_equals_the_plain_definition(tokens, drafted, k, max_n, min_n, window):
    """The byte search (TokenText) against comparing slices: ids over several byte values (a
    match may straddle two words), few distinct ones (many matches), windows that cut."""
    tokens = [t % 5 if t % 3 else t * 257 for t in tokens]
    assert ngram_match(tokens, k, max_n, min_n, window) == _ngram_match_by_slices(tokens, k, max_n, min_n, window)
    entries = ngram_candidates(tokens, drafted, k, 2**21, needs_q=False, taken=lambda k, t: False,
                               max_n=max_n, min_n=min_n, window=window)
    for j in range(len(drafted) + 1):
        follow = _ngram_match_by_slices([*tokens, *drafted[:j]], k + 1, max_n, min_n, window)
        expected = len(follow) >= 2 and not (j < len(drafted) and follow[0] == drafted[j])
        assert ((j, follow[0]) in entries if expected else not any(key[0] == j for key in entries))
        if expected:
            assert entries[(j, follow[0])].tokens == follow[1:]


def test_ngram_search_skips_a_match_that_straddles_two_words():
    """[256, 0] is the bytes 00 01 00 00 | 00 00 00 00, which hold 01 00 00 00 (the token 1) from
    byte 1 on: a match across two words, which is no token. The search passes it for the
    aligned match before it, or finds none."""
    assert ngram_match([1, 7, 256, 0, 1], 1, max_n=1) == [7]
    assert ngram_match([256, 0, 1], 2, max_n=1) == []


def test_ngram_candidates_fill_what_the_draft_left_and_never_the_drafted_token():
    context = [7, 1, 2, 3, 4, 5, 1, 2]
    drafted = [3, 9]  # k=0: after [.., 1, 2] the text says 3, which is drafted[0]: no entry
    built = {(1, 4)}  # k=1: after [.., 1, 2, 3] the text says 4, which the draft built
    entries = ngram_candidates(context, drafted, 2, 16, needs_q=True, taken=lambda k, t: (k, t) in built)
    assert entries == {}  # and k=2: [.., 2, 3, 9] never occurred
    context = [7, 1, 2, 3, 4, 5, 6, 2, 3]
    entries = ngram_candidates(context, [8], 2, 16, needs_q=True, taken=lambda k, t: False)
    assert list(entries) == [(0, 4)] and entries[(0, 4)].tokens == [5, 6]
    q = entries[(0, 4)].q
    assert q.shape == (2, 16) and q[0, 5] == 1 and q[1, 6] == 1 and q.sum() == 2
    assert ngram_candidates(context, [8], 2, 16, needs_q=False, taken=lambda k, t: False)[(0, 4)].q is None


def test_the_bench_variants_turn_off_what_they_name():
    from ssd.tools.bench.runner import ssd_variant

    base = SpeculationConfig(mode="ssd")
    assert base.fanout.anytime and base.ngram_candidates
    static = ssd_variant(base, "static")
    assert not static.fanout.anytime and not static.ngram_candidates
    assert ssd_variant(base, "no-anytime").ngram_candidates and not ssd_variant(base, "no-anytime").fanout.anytime
    assert ssd_variant(base, "no-ngram").fanout.anytime and not ssd_variant(base, "no-ngram").ngram_candidates
    with pytest.raises(ValueError, match="unknown SSD variant"):
        ssd_variant(base, "fast")
    planned = dataclasses.replace(base, k_policy={1: 0}, adaptive_k=True)  # a plan that turned speculation off
    speculating = ssd_variant(planned, "speculating")
    assert speculating.k_policy == {} and speculating.fanout.anytime and speculating.ngram_candidates
    assert all(ssd_variant(planned, v).k_policy == {} for v in ("static", "no-anytime", "no-ngram"))


def test_a_fixed_grid_point_runs_its_k_and_budget_with_nothing_adaptive():
    from ssd.tools.bench.cli import build_parser
    from ssd.tools.bench.runner import fixed_ssd

    planned = SpeculationConfig(mode="ssd", k=1, k_policy={1: 0}, adaptive_k=True)
    point = fixed_ssd(planned, 3, 4)
    assert (point.k, point.fanout.budget, point.k_policy, point.adaptive_k) == (3, 4, {}, False)
    assert not point.fanout.anytime and not point.ngram_candidates
    assert build_parser().parse_args(["--ssd-grid", "1:1", "3:4"]).ssd_grid == [(1, 1), (3, 4)]
    from ssd.tools.bench.runner import BenchPlan

    bench = BenchPlan(modes=["ar", "sd", "ssd"], ks=[2], temperatures=[0], prompt_sets={}, sd_ks=[1, 4])
    assert bench.mode_runs == [("ar", 0), ("sd", 1), ("sd", 4), ("ssd", 2)]
    for bad in ("3", "0:2", "a:b"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--ssd-grid", bad])


def test_the_plan_check_s_grid_points_speculate_whatever_the_plan_s_k_policy(tiny_models, tiny_tokenizer):
    """launch/bench_plan.py's grid: each point is fixed_ssd's (that K and budget, nothing
    adaptive), speculating even where the plan turned speculation off at one row."""
    from types import SimpleNamespace

    from ssd.config import Config
    from ssd.factory import LoadedPair
    from ssd.tools.bench.plan_check import rows_for

    planned = SpeculationConfig(mode="ssd", k=1, k_policy={1: 0})
    cluster = SimpleNamespace(config=Config(speculation=planned))
    rows = rows_for(LoadedPair(*tiny_models, tiny_tokenizer), cluster, Config(), [(2, 3)], threads=(1,))
    plan_row, grid_row = rows[-2:]
    assert plan_row.label == "ssd plan" and plan_row.speculation is None  # the cluster's own defaults
    spec = grid_row.speculation
    assert grid_row.label == "ssd K=2 B=3" and (spec.k, spec.fanout.budget, spec.k_policy) == (2, 3, {})
    assert not spec.fanout.anytime and not spec.ngram_candidates
