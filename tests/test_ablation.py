"""Ablation tooling: trace files, replay against live SSD (exact under greedy,
within sampling noise at T > 0), the power-law fit, the planner, plots, the CLI."""

from __future__ import annotations

import dataclasses
import contextlib
import math
import random

import pytest
import torch
from safetensors.torch import save_file

import ssd.saguaro.costs as costs_module
from ssd.saguaro.costs import (
    Costs,
    CostSettings,
    load_costs,
    measure_costs,
    save_costs,
)
from ssd.tools.ablation.planner import candidates, recommend
from ssd.tools.ablation.plots import write_all
from ssd.tools.ablation.replay import (
    ReplayData,
    fit_power_law,
    miss_vs_fanout,
    replay,
    ssd_spec,
)
from ssd.tools.ablation.trace import (
    POSITION_FIELDS,
    RecordSettings,
    Trace,
    TraceMeta,
    TraceSequence,
    load_trace,
    positions_from_logits,
    record_trace,
    save_trace,
    teacher_forced_logits,
)
from ssd.config import FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.saguaro.fanout import uniform_fanout
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from tests.conftest import ROOT
from tests.spies import WorkClock

PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15], [4, 4, 2]]
GREEDY_TOKENS = 48
# Refreshing every 3 observations makes the geometric planner re-plan many
# times per sequence: the replay must feed it the live observations in order.
# The replay models builds of a fixed budget with the draft's entries only (as the CLI's base spec)
BASE = SpeculationConfig(mode="ssd", fanout=FanoutConfig(refresh_every=3, anytime=False), ngram_candidates=False)


def _record(models, tokenizer, temperature=0.0, n=GREEDY_TOKENS, samples=1, top_n=128, seed=0):
    settings = RecordSettings(SamplingConfig(temperature=temperature, seed=seed),
                              GenerationConfig(max_new_tokens=n), top_n=top_n, samples_per_prompt=samples)
    return record_trace(*models, tokenizer, PROMPTS, settings, {"target": {"name": "tiny"}, "draft": {"name": "tiny"}})


@pytest.fixture(scope="module")
def greedy_trace(tiny_models, tiny_tokenizer):
    return _record(tiny_models, tiny_tokenizer)


@pytest.fixture(scope="module")
def sampled_trace(tiny_models, tiny_tokenizer):
    """T = 1: 8 trajectories per prompt, so the replay's own noise is small next to the live run's."""
    return _record(tiny_models, tiny_tokenizer, temperature=1.0, n=60, samples=8, seed=100)


# ------------------------------------------------------------------ trace files


def test_trace_round_trip(greedy_trace, tmp_path):
    path = save_trace(greedy_trace, tmp_path / "t.safetensors")
    back = load_trace(path)
    assert back.meta == greedy_trace.meta and back.prompts == greedy_trace.prompts
    assert back.meta.top_n == 16 and back.meta.vocab_size == 16  # N >= V: the whole row is kept
    for a, b in zip(greedy_trace.sequences, back.sequences):
        assert (a.prompt_index, a.seed, a.tokens, a.finish_reason) == (b.prompt_index, b.seed, b.tokens, b.finish_reason)
        for name in POSITION_FIELDS:
            assert torch.equal(getattr(a.positions, name), getattr(b.positions, name)), name


def test_load_refuses_other_files(tmp_path):
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not an ssd ablation trace"):
        load_trace(other)
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "missing.safetensors")


def test_chunked_scoring_matches_one_forward(tiny_models):
    target, _ = tiny_models
    prompt, tokens = [1, 2, 3], [4, 5, 6, 7, 8, 9, 10]
    whole = teacher_forced_logits(target, prompt, tokens)
    assert whole.shape == (len(tokens), 16)
    for chunk in (1, 3):
        assert torch.allclose(teacher_forced_logits(target, prompt, tokens, chunk), whole, atol=1e-10)


def test_greedy_acceptance_follows_argmax_on_tied_logits():
    """Tied maxima: the drafted token is torch.argmax's (the lowest id), whatever order topk keeps."""
    logits = torch.zeros(2, 8, dtype=torch.float64)
    logits[:, 3] = logits[:, 5] = 4.0
    positions = positions_from_logits(logits, logits, [3, 5], 8, 0.0)
    seq = TraceSequence(0, 0, [3, 5], "length", positions)
    view = ReplayData(Trace(TraceMeta({}, {}, 0.0, 0, 8, 8, [], 2), [[0]], [seq])).sequences[0]
    assert view.top1 == [True, False]


def test_record_refuses_top_k_sampling(tiny_models, tiny_tokenizer):
    settings = RecordSettings(SamplingConfig(temperature=1.0, top_k=4), GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="temperature only"):
        record_trace(*tiny_models, tiny_tokenizer, PROMPTS, settings)


# ------------------------------------------------------- greedy replay is exact


def _live(models, tokenizer, spec, max_new, sampling=SamplingConfig(), seeds=(0,)):
    target, draft = models
    with SSDEngine.in_process(target, draft, tokenizer, spec) as ssd:
        return [
            ssd.generate(GenerationRequest(p, SamplingConfig(temperature=sampling.temperature, seed=s),
                         GenerationConfig(max_new_tokens=max_new))).stats
            for p in PROMPTS for s in seeds
        ]


def _summed(stats, name):
    out = {}
    for s in stats:
        for k, v in getattr(s.spec, name).items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


@pytest.mark.parametrize("kind, k, budget, max_new", [
    ("geometric", 4, 8, GREEDY_TOKENS),
    ("uniform", 3, 6, GREEDY_TOKENS),
    ("geometric", 5, 12, 29),  # max_new_tokens below the recorded 48: the engine's truncation of K
])
def test_greedy_replay_equals_live_ssd(tiny_models, tiny_tokenizer, greedy_trace, kind, k, budget, max_new):
    spec = ssd_spec(kind, k, budget, base=BASE)
    predicted = replay(ReplayData(greedy_trace), spec, max_new_tokens=max_new)
    live = _live(tiny_models, tiny_tokenizer, spec, max_new)
    s = predicted.spec
    assert 0 < s.hit_rate < 1  # both outcomes occur: the comparison has teeth
    assert s.lookups == sum(x.spec.lookups for x in live) and s.hits == sum(x.spec.hits for x in live)
    assert dict(sorted(s.lookups_by_k.items())) == _summed(live, "lookups_by_k")
    assert dict(sorted(s.hits_by_k.items())) == _summed(live, "hits_by_k")
    assert predicted.rounds == sum(x.rounds for x in live)
    assert predicted.new_tokens == sum(x.new_tokens - 1 for x in live)
    assert (predicted.drafted, predicted.accepted) == (sum(x.drafted for x in live), sum(x.accepted for x in live))
    assert s.tokens_after_hit == sum(x.spec.tokens_after_hit for x in live)
    assert predicted.unresolved == 0


def test_greedy_replay_distinguishes_schedules(greedy_trace):
    """The exact comparison above would notice a replay that ignored the schedule."""
    data = ReplayData(greedy_trace)
    hits = {kind: replay(data, ssd_spec(kind, 4, 8, base=BASE)).spec.hits_by_k for kind in ("uniform", "geometric")}
    assert hits["uniform"] != hits["geometric"]


def test_cut_rows_are_exact_when_the_fanout_fits(tiny_models, tiny_tokenizer, greedy_trace):
    """top_n = 8 < V: a fan-out below N still replays exactly; one beyond it is flagged unresolved."""
    cut = ReplayData(_record(tiny_models, tiny_tokenizer, top_n=8))
    full = ReplayData(greedy_trace)
    small = ssd_spec("uniform", 3, 4 * 5, base=BASE)  # F = 5 < 8 everywhere
    assert replay(cut, small).as_dict() == replay(full, small).as_dict()
    big = ssd_spec("uniform", 3, 4 * 12, base=BASE)
    assert replay(cut, big).unresolved > 0 and replay(full, big).unresolved == 0


# ------------------------------------------------- sampled replay within noise


def test_sampled_replay_agrees_with_live_ssd(tiny_models, tiny_tokenizer, sampled_trace):
    """Monte Carlo replay at T = 1 against 16 live generations (4 seeds per prompt, not the trace's).

    Tolerance: both rates are binomial proportions; the standard error of the
    difference is sqrt(p(1-p) D (1/n_live + 1/n_replay)) with n_replay counted
    per trajectory (the Monte Carlo passes share trajectories) and a design
    effect D = 1.5 for correlation within a sequence (shared context and
    planner). |z| < 4 fails a correct replay with probability ~1e-4 (seeds are
    fixed, so the outcome is deterministic). Saguaro C = 0.1 moves the hit
    rate from ~0.4 to ~0.75 here, so a replay with the wrong C lands at
    |z| > 6 and must fail the same check.
    """
    samples = 4
    data = ReplayData(sampled_trace)
    live = _live(tiny_models, tiny_tokenizer, ssd_spec("geometric", 3, 4, 0.1), 60,
                 SamplingConfig(temperature=1.0), seeds=(500, 510, 520, 530))
    n_live, hits = sum(s.spec.lookups for s in live), sum(s.spec.hits for s in live)
    drafted, accepted = sum(s.drafted for s in live), sum(s.accepted for s in live)

    def z(c: float) -> tuple[float, float]:
        rep = replay(data, ssd_spec("geometric", 3, 4, c), samples=samples, seed=1)
        return (_z(hits / n_live, n_live, rep.hit_rate, rep.spec.lookups / samples),
                _z(accepted / drafted, drafted, rep.acceptance_rate, rep.drafted / samples))

    assert n_live > 300
    z_hit, z_acc = z(0.1)
    assert abs(z_hit) < 4 and abs(z_acc) < 4, (z_hit, z_acc)
    for wrong_c in (0.5, 1.0):
        z_hit, z_acc = z(wrong_c)
        assert abs(z_hit) > 4 and abs(z_acc) > 4, (wrong_c, z_hit, z_acc)


def _z(p_live: float, n_live: float, p_rep: float, n_rep: float, design_effect: float = 1.5) -> float:
    p = (p_live * n_live + p_rep * n_rep) / (n_live + n_rep)
    return (p_live - p_rep) / math.sqrt(p * (1 - p) * design_effect * (1 / n_live + 1 / n_rep))


def test_sampled_replay_is_seeded(sampled_trace):
    data = ReplayData(sampled_trace)
    spec = ssd_spec("geometric", 3, 4, 0.5)
    a, b = (replay(data, spec, samples=2, seed=3).as_dict() for _ in range(2))
    assert a == b and replay(data, spec, samples=2, seed=4).as_dict() != a


# ----------------------------------------------------------------- power law


def test_power_law_fit_recovers_r():
    fs = list(range(1, 17))
    exact = fit_power_law(fs, [0.8 * f**-1.3 for f in fs])
    assert exact.r == pytest.approx(1.3, abs=1e-9) and exact.c == pytest.approx(0.8, abs=1e-9)
    rng = random.Random(0)
    n = 20000
    noisy = [sum(rng.random() < 0.6 * f**-0.7 for _ in range(n)) / n for f in fs]
    fit = fit_power_law(fs, noisy)
    assert fit.r == pytest.approx(0.7, abs=0.05) and fit.c == pytest.approx(0.6, rel=0.1)
    with pytest.raises(ValueError, match="at least two distinct F"):
        fit_power_law([1, 2], [0.5, 0.0])


def test_miss_rate_falls_with_fanout(greedy_trace):
    points = miss_vs_fanout(ReplayData(greedy_trace), k=4, max_fanout=8)
    misses = [p.miss_rate for p in points]
    assert [p.fanout for p in points] == list(range(1, 9))
    assert all(a >= b for a, b in zip(misses, misses[1:])) and misses[0] > misses[-1]


# ------------------------------------------------------------------- planner


def _perfect_draft_trace(vocab=8, n=120, sequences=3) -> Trace:
    """Draft == target, and the target's argmax is the trajectory token: every draft is accepted."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(sequences):
        tokens = torch.randint(vocab, (n,), generator=gen).tolist()
        logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64)
        logits[torch.arange(n), tokens] = 10.0
        seqs.append(TraceSequence(i, i, tokens, "length", positions_from_logits(logits, logits, tokens, vocab, 0.0)))
    meta = TraceMeta({}, {}, 0.0, 0, vocab, vocab, [], n)
    return Trace(meta, [[0]] * sequences, seqs)


def test_planner_picks_the_obviously_best_config():
    """Verification costs 1 s whatever K; a miss adds a 0.5 s/token backup; a build
    costs 0.05 s per branch, so B = 40 no longer fits inside a verification.
    With a perfect draft the best is the longest K with the smallest budget
    that always holds the bonus token: uniform K = 8, B = 9 (F = 1 everywhere).
    Glue "reuse": with "fold" a bonus branch drafts K - 1 tokens (a perfect draft hits one every round)."""
    ks, budgets = (2, 8), (9, 40)
    costs = Costs(
        ar_step_s=1.0, verify_s={k: 1.0 for k in ks}, backup_s={k: 0.5 * k for k in ks},
        build_s={(k, b): 0.05 * b for k in ks for b in budgets},
    )
    data = ReplayData(_perfect_draft_trace())
    plan = recommend(data, costs, candidates(True, ks, budgets), dataclasses.replace(BASE, glue="reuse"))
    best = plan.ranked[0]
    assert (best.candidate.kind, best.candidate.k, best.candidate.budget) == ("uniform", 8, 9)
    assert best.replay.acceptance_rate == 1.0 and best.replay.hit_rate == 1.0
    assert best.speed.tokens_per_s == pytest.approx(9.0, rel=0.1)
    assert plan.sd.k == 8 and best.speedup_vs_sd == pytest.approx(5.0, rel=0.1)  # SD: 9 tokens / (1 + 4) s
    assert all(c.c == 1.0 for c in candidates(True))  # C cannot matter under greedy


def test_costs_interpolate_and_round_trip(tmp_path):
    costs = Costs(
        ar_step_s=0.1, verify_s={2: 0.2, 4: 0.3}, backup_s={2: 0.1, 4: 0.2},
        build_s={(k, b): 0.01 + 0.02 * k + 0.003 * b + 0.001 * k * b for k in (2, 4) for b in (4, 8)},
    )
    assert costs.verify(3) == pytest.approx(0.25) and costs.verify(8) == pytest.approx(0.5)
    assert costs.build(6, 16) == pytest.approx(0.01 + 0.12 + 0.048 + 0.096)  # the bilinear law, extrapolated
    assert costs.build(2, 4) == costs.build_s[(2, 4)]
    back = load_costs(save_costs(costs, tmp_path / "c.json"))
    assert back.to_json() == costs.to_json()
    with pytest.raises(ValueError, match="two measured K"):
        Costs(0.1, {2: 0.2}, {2: 0.1}, {(2, 4): 0.1}).verify(3)


def test_measure_costs_times_the_forwards_each_cost_names(tiny_models, monkeypatch):
    """On a clock that counts tokens (target 1, draft 100 each), every cost is
    exactly the forwards it stands for: an AR step one target token, verify(K)
    K + 1, backup(K) K draft steps, build(K, B) the glue pass (t* and the K
    drafted tokens) plus K one-token steps for each cached outcome."""
    target, draft = tiny_models
    settings = CostSettings(ks=(1, 2), budgets=(2, 4), prefix=16, repeats=1)
    with WorkClock({target: 1, draft: 100}) as clock:
        clock.install(monkeypatch, costs_module)
        costs = measure_costs(target, draft, settings)
    vocab = target.config.vocab_size
    outcomes = {(k, b): sum(uniform_fanout(k, b, caps=[vocab - 1] * k + [vocab])) for k in (1, 2) for b in (2, 4)}
    assert costs.ar_step_s == 1 and costs.verify_s == {1: 2, 2: 3} and costs.backup_s == {1: 100, 2: 200}
    assert costs.build_s == {(k, b): 100 * (k + 1 + k * n) for (k, b), n in outcomes.items()}


def test_each_role_is_timed_beside_the_other_one_busy(tiny_models):
    settings = CostSettings(ks=(1, 2), budgets=(2,), prefix=8, repeats=1)
    active, ticks = [], {"draft busy": 0, "target busy": 0, "alone": 0}

    @contextlib.contextmanager
    def busy(role):
        active.append(role)
        yield
        active.pop()

    def tick():
        ticks[active[-1] if active else "alone"] += 1

    costs = measure_costs(*tiny_models, settings, progress=tick,
                          beside_draft=lambda: busy("draft busy"), beside_target=lambda: busy("target busy"))
    # AR + verify(K) for the target; backup(K) + build(K, B) for the draft.
    assert ticks == {"draft busy": 3, "target busy": 4, "alone": 0}
    assert costs.meta["under_load"] and costs.meta["machine"]["cpu_model"]


# --------------------------------------------------------------------- plots


def test_plots_are_written(sampled_trace, tmp_path):
    data = ReplayData(sampled_trace)
    paths = write_all(data, ssd_spec("geometric", 3, 4), tmp_path, budgets=(2, 4), cs=(0.25, 1.0), max_fanout=4)
    assert [p.name for p in paths] == ["c_tradeoff.png", "miss_vs_fanout.png", "fanout_kinds.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


# ----------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli():
    """launch/ablate.py's commands (the script only calls this module's main)."""
    from ssd.tools.ablation import cli

    return cli


TINY_CONFIG = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--log-level", "WARNING"]


@pytest.mark.parametrize("argv, message", [
    (["record", "--prompts", "0", "--out", "x"], "argument --prompts: must be >= 1, got 0"),
    (["sweep", "--trace", "t", "--cs", "1.5"], "argument --cs: must be in [0, 1], got 1.5"),
    (["plan", "--trace", "t"], "the following arguments are required: --costs"),
    (["costs", "--ks", "two", "--out", "c"], "argument --ks: must be an integer, got 'two'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_cli_argument_errors(cli, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_missing_trace_names_the_flag(cli, tmp_path):
    with pytest.raises(SystemExit, match=r"error: --trace: trace file not found: .*missing"):
        cli.main(["fit", *TINY_CONFIG, "--trace", str(tmp_path / "missing.safetensors")])


def test_cli_end_to_end(cli, tmp_path, capsys):
    trace, costs = tmp_path / "t.safetensors", tmp_path / "c.json"
    cli.main(["record", *TINY_CONFIG, "--prompt-file", str(ROOT / "configs" / "prompts" / "tiny.yaml"),
              "--prompts", "2", "--max-new-tokens", "24", "--out", str(trace)])
    cli.main(["costs", *TINY_CONFIG, "--quick", "--ks", "1", "2", "--prefix", "16", "--out", str(costs)])
    cli.main(["sweep", *TINY_CONFIG, "--trace", str(trace), "--costs", str(costs), "--ks", "1", "2",
              "--budgets", "2", "4", "--csv", str(tmp_path / "s.csv"), "--json", str(tmp_path / "s.json")])
    cli.main(["fit", *TINY_CONFIG, "--trace", str(trace), "-k", "2", "--max-fanout", "4"])
    cli.main(["plan", *TINY_CONFIG, "--trace", str(trace), "--costs", str(costs), "--ks", "1", "2",
              "--budgets", "2", "4", "--top", "3"])
    cli.main(["compare", *TINY_CONFIG, "--trace", str(trace), "-k", "2", "--budget", "4", "--mode", "ssd"])
    out = capsys.readouterr().out
    for text in ("wrote", "## fan-out kind x budget", "## draft length K", "power law: miss =", "SD at its best K"):
        assert text in out, text
    predicted, measured = [line.split() for line in out.splitlines() if line.startswith(("predicted", "measured"))]
    assert predicted[1:] == measured[1:]  # greedy: the replay's prediction is the live run
    assert (tmp_path / "s.csv").stat().st_size > 0 and load_costs(costs).build_s
