"""A tensor-parallel target in the continuous batch (gloo on loopback, TP = 2, one thread a rank).

Rank 0 leads (ssd.models.tp.TPLeader is the engines' target) and rank 1
mirrors every sequence of it. Checked: for each family the lean forward takes,
rows of AR, SD and SSD batched together give each prompt's greedy tokens of
AR alone on the unsharded model, and the follower holds no sequence once the
engines are gone; sampled rows follow the target's exact law (chi-square per
row), and the same test fails when the follower feeds two rows' tokens into
each other's caches (its power); SSD's start-up plan probes the target
through the group and its K, budget and k_policy are the ones the engine then
runs; the leader's keepalive keeps an idle follower past the collectives'
timeout, which without it ends the follower, and a follower that hangs in a
forward fails the leader's forward within that timeout.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ssd.config import (
    BatchingConfig, Config, GenerationConfig, ModelConfig, RuntimeConfig, SamplingConfig, SpeculationConfig,
)
from ssd.models import TinyTokenizer, backend
from ssd.models.kv import KVSequence
from ssd.models.loading import build_tiny_model
from tests.families import DRAFT_NOISE, FAMILIES, TOKENIZER, build_family
from tests.stats import ALPHA, report_pvalue
from tests.test_distribution import SMALL

WORLD = 2
PROMPTS = [[1, 2, 3], [7, 7, 0, 1, 9, 12, 15], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 24
GREEDY = SamplingConfig(temperature=0.0)
MODES = ("ar", "sd", "ssd")
SHARING = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 13]]
CHI_SAMPLES = 300
CHI_BROKEN_SAMPLES = 120
SHORT_TIMEOUT = timedelta(seconds=3)  # the collectives' limit in the timeout scenarios
IDLE_S = 6.0  # the leader idles past it
HANG_S = 8.0  # a follower hangs in a forward this long


# --- what rank 0 runs ----------------------------------------------------------------------


def batch_results(engine, prompts, n: int = NEW_TOKENS) -> tuple[list, int]:
    """Every prompt a greedy row of one batch, admitted together; (results, the most rows a step held)."""
    from tests.test_batch import ok, request, run_batch

    widest = []
    rows = [request(p, n, GREEDY) for p in prompts]
    finished = run_batch(engine, rows, after_step=lambda _: widest.append(engine.rows))
    return [ok(f) for f in finished], max(widest, default=0)


def batched(engine, prompts) -> tuple[list[list[int]], int]:
    """(greedy tokens per prompt, the most rows a step held), the prompts batched together."""
    results, widest = batch_results(engine, prompts)
    return [r.token_ids for r in results], widest


def engines(target, draft) -> dict:
    """Each mode's engine over the pair (SSD's speculator on a thread of this process), K = 3."""
    from ssd.factory import LoadedPair, make_engine

    pair = LoadedPair(target, draft, TinyTokenizer.from_config(TOKENIZER))
    return {mode: make_engine(mode, pair, SpeculationConfig(k=3), BatchingConfig(max_rows=4, prefill_chunk=4))
            for mode in MODES}


def family_runs(rank: int) -> dict:
    """Per family: (rank 0) each mode's batched greedy tokens and widest step; (rank 1) the
    sequences it still held when stopped."""
    from ssd.models.tp import TPLeader, held_at_stop, load_built_sharded, run_tp_follower

    seen = {}
    for family in FAMILIES:
        model = load_built_sharded(lambda: build_family(family), torch.float64, WORLD)
        if rank != 0:
            run_tp_follower(model)
            seen[family] = {"held": held_at_stop()}
            continue
        with TPLeader(model) as leader:
            made = engines(leader, build_family(family, noise=DRAFT_NOISE))
            seen[family] = {mode: batched(engine, PROMPTS) for mode, engine in made.items()}
            for mode in MODES:
                made[mode].close()
            del made
            gc.collect()  # the engines' sequences and cached prefixes go: the stop releases them
    return seen


def prefix_runs(rank: int) -> dict:
    """Rows that share whole prompt chunks (ssd.engine.kv_manager): the second copies the first's
    once prefilled (a fork, mirrored), then a later prompt takes them from the prefix cache."""
    from ssd.engine import AREngine
    from ssd.models.tp import TPLeader, held_at_stop, load_built_sharded, run_tp_follower

    model = load_built_sharded(lambda: build_family("qwen2"), torch.float64, WORLD)
    if rank != 0:
        run_tp_follower(model)
        return {"held": held_at_stop()}
    with TPLeader(model) as leader:
        engine = AREngine(leader, TinyTokenizer.from_config(TOKENIZER), BatchingConfig(max_rows=4, prefill_chunk=4))
        results = batch_results(engine, SHARING[:2])[0] + batch_results(engine, SHARING[2:])[0]
        kv_bytes = backend.kv_bytes_per_token(leader)
    return {"tokens": [r.token_ids for r in results], "cached": [r.stats.cached_prompt_tokens for r in results],
            "kv_bytes": kv_bytes}


def _swap_two_rows(send):
    """A mirroring bug: the follower feeds the first two rows' tokens into each other's caches
    (where their feeds are of one length, so the ranks' caches keep the same lengths)."""
    from ssd.models import tp

    def broken(op, a=0, b=0, payload=(), group=None, rollbacks=None):
        payload = list(payload)
        if op == tp.OP_FORWARD and a >= 2 and payload[1] == payload[4]:
            payload[0], payload[3] = payload[3], payload[0]
        return send(op, a, b, payload, group, rollbacks)

    return broken


def chi_runs(rank: int) -> dict:
    """Sampled SD rows on the TP leader: draws per row (tests.test_batch.chi_draws), then the same
    with the follower's rows swapped."""
    from ssd.models import tp
    from tests.test_batch import chi_draws

    model = tp.load_tp_model(ModelConfig(name="tiny", dtype="fp64", tiny=SMALL))
    if rank != 0:
        return {"counts": [tp.run_tp_follower(model), tp.run_tp_follower(model)]}
    draft = build_tiny_model(dataclasses.replace(SMALL, noise=0.1), torch.float64)
    with tp.TPLeader(model) as leader:
        exact = chi_draws((leader, draft), CHI_SAMPLES)
    send = tp._send_command
    tp._send_command = _swap_two_rows(send)
    try:
        with tp.TPLeader(model) as leader:
            broken = chi_draws((leader, draft), CHI_BROKEN_SAMPLES)
    finally:
        tp._send_command = send
    return {"exact": exact, "broken": broken}


def plan_config(cache: str) -> Config:
    tiny = TOKENIZER  # the default tiny shapes, 16 tokens
    target = ModelConfig(name="tiny", dtype="fp64", tiny=tiny)
    draft = ModelConfig(name="tiny", dtype="fp64", tiny=dataclasses.replace(tiny, noise=DRAFT_NOISE))
    os.environ["SSD_CACHE_DIR"] = cache
    return Config(target=target, draft=draft, speculation=SpeculationConfig(mode="ssd", k=7),
                  runtime=RuntimeConfig(plan=True))


def plan_runs(rank: int, out_dir: str) -> dict:
    """SSD's start-up plan with the TP leader as the target (ssd.saguaro.startup.plan_for_pair),
    then an SSD engine on the planned settings: what the plan chose, what the engine ran."""
    from ssd.factory import LoadedPair, make_engine
    from ssd.models import tp
    from ssd.models.loading import load_model
    from ssd.saguaro import startup

    config = plan_config(str(Path(out_dir) / "cache"))
    model = tp.load_tp_model(config.target)
    if rank != 0:
        return {"mirrored": [tp.run_tp_follower(model) for _ in range(2)]}  # the probes, then the engine
    draft, tokenizer = load_model(config.draft), TinyTokenizer.from_config(config.target.tiny)
    plans = []
    original = startup.planned
    startup.planned = lambda config, plan: plans.append(plan) or original(config, plan)
    try:
        with tp.TPLeader(model) as leader:
            planned = startup.plan_for_pair(config, LoadedPair(leader, draft, tokenizer))
    finally:
        startup.planned = original
    plan = plans[0]
    with tp.TPLeader(model) as leader:
        pair = LoadedPair(leader, draft, tokenizer)
        with make_engine("ssd", pair, planned.speculation, BatchingConfig(max_rows=4, prefill_chunk=4)) as engine:
            tokens, _ = batched(engine, PROMPTS)
            ran = engine.speculation
    return {"best": (plan.best.k, plan.best.budget, plan.best.glue), "k_policy": plan.k_policy,
            "devices": plan.meta["devices"], "ran": (ran.k, ran.fanout.budget, ran.glue), "ran_policy": ran.k_policy,
            "tokens": tokens}


def timeout_runs(rank: int, scenario: str) -> dict:
    """The keepalive past an idle spell, then (scenario "hang") a follower that hangs in a forward;
    "no keepalive": the same idle spell without it."""
    from ssd.models import tp

    model = tp.load_tp_model(ModelConfig(name="tiny", dtype="fp64", tiny=TOKENIZER))
    if rank != 0:
        if scenario == "hang":
            forward, calls = tp.forward_rows, []

            def hung(*args, **kw):
                calls.append(1)
                if len(calls) == 3:  # the forward after the idle spell's
                    time.sleep(HANG_S)
                return forward(*args, **kw)

            tp.forward_rows = hung
        return {"mirrored": tp.run_tp_follower(model, timeout=SHORT_TIMEOUT)}
    leader = tp.TPLeader(model, timeout=SHORT_TIMEOUT, keepalive=scenario != "no keepalive")
    sequence = leader.sequence()
    seen = {"before": sequence.forward([1, 2, 3])}
    sequence.rollback(2)  # sent with the next command, after the idle spell's keepalives
    time.sleep(IDLE_S)
    try:
        seen["after"] = sequence.forward([4, 5])
    except tp.TPForwardError as exc:
        seen["after_error"] = str(exc)
    if "after" in seen and scenario == "hang":
        started = time.monotonic()
        with pytest.raises(tp.TPForwardError, match="forward failed on target rank 0"):
            sequence.forward([6])
        seen["noticed_s"] = time.monotonic() - started
    if leader.failed is None:
        leader.stop()
    return seen


def _worker(rank: int, port: int, out_dir: str, scenario: str) -> None:
    from ssd.models.tp import init_tp_world, pin_threads

    pin_threads(rank, 1)
    logging.basicConfig(level=logging.INFO)
    init_tp_world(rank, WORLD, "127.0.0.1", port)
    if scenario == "batch":
        seen = {"families": family_runs(rank), "prefix": prefix_runs(rank), "chi": chi_runs(rank),
                "plan": plan_runs(rank, out_dir)}
    else:
        seen = timeout_runs(rank, scenario)
    torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    if scenario != "batch":
        os._exit(0)  # a broken group: no teardown (a follower that lost its leader ended with an error)
    dist.destroy_process_group()


def run(out: Path, scenario: str) -> list[int | None]:
    from tests.test_tp import run_world

    return run_world(out, scenario, _worker)


# --- the checks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_batch(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_batch")
    codes = run(out, "batch")
    assert codes == [0, 0], f"exit codes {codes} (None: killed at the deadline)"
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def ar_alone(model, prompt: list[int]) -> list[int]:
    from ssd.engine import AREngine
    from ssd.engine.request import GenerationRequest

    engine = AREngine(model, TinyTokenizer.from_config(TOKENIZER))
    return engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=NEW_TOKENS))).token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_on_a_tensor_parallel_target_equal_ar_alone(tp_batch, family):
    """Greedy AR, SD and SSD rows, batched on the TP = 2 leader, give AR alone's tokens on the
    unsharded model; the steps ran several rows at once, and the follower released every sequence."""
    seen, follower = tp_batch[0]["families"][family], tp_batch[1]["families"][family]
    model = build_family(family)
    want = [ar_alone(model, p) for p in PROMPTS]
    assert all(len(t) == NEW_TOKENS for t in want)
    for mode in MODES:
        tokens, widest = seen[mode]
        assert tokens == want, mode
        assert widest == len(PROMPTS), mode  # the rows ran together
    assert follower["held"] == 0  # every sequence the engines made was released on the follower too


def test_rows_sharing_prompt_chunks_copy_them_on_every_rank(tp_batch):
    """A row copies another's prefilled chunks, a later prompt takes them from the prefix cache: each
    copy mirrored (an empty copy on the follower would change the logits), the tokens AR alone's."""
    seen = tp_batch[0]["prefix"]
    model = build_family("qwen2")
    assert seen["tokens"] == [ar_alone(model, p) for p in SHARING]
    assert seen["cached"] == [0, 8, 8]  # two whole chunks of 4: copied from the first row, then from the cache


def test_a_tensor_parallel_target_counts_one_rank_s_share_of_the_kv_cache(tp_batch):
    """batching.kv_memory_mb bounds each rank's memory, which holds its share of the KV heads."""
    assert tp_batch[0]["prefix"]["kv_bytes"] * WORLD == backend.kv_bytes_per_token(build_family("qwen2"))


def chi_pvalues(draws) -> list[float]:
    from tests.test_batch import chi_pvalues as pvalues
    from tests.test_distribution import small_models

    return pvalues(small_models(), draws)


def test_sampled_rows_on_a_tensor_parallel_target_follow_the_target_law(tp_batch):
    from tests.test_batch import CHI_ROWS

    pvalues = chi_pvalues(tp_batch[0]["chi"]["exact"])
    for (prompt, sampling), pvalue in zip(CHI_ROWS, pvalues):
        report_pvalue("batched sd, tp=2", f"{prompt} {sampling}", "exact", CHI_SAMPLES, pvalue)
    assert min(pvalues) > ALPHA, f"a row deviates from the target's law: {pvalues}"


def test_the_law_test_catches_a_follower_feeding_rows_into_each_others_caches(tp_batch):
    from tests.test_batch import CHI_ROWS

    pvalues = chi_pvalues(tp_batch[0]["chi"]["broken"])
    for (prompt, sampling), pvalue in zip(CHI_ROWS, pvalues):
        report_pvalue("batched sd, tp=2", f"{prompt} {sampling}", "rows swapped on the follower",
                      CHI_BROKEN_SAMPLES, pvalue)
    assert min(pvalues) < ALPHA, f"swapped rows on the follower went undetected: {pvalues}"


def test_the_start_up_plan_probes_through_the_group_and_its_choice_is_run(tp_batch):
    seen, follower = tp_batch[0]["plan"], tp_batch[1]["plan"]
    assert any("tp2" in device for device in seen["devices"])  # its own key: TP = 2's costs
    assert seen["ran"] == seen["best"] and seen["ran_policy"] == seen["k_policy"]  # not the config's K = 7
    assert follower["mirrored"][0] > 10  # the probes' forwards ran on both ranks (a start alone mirrors 2)
    want = [ar_alone(build_tiny_model(TOKENIZER, torch.float64), p) for p in PROMPTS]
    assert seen["tokens"] == want


def test_the_keepalive_keeps_an_idle_follower_past_the_timeout_and_a_hung_one_is_seen(tmp_path):
    codes = run(tmp_path, "hang")
    leader = torch.load(tmp_path / "rank0.pt") if (tmp_path / "rank0.pt").exists() else None
    assert codes[0] == 0 and leader is not None, f"exit codes {codes}"
    alone = KVSequence(build_tiny_model(TOKENIZER, torch.float64))
    for got, rollback, ids in ((leader["before"], 0, [1, 2, 3]), (leader["after"], 2, [4, 5])):  # mirrored
        alone.rollback(rollback or alone.length)
        want = alone.forward(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * float(want.abs().max()))
    assert leader["noticed_s"] < HANG_S - 1  # its timeout, not the follower waking up (nor 30 days)


def test_without_the_keepalive_an_idle_follower_times_out(tmp_path):
    """The keepalive test's power: the same idle spell ends the follower without it."""
    codes = run(tmp_path, "no keepalive")
    assert codes[1] not in (None, 0), f"exit codes {codes}"
    leader = torch.load(tmp_path / "rank0.pt")
    assert "after" not in leader and "failed" in leader["after_error"]
