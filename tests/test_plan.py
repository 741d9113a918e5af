"""SSD's start-up plan: the speed model's choices (pure), the probes on a tiny
pair, the per-host cache, and the plan reaching a local server's engines."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
import types

import pytest
import torch

from ssd.saguaro.costs import Costs
from ssd.config import Config, ConfigError, RuntimeConfig, SpeculationConfig, TinyModelConfig
from ssd.models import build_tiny_model
from ssd.saguaro import startup
from ssd.saguaro.plan import DEFAULT_ROWS, Agreement, RowCosts, choose, hit_rate, predict, tokens_per_round

GOOD_DRAFT = Agreement(0.8, ranks_rejected=[0] * 6 + [1] * 2 + [5] * 2, ranks_bonus=[0] * 8 + [1] * 2)


def costs(build_per_step: float, verify: float = 0.15, glue_step: float = 0.0) -> Costs:
    """A host where a build is K steps (plus one more for `glue_step`) growing slowly with the budget."""
    builds = {(k, b): (k + glue_step) * build_per_step * (1 + 0.02 * b) for k in (1, 2, 4, 6) for b in (2, 8, 16)}
    return Costs(0.12, {k: verify + 0.01 * k for k in range(1, 7)}, {k: 0.06 * k for k in range(1, 7)}, builds)


def test_agreement_reads_hits_off_the_measured_ranks():
    assert GOOD_DRAFT.hit(1, bonus=False) == 0.6 and GOOD_DRAFT.hit(2, bonus=False) == 0.8
    assert GOOD_DRAFT.hit(6, bonus=False) == 1.0 and GOOD_DRAFT.hit(0, bonus=True) == 0.0
    assert hit_rate(GOOD_DRAFT, [1, 1]) == pytest.approx(0.2 * 0.6 + 0.8 * 0.8)
    assert tokens_per_round(0.5, 2) == 1.75
    with pytest.raises(ValueError, match="acceptance"):
        Agreement(1.0, [], [])


def test_a_build_that_outlasts_verification_moves_the_plan_to_a_cheaper_setting():
    cheap = choose({"reuse": costs(0.02)}, GOOD_DRAFT)
    dear = choose({"reuse": costs(0.06)}, GOOD_DRAFT)
    assert cheap.beats_sd and cheap.best.build_s <= cheap.best.verify_s * 1.05
    assert (dear.best.k, dear.best.budget) != (cheap.best.k, cheap.best.budget)
    assert dear.best.build_s < costs(0.06).build(cheap.best.k, cheap.best.budget)


def test_no_ssd_setting_beats_sd_when_every_build_is_dear():
    plan = choose({"reuse": costs(0.5)}, GOOD_DRAFT)
    assert not plan.beats_sd and "SD at its best K" in plan.summary()


def test_fold_wins_when_its_saved_forward_matters_and_loses_to_a_near_perfect_draft():
    """fold saves one draft forward a build; its bonus branches draft K - 1 tokens."""
    by_glue = {"fold": costs(0.04), "reuse": costs(0.04, glue_step=1.0)}  # at K=4: fold fits in the verification
    fold, reuse = (predict(by_glue[g], GOOD_DRAFT, 4, 8, g) for g in ("fold", "reuse"))
    assert fold.build_s < fold.verify_s < reuse.build_s and fold.tokens_per_s > reuse.tokens_per_s
    perfect = Agreement(0.98, [0] * 10, [0] * 10)
    free = {"fold": costs(0.001), "reuse": costs(0.001, glue_step=1.0)}  # builds cost nothing either way
    fold, reuse = (predict(free[g], perfect, 4, 8, g) for g in ("fold", "reuse"))
    assert fold.tokens_per_round < reuse.tokens_per_round and reuse.tokens_per_s > fold.tokens_per_s


def rows_costs(verify_per_token: float, chain_step: float = 0.06) -> RowCosts:
    """A target whose batched verification costs a fixed part plus `verify_per_token` for
    each token of each row (compute grows with rows x tokens), and draft chains that grow slowly."""
    verify = {(b, n): 0.1 + verify_per_token * b * n for b in (1, 2, 4, 8) for n in (1, 3, 5)}
    chain = {(b, k): chain_step * k * (1 + 0.1 * b) for b in (1, 2, 4, 8) for k in (1, 3)}
    return RowCosts(verify, chain)


def test_row_costs_interpolate_between_and_past_the_measured_points():
    rc = rows_costs(0.01)
    assert rc.verify_s(2, 3) == pytest.approx(0.16)
    assert rc.verify_s(3, 3) == pytest.approx(0.19) and rc.verify_s(16, 3) == pytest.approx(0.58)
    assert rc.verify_s(2, 7) == pytest.approx(0.24) and rc.chain_s(8, 2) == pytest.approx(0.216)
    assert RowCosts.from_json(rc.to_json()) == rc


def test_speculation_stops_where_batched_verification_turns_compute_bound():
    """Where K + 1 tokens a row cost nearly K + 1 steps and a miss stalls the batch for a
    backup chain, AR wins at the larger batches: the plan turns speculation off there."""
    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01))
    assert [c.rows for c in plan.rows] == [1, 2, 4, 8]
    assert plan.rows[0].speculates and not plan.rows[-1].speculates
    off = plan.k_policy
    assert list(off.values()) == [0] and all(c.speculates == (c.rows < min(off)) for c in plan.rows)
    assert "2 rows: SSD" in plan.rows_summary()
    cheap = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.0, chain_step=0.005))
    assert cheap.k_policy == {} and all(c.speculates for c in cheap.rows)  # memory bound, cheap misses
    assert choose({"reuse": costs(0.02)}, GOOD_DRAFT).k_policy == {}  # not measured: nothing by batch size


def test_speculation_is_off_at_one_row_where_the_draft_s_core_is_worth_more_to_the_target():
    """A lone cluster target borrows the draft's core while speculation is off: where AR on
    both cores beats SSD on one core each at one row, the plan turns speculation off from
    one row on; otherwise the rows' own rule stands, and one row keeps SSD."""
    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01))
    one_row = plan.rows[0].ssd_tokens_per_s
    rows_rule = plan.k_policy
    assert rows_rule and 1 not in rows_rule
    plan.ar_wide_tokens_per_s = 1.01 * one_row
    assert plan.lends_draft_core and plan.k_policy == {1: 0}
    assert "on the draft's core too" in plan.summary()
    plan.ar_wide_tokens_per_s = 0.99 * one_row
    assert not plan.lends_draft_core and plan.k_policy == rows_rule
    plan.ar_wide_tokens_per_s = None  # no core lent (in process, TP, a draft on another node)
    assert plan.k_policy == rows_rule


def test_always_speculate_keeps_ssd_on_where_the_plan_would_turn_it_off():
    import argparse

    from ssd.app.cli import add_config_args, config_from_args

    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01))
    plan.ar_wide_tokens_per_s = 2 * plan.rows[0].ssd_tokens_per_s
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    for flags, policy in (([], {1: 0}), (["--always-speculate"], {})):
        config = config_from_args(parser.parse_args(["--mode", "ssd", *flags]))
        applied = startup.apply_plan(config.speculation, plan, config.runtime.plan_keeps)
        assert applied.k_policy == policy, flags


def test_the_result_line_names_ar_and_the_plan_s_reason_where_the_plan_turned_speculation_off():
    """launch/cluster.py's one-shot line: where the plan lent the draft's core to AR and no round
    drafted, it leads with what ran and why; otherwise it is the stats' own line."""
    from ssd.app.launcher import result_line
    from ssd.cluster.devices import plan_placement
    from ssd.engine.metrics import GenerationStats

    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01))
    plan.ar_wide_tokens_per_s = 2 * plan.rows[0].ssd_tokens_per_s
    parked = GenerationStats(mode="ssd", k=2, new_tokens=6, total_s=1.0)
    for _ in range(5):
        parked.record_round(drafted=0, accepted=0)
    cores = plan_placement("0", "1", 2, "cpu")
    line = result_line(parked, plan, cores)
    assert line.startswith("AR on both cores: the start-up plan turned speculation off because AR on the target's "
                           f"cores and the draft's is predicted faster than SSD on one core each "
                           f"({plan.ar_wide_tokens_per_s:.2f} vs {plan.rows[0].ssd_tokens_per_s:.2f} tok/s at one row)")
    assert line.endswith(parked.summary()) and "acceptance" not in line and "hit rate" not in line
    assert result_line(parked, plan, plan_placement("0", "1-2", 3, "cpu")).startswith("AR on 3 cores: ")
    spoke = GenerationStats(mode="ssd", k=2)
    spoke.record_round(drafted=2, accepted=1)  # a request with a K of its own speculates anyway
    assert result_line(spoke, plan, cores) == spoke.summary()
    plan.ar_wide_tokens_per_s = None  # no core lent: the plan names no reason, the stats speak
    assert plan.off_reason() is None and result_line(parked, plan, cores) == parked.summary()


def test_rows_share_a_branch_cap_where_the_lockstep_build_outgrows_verification():
    """Every row's branches go into one forward a step: with dear branches, a batch shares
    a cap that leaves one row its planned budget and each of many rows fewer."""
    plan = choose({"reuse": costs(0.03)}, GOOD_DRAFT, rows_costs=rows_costs(0.003, chain_step=0.01))
    assert plan.batch_budget is not None and plan.batch_budget >= plan.best.budget
    assert plan.rows[0].budget == plan.best.budget
    budgets = [c.budget for c in plan.rows]
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] < budgets[0]
    roomy = choose({"reuse": costs(0.001)}, GOOD_DRAFT, rows_costs=rows_costs(0.003, chain_step=0.01))
    assert roomy.batch_budget is None  # builds nearly free: every row keeps its budget


def test_the_link_s_round_trip_is_added_to_every_round():
    plain = predict(costs(0.02), GOOD_DRAFT, 2, 4, "reuse")
    linked = predict(costs(0.02), GOOD_DRAFT, 2, 4, "reuse", link_s=0.05)
    round_s = plain.tokens_per_round / plain.tokens_per_s
    assert linked.tokens_per_s == pytest.approx(plain.tokens_per_round / (round_s + 0.05))
    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01), link_s=0.05)
    assert plan.best.link_s == 0.05 and "link round trip 50.00 ms" in plan.summary()
    slow = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01), link_s=0.5)
    assert slow.rows[1].ssd_tokens_per_s < plan.rows[1].ssd_tokens_per_s  # batched rounds pay it too
    assert slow.best.tokens_per_s < plan.best.tokens_per_s


def test_apply_plan_sets_the_batch_rules_unless_the_config_sets_its_own():
    plan = choose({"reuse": costs(0.02)}, GOOD_DRAFT, rows_costs=rows_costs(0.01))
    base = SpeculationConfig(mode="ssd", k=7)
    applied = startup.apply_plan(base, plan)
    assert applied.k_policy == plan.k_policy and applied.fanout.batch_budget == plan.batch_budget
    own = dataclasses.replace(base, k_policy={3: 0})
    assert startup.apply_plan(own, plan).k_policy == {3: 0}
    assert startup.apply_plan(base, plan, fixed=["k_policy", "batch_budget"]).k_policy == {}


def test_apply_plan_keeps_what_the_user_set():
    plan = choose({"fold": costs(0.02)}, GOOD_DRAFT)
    base = SpeculationConfig(mode="ssd", k=7, glue="full")
    applied = startup.apply_plan(base, plan)
    assert (applied.k, applied.fanout.budget, applied.glue) == (plan.best.k, plan.best.budget, plan.best.glue)
    assert applied.fanout.initial_a == GOOD_DRAFT.a
    kept = startup.apply_plan(base, plan, fixed=["k", "glue"])
    assert (kept.k, kept.glue, kept.fanout.budget) == (7, "full", plan.best.budget)
    with pytest.raises(ConfigError, match="plan_keeps"):
        RuntimeConfig(plan_keeps=["K"])


# --------------------------------------------------------------------- probes


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 16 for c in text][:12]


@pytest.fixture(scope="module")
def pair():
    return tuple(build_tiny_model(TinyModelConfig(vocab_size=16, seed=s), torch.float32) for s in (0, 1))


# Known probe costs, in 1/1024 s (sums and medians of them are exact in floating point):
# each is a function of what its probe runs, all distinct, so a cost read off the wrong probe shows.
UNIT = 2.0**-10


def forward_s(tokens: int) -> float:  # the target: one forward of `tokens` after the context
    return (100 + 10 * tokens) * UNIT


def backup_s(k: int) -> float:  # the draft: a backup chain of K tokens
    return 30 * k * UNIT


def build_s(glue: str, k: int, budget: int) -> float:  # the draft: a cache build; fold saves a forward
    return (k + (glue == "reuse")) * (80 + 2 * budget) * UNIT  # at K 1, fold's hides behind verification


def rows_verify_s(rows: int, tokens: int) -> float:  # one row's: forward_s (read off the single-row probes)
    return (100 + 10 * tokens + 4 * (rows - 1) * tokens) * UNIT


def rows_chain_s(rows: int, k: int) -> float:  # one row's: backup_s
    return (30 + 3 * (rows - 1)) * k * UNIT


def known_probe_costs(monkeypatch) -> None:
    """Each probe still runs, on the real models; a stand-in clock in round_robin
    advances by the probe's known cost, given what the probe was made to run (a clock
    per thread: the draft's probes run on one beside the target's)."""
    clocks: dict[int, float] = {}

    def timed(make, seconds):
        def probe(*args, **kwargs):
            run, reset = make(*args, **kwargs)
            cost = seconds(*args, **kwargs)

            def timed_run():
                run()
                clocks[threading.get_ident()] = clocks.get(threading.get_ident(), 0.0) + cost
            return timed_run, reset
        return probe

    clock = sys.modules[startup.round_robin.__module__]
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(
        perf_counter=lambda: clocks.get(threading.get_ident(), 0.0)))
    for name, seconds in {
        "forward_probe": lambda kv, prefix, n, gen: forward_s(n),
        "backup_probe": lambda kv, prefix, k, settings: backup_s(k),
        "build_probe": lambda kv, decoder, prefix, k, b, vocab, settings, gen: build_s(settings.glue, k, b),
        "verify_rows_probe": lambda rows, contexts, n, vocab, gen: rows_verify_s(len(rows), n),
        "chain_rows_probe": lambda rows, contexts, k, seed: rows_chain_s(len(rows), k),
    }.items():
        monkeypatch.setattr(startup, name, timed(getattr(startup, name), seconds))


def test_probes_measure_every_cost_and_the_plan_is_cached(pair, tmp_path, monkeypatch):
    """Every cost the plan reads is the time of its own probe (verification of K + 1 tokens,
    one decode step, each backup chain, each glue's build at each (K, budget), each batch
    size's verification and chain), and the plan is the speed model's over those costs."""
    target, draft = pair
    known_probe_costs(monkeypatch)
    plan = startup.plan_in_process(target, draft, CharTokenizer(), "k1", {"m": 1}, directory=tmp_path)
    data = json.loads((tmp_path / "k1.json").read_text())
    target_part, draft_part = data["target"], data["draft"]
    ks, backups, rows = startup.VERIFY_KS, startup.BACKUP_KS, (1, *startup.PROBE_ROWS)
    builds = [(k, b) for k in startup.BUILD_KS for b in startup.BUILD_BUDGETS]
    assert {int(k): s for k, s in target_part["verify_s"].items()} == {k: forward_s(k + 1) for k in ks}
    assert target_part["ar_step_s"] == forward_s(1)
    assert target_part["rows_verify_s"] == [[b, n, rows_verify_s(b, n)] for b in rows for n in startup.ROWS_TOKENS]
    assert {int(k): s for k, s in draft_part["backup_s"].items()} == {k: backup_s(k) for k in backups}
    assert {glue: sorted(map(tuple, points)) for glue, points in draft_part["build_s"].items()} == {
        glue: [(k, b, build_s(glue, k, b)) for k, b in builds] for glue in ("fold", "reuse")}
    assert draft_part["rows_chain_s"] == [[b, k, rows_chain_s(b, k)] for b in rows for k in startup.ROWS_CHAIN]
    assert plan.agreement.positions == len(startup.SAMPLE_PROMPTS) * startup.CONTINUATION
    # The plan: the speed model over the known costs and the measured agreement ...
    want = choose(
        {glue: Costs(forward_s(1), {k: forward_s(k + 1) for k in ks}, {k: backup_s(k) for k in backups},
                     {(k, b): build_s(glue, k, b) for k, b in builds}) for glue in ("fold", "reuse")},
        Agreement.from_json(draft_part["agreement"]),
        rows_costs=RowCosts({(b, n): rows_verify_s(b, n) for b in rows for n in startup.ROWS_TOKENS},
                            {(b, k): rows_chain_s(b, k) for b in rows for k in startup.ROWS_CHAIN}))
    def settings(ranked):  # the fits' least squares may differ in the last bits with the points' order
        return [(p.k, p.budget, p.glue, pytest.approx(p.tokens_per_s, rel=1e-9)) for p in ranked]
    assert settings(plan.ranked) == settings(want.ranked) and plan.best == plan.ranked[0]
    assert (plan.sd_k, plan.rows, plan.batch_budget) == (want.sd_k, want.rows, want.batch_budget)
    assert plan.agreement == want.agreement and plan.k_policy == want.k_policy
    # ... whose numbers are the costs' own, where they are read straight off them; fold is
    # chosen because its builds fit in the verification and reuse's do not
    # (or fitted: the known costs are linear in K, tokens and rows, so the fits are exact)
    best = plan.best
    assert best.glue == "fold" and (best.verify_s, best.backup_s) == pytest.approx((forward_s(best.k + 1), backup_s(best.k)))
    assert plan.ar_tokens_per_s == 1 / forward_s(1)
    assert [c.ar_tokens_per_s for c in plan.rows] == pytest.approx([b / rows_verify_s(b, 1) for b in DEFAULT_ROWS])
    # A later start reads the file: nothing is timed again.
    monkeypatch.setattr(startup, "target_probe", lambda *a, **k: pytest.fail("measured again"))
    again = startup.plan_in_process(target, draft, CharTokenizer(), "k1", {"m": 1}, directory=tmp_path)
    assert again.best == plan.best
    # A file that lacks a part is measured again.
    del data["draft"]["rows_chain_s"]
    (tmp_path / "k1.json").write_text(json.dumps(data))
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        startup.plan_in_process(target, draft, CharTokenizer(), "k1", {"m": 1}, directory=tmp_path)


def test_a_first_plan_logs_every_stage_and_a_heartbeat_between(pair, tmp_path, monkeypatch, caplog):
    """The first start logs a line as each stage of the probes ends (the target's continuations
    and timed passes, the draft's passes and agreement, the total) and a heartbeat while any
    runs long: on a busy host a stage takes minutes, and the start must not look hung. The
    timing line quotes the measured first-run figure; the heartbeat ends with the probes."""
    from ssd import hardware

    target, draft = pair
    monkeypatch.setattr(hardware, "HEARTBEAT_S", 0.05)
    slow = startup.target_probe
    monkeypatch.setattr(startup, "target_probe", lambda model: (time.sleep(0.5), slow(model))[1])
    with caplog.at_level(logging.INFO):
        startup.plan_in_process(target, draft, CharTokenizer(), "k1", {"m": 1}, directory=tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    stages = ["SSD plan: timing verification", "sample prompts continued", "SSD plan, target probes: pass",
              "SSD plan, draft probes: pass", "ranked among the draft's", "SSD plan: probes done in"]
    for stage in stages:
        assert any(stage in line for line in lines), stage
    assert startup.FIRST_PLAN in next(line for line in lines if stages[0] in line)
    beats = [line for line in lines if line.startswith("SSD plan: probes running: ")]
    assert len(beats) >= 2  # half a second of the target's probe at a beat every 0.05 s
    assert not any(t.name == "ssd-heartbeat" for t in threading.enumerate())


def test_each_role_is_timed_while_the_other_computes(pair, monkeypatch):
    """plan_in_process runs the draft's probe on a thread beside the target's; the role done
    first keeps computing (keep_busy) until the other's timing is over."""
    target, draft = pair
    started = {role: threading.Event() for role in ("target", "draft")}
    polls = {"target": 0, "draft": 0}
    threads = set()  # intra-op threads each role computes with, on its own thread
    real_busy = startup.keep_busy

    def keep_busy(model, done):
        role = "target" if model is target else "draft"

        def polled():
            polls[role] += 1
            threads.add(torch.get_num_threads())
            return done()
        return real_busy(model, polled)

    def probe(role, part):
        def run(*args, **kwargs):
            started[role].set()
            assert started["draft" if role == "target" else "target"].wait(5), "the probes ran one after the other"
            if role == "target":  # times on while the draft, done first, keeps computing
                deadline = time.monotonic() + 5
                while polls["draft"] < 3 and time.monotonic() < deadline:
                    time.sleep(0.001)
            return dict(part)
        return run

    target_part = {"verify_s": {}, "ar_step_s": 1.0, "rows_verify_s": []}
    monkeypatch.setattr(startup, "keep_busy", keep_busy)
    monkeypatch.setattr(startup, "target_probe", probe("target", target_part))
    monkeypatch.setattr(startup, "draft_probe", probe("draft", {"backup_s": {}}))
    got_target, got_draft = startup.probe_pair(target, draft, [[1, 2]])
    assert polls["draft"] >= 3 and threads == {1}  # the draft's forwards ran while the target timed
    assert got_target == target_part | {"sequences": startup._continue_rows(target, [[1, 2]], startup.CONTINUATION)}
    assert got_draft["agreement"]["positions"] == startup.CONTINUATION  # scored on the target's continuation


def test_keep_busy_computes_until_done(pair):
    calls = iter(range(100))
    assert startup.keep_busy(pair[0], lambda: next(calls) >= 4) == 3
    assert startup.keep_busy(pair[0], lambda: True) == 0


def test_agreement_of_a_draft_with_itself_is_perfect(pair):
    target, _ = pair
    sequences = startup._continue_rows(target, [[1, 2, 3], [4, 5]], 10)
    agreement = startup.agreement(target, sequences, [3, 2])
    assert agreement.a == 0.99 and set(agreement.ranks_bonus) == {0} and not agreement.ranks_rejected
    other = startup.agreement(pair[1], sequences, [3, 2])
    assert other.a < 0.9 and other.ranks_rejected  # a different draft disagrees somewhere


def test_the_plan_reaches_a_local_server_s_engines(pair, tiny_tokenizer, tmp_path, monkeypatch):
    from ssd.factory import LoadedPair
    from ssd.serve.backend import LocalBackend

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    target, draft = pair
    config = Config(speculation=SpeculationConfig(mode="ssd", k=7), runtime=RuntimeConfig(plan=True, plan_keeps=["glue"]))
    backend = LocalBackend(config, pair=LoadedPair(target, draft, tiny_tokenizer))
    try:
        key, meta = startup.config_key(config, _devices(target, draft))
        plan = startup.plan_in_process(target, draft, tiny_tokenizer, key, meta)  # from the cache the backend wrote
        assert backend.config.speculation.k == plan.best.k and backend.config.speculation.glue == "fold"
        assert list((tmp_path / "plans").glob("*.json"))
    finally:
        backend.close()
    off_config = dataclasses.replace(config, runtime=RuntimeConfig(plan=False))
    off = LocalBackend(off_config, pair=LoadedPair(target, draft, tiny_tokenizer))
    assert off.config.speculation.k == 7
    off.close()


def _devices(target, draft):
    return [str(target.device), str(draft.device), "in-process"]


def test_round_robin_logs_a_progress_line_per_pass_and_times_after_the_warm_up(caplog):
    runs = []
    probes = {"a": (lambda: runs.append("a"), lambda: None), "b": (lambda: runs.append("b"), lambda: None)}
    with caplog.at_level(logging.INFO, logger="ssd.saguaro.costs"):
        timed = startup.round_robin(probes, 1, lambda: None, "SSD plan, test probes")
        cold = startup.round_robin(probes, 1, lambda: None, "SSD plan, cold probes", warm_up=False)
    assert set(timed) == set(cold) == {"a", "b"} and runs == ["a", "b"] * 3
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" over")[0] for line in lines] == [
        "SSD plan, test probes: pass 1 of 2", "SSD plan, test probes: pass 2 of 2", "SSD plan, cold probes: pass 1 of 1"]


def test_a_llamacpp_plan_is_timed_again_when_what_auto_may_pick_changes(monkeypatch):
    # a cached plan keeps the step costs of the KV cache it was timed with: a new probe
    # candidate (which can change what "auto" picks) or llama.cpp build must miss it
    llamacpp = pytest.importorskip("ssd.models.llamacpp")
    from ssd.config import ModelConfig

    def key(config):
        return startup.config_key(config, ["cpu:0", "cpu:1", "in-process"])[0]

    on_llamacpp = Config(target=ModelConfig(backend="llamacpp"), draft=ModelConfig(backend="llamacpp"))
    on_torch = Config(target=ModelConfig(backend="torch"), draft=ModelConfig(backend="torch"))
    before = key(on_llamacpp), key(on_torch)
    monkeypatch.setattr(llamacpp, "INVARIANCE_CANDIDATES", llamacpp.INVARIANCE_CANDIDATES[1:])
    assert key(on_llamacpp) != before[0] and key(on_torch) == before[1]
    monkeypatch.undo()
    monkeypatch.setattr(llamacpp.L, "__version__", "0.0.0")
    assert key(on_llamacpp) != before[0]
    kv = Config(target=ModelConfig(backend="llamacpp", llamacpp_kv="bf16"), draft=ModelConfig(backend="llamacpp"))
    assert key(kv) != key(on_llamacpp)
