"""launch/gpu_bench.py on a CPU at tiny shapes: the whole flow, the forced acceptance, the modelled
rows, the deadline, and the pieces it is built from (direct draws, the layer view)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.request import GenerationRequest
from ssd.engine.sd import SDEngine
from ssd.engine.metrics import total
from ssd.models.kv import KVSequence
from ssd.models.shapes import RandomModelSpec, build_random_model, fingerprint, shape_config, weight_bytes
from ssd.saguaro.fanout import geometric_fanout
from ssd.saguaro.plan import hit_rate
from ssd.saguaro.speed import ssd_rows_speed, ssd_speed_from
from ssd.tools.bench import regime
from ssd.tools.bench.forced import ForcedAcceptance, honoured
from ssd.tools.bench.gpu_bench import build_parser, settings_from_args
from ssd.tools.bench.layer_view import DeepScale, layer_view
from ssd.tools.bench.sampling_check import run_rows
from ssd.tools.bench.smoke import IdTokenizer

FAST = dict(device="cpu", shapes="tiny", acceptances=(0.8,), batches=(1, 2), temperatures=(0.0, 1.0), ks=(1, 2, 3),
            budgets=(4, 8), max_new_tokens=8, prompt_len=8, repeats=2, prefix=16, sampling_samples=120,
            exact_tokens=8, calibration_tokens=8, calibration_steps=3, deadline_s=600.0)


def tiny(role: str, **extra) -> dict:
    name = "qwen2.5-32b" if role == "target" else "qwen2.5-0.5b"
    return {**shape_config(name), **regime.TINY[role], **extra}


# A made-up rank law: t* is the draft's rank 0 after 60% of rejections, its rank 3 after the rest.
LAW = {"a": 0.5, "ranks_rejected": [0] * 6 + [3] * 4, "ranks_bonus": [0] * 9 + [5], "positions": 20}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    (out / "law.json").write_text(json.dumps({"agreement": LAW}))
    report = regime.run_bench(regime.BenchSettings(**FAST, out=out, rank_law=out / "law.json"))
    return report, out


def test_tiny_run_end_to_end(run):
    report, out = run
    assert report.passed, report.errors or report.exactness
    data = json.loads((out / "bench.json").read_text())
    assert data["format"] == regime.FORMAT and (out / "table.txt").read_text().startswith("gpu bench")
    kinds = {(r["mode"], r["kind"], r["draft"]) for r in report.rows}
    assert {("ar", "measured", None), ("sd", "measured", "view"), ("ssd", "measured", "view"),
            ("ssd", "modelled", "view"), ("sd", "measured", "qwen2.5-0.5b")} <= kinds
    assert {(r["batch"], r["temperature"]) for r in report.rows} == {(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)}
    # exactness: both drafts, alone and as rows, and SD's law at T = 1
    assert set(report.exactness) == {"greedy: view draft", "greedy: separate draft", "sampling: SD at T = 1"}
    # the view draft is not forced: its greedy rows are the target's own tokens
    greedy_view = [r for r in report.rows if r["draft"] == "view" and r["temperature"] == 0 and r["kind"] == "measured"]
    assert greedy_view and all(r["equal_to_ar"] for r in greedy_view)
    assert all(r["degraded_rounds"] == 0 for r in report.rows if r["mode"] == "ssd" and r["kind"] == "measured")
    # the view's exactness check accepts some drafts and rejects others: both outcomes are checked
    assert 0 < report.exactness["greedy: view draft"]["accepted"]["sd"]
    # a modelled row never claims a measured figure, nor a measured row a modelled one
    assert all(r["where"].startswith("two devices") for r in report.rows if r["kind"] == "modelled")
    assert all("fraction_of_floor" in r for r in report.rows if r["mode"] == "ar")
    # the forced draft's SSD: measured with its hits forced by the rank law, modelled from that run
    forced = [r for r in report.rows if r["draft"] == "qwen2.5-0.5b" and r["mode"] == "ssd"]
    measured = {(r["batch"], r["temperature"]): r for r in forced if r["kind"] == "measured"}
    assert len(measured) == 4 and all(r["hits_forced_by"] == "the rank law" for r in measured.values())
    assert all(r["degraded_rounds"] == 0 and r["hit_rate"] > 0.3 for r in measured.values())
    for r in forced:
        if r["kind"] == "modelled":
            assert r["hit_rate"] == measured[(r["batch"], r["temperature"])]["hit_rate"]
    assert not report.cut
    # the forced rate holds in the run's own forced SD rows
    assert all(r["forcing_honoured"] for r in report.rows if r["mode"] == "sd" and r["forced"])
    assert abs(report.calibration["0.8"]["acceptance"] - 0.8) < 0.2


def test_modelled_rows_are_the_speed_model(run):
    report, _ = run
    modelled = [r for r in report.rows if r["kind"] == "modelled"]
    assert {r["draft"] for r in modelled} == {"view", "qwen2.5-0.5b"}
    for r in modelled:
        costs = report.costs["view" if r["draft"] == "view" else "separate"]
        verify, backup = costs["verify_s"], costs["backup_s"]
        build = {(e["k"], e["budget"]): e["seconds"] for e in costs["build_s"]}
        rows = regime.RowCosts.from_json(costs["rows"])
        k, b, p, e = r["k"], r["budget"], r["hit_rate"], r["tokens_per_round"]
        fitted = regime.Costs.from_json(costs)  # points not timed come from its fit
        if r["batch"] == 1:
            want = ssd_speed_from(p, e, e, verify[str(k)], backup[str(k)], build[(k, b)], costs["ar_step_s"])
        else:
            n = r["batch"]
            want = ssd_rows_speed(p, e, n, rows.verify_s(n, k + 1), fitted.build(k, n * b), rows.chain_s(n, k),
                                  rows.verify_s(n, 1))
        assert r["tokens_per_s"] == pytest.approx(want.tokens_per_s)


def forced_run(forcing: ForcedAcceptance, k: int = 4, rows: int = 4, tokens: int = 60):
    target = build_random_model(RandomModelSpec(tiny("target"), seed=1), "cpu", direct=True)
    draft = build_random_model(RandomModelSpec(tiny("draft", vocab_size=512), seed=2), "cpu", direct=True)
    engine = SDEngine(target, draft, IdTokenizer(), SpeculationConfig(mode="sd", k=k), BatchingConfig(max_rows=rows),
                      verifier=forcing)
    gen = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(torch.randint(512, (6,), generator=gen).tolist(), SamplingConfig(),
                                  GenerationConfig(max_new_tokens=tokens, ignore_eos=True)) for _ in range(rows)]
    return total(r.stats for r in run_rows(engine, requests))


def test_forced_acceptance_is_honoured_and_a_wrong_forcing_is_caught():
    # unrelated random models: unforced, drafts are all but never accepted
    stats = forced_run(ForcedAcceptance(0.7, seed=3))
    measured, tried = regime.per_position_acceptance(stats), regime.positions_tried(stats)
    assert tried > 100 and honoured(measured, 0.7, tried)
    wrong = regime.per_position_acceptance(forced_run(ForcedAcceptance(0.4, seed=3)))
    assert not honoured(wrong, 0.7, tried)


def test_forced_k_law():
    forcing = ForcedAcceptance(0.5, seed=0)
    ks = [forcing.forced_k(3) for _ in range(4000)]
    for k, p in enumerate([0.5, 0.25, 0.125, 0.125]):
        assert ks.count(k) / len(ks) == pytest.approx(p, abs=0.03)
    assert forcing.measured_rate == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError):
        ForcedAcceptance(1.5)


def test_deadline_cuts_rows_and_still_writes(tmp_path):
    settings = regime.BenchSettings(**{**FAST, "deadline_s": 0.0, "reserve_s": 0.0}, out=tmp_path)
    report = regime.run_bench(settings, started=time.monotonic())
    assert report.rows == [] and not report.errors and not report.exactness
    assert report.cut == ["exactness", "timed models, costs and every row"]
    assert json.loads((tmp_path / "bench.json").read_text())["cut"] == report.cut


def test_direct_draw_is_seeded_in_its_dtype_and_ties_the_head():
    spec = RandomModelSpec(tiny("draft"), seed=5, dtype="bf16")
    a, b = build_random_model(spec, "cpu", direct=True), build_random_model(spec, "cpu", direct=True)
    assert fingerprint(a) == fingerprint(b)
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert weight_bytes(a) == sum(p.numel() * 2 for p in a.parameters())  # tied: counted once
    assert fingerprint(build_random_model(RandomModelSpec(tiny("draft"), seed=6, dtype="bf16"), "cpu", direct=True)) \
        != fingerprint(a)
    assert KVSequence(a).forward([1, 2, 3], last_only=True).isfinite().all()


def test_layer_view_shares_the_target_and_the_dial_sets_agreement():
    target = build_random_model(RandomModelSpec(tiny("target"), seed=1), "cpu", direct=True)
    view = layer_view(target, 1)
    ptrs = {p.data_ptr() for p in target.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= ptrs and view.config.num_hidden_layers == 1
    dial, ids = DeepScale(target, 1), [3, 1, 4, 1, 5]
    dial.set(0.0)  # the deep layers all but silent: the target is its view
    torch.testing.assert_close(KVSequence(target).forward(ids), KVSequence(view).forward(ids), rtol=1e-3, atol=1e-3)
    dial.set(1.0)
    assert not torch.allclose(KVSequence(target).forward(ids), KVSequence(view).forward(ids), atol=1e-3)
    with pytest.raises(ValueError):
        layer_view(target, target.config.num_hidden_layers)


def test_cli_defaults_per_shapes():
    args = build_parser().parse_args(["--device", "cpu"])
    s = settings_from_args(args)
    assert s.shapes == "tiny" and s.dtype == "fp32" and s.max_new_tokens == 12
    assert settings_from_args(build_parser().parse_args(["--device", "cpu", "--shapes", "real"])).max_new_tokens == 48
    with pytest.raises(ValueError, match="two values"):
        settings_from_args(build_parser().parse_args(["--device", "cpu", "--budgets", "4"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inprocess_handoff_orders_the_receivers_stream_after_the_senders():
    from ssd.transport import inprocess_pair
    from ssd.transport.channel import Message

    sender, receiver = inprocess_pair()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 22,), 3.0, device="cuda")
        torch.cuda._sleep(50_000_000)  # the side stream stays busy: an unordered read sees the copy unfinished
        x.add_(1.0)
        sender.send(Message("t", {}, [x]))
    got = receiver.recv(timeout=30).tensors[0]  # on the default stream
    assert float(got.sum()) == 4.0 * (1 << 22)


def test_a_deadline_mid_run_keeps_the_rows_before_it(tmp_path, monkeypatch):
    """The clock runs out after the AR rows: every later row is listed as cut, none half-run, and the
    files still hold what ran."""
    ticks = iter(range(100))
    monkeypatch.setattr(regime.Clock, "left", lambda self: 1.0 if next(ticks) < 7 else -1.0)  # 3 phases, 4 AR rows
    settings = regime.BenchSettings(**FAST, out=tmp_path)
    report = regime.run_bench(settings)
    assert [r["mode"] for r in report.rows] == ["ar"] * 4 and not report.errors
    assert any(c.startswith("view@0.8") for c in report.cut) and any(c.startswith("SD qwen") for c in report.cut)
    assert len(json.loads((tmp_path / "bench.json").read_text())["rows"]) == 4
    assert "cut: " in (tmp_path / "table.txt").read_text()


def test_launch_main_writes_the_three_files(tmp_path, capsys):
    from ssd.tools.bench.gpu_bench import main

    out = tmp_path / "b"
    code = main(["--device", "cpu", "--shapes", "tiny", "--out", str(out), "--acceptances", "0.8", "--batches", "1",
                 "--temperatures", "0", "--ks", "1", "2", "--budgets", "4", "8", "--max-new-tokens", "6",
                 "--sampling-samples", "60", "--repeats", "1"])
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"bench.json", "table.txt", "log.txt"}
    assert "row: " in (out / "log.txt").read_text() and "bar: AR" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ssd_in_one_process_on_its_own_stream_is_exact_and_never_syncs_the_device(monkeypatch):
    """The measured SSD path: the view draft on a CUDA stream of its own, greedy rows equal to AR's,
    and no device-wide synchronize once the graphs are captured (capturing one synchronises)."""
    from ssd.config import FanoutConfig

    target = build_random_model(RandomModelSpec(tiny("target"), seed=1), "cuda:0", direct=True)
    view = layer_view(target, 1)
    DeepScale(target, 1).set(0.2)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(512, (8,), generator=gen).tolist() for _ in range(2)]
    spec = SpeculationConfig(mode="ssd", k=3, fanout=FanoutConfig(budget=4))
    ar = regime.generate(regime.engine_maker("ar", target, None, None, 2, device="cuda:0"), prompts, 16, 0.0, None)
    make = regime.engine_maker("ssd", target, view, spec, 2, device="cuda:0")
    regime.generate(make, prompts, 16, 0.0, spec)  # captures every bucket the next run replays

    def refuse(*args, **kwargs):
        raise AssertionError("a device-wide synchronize on the SSD path")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    run = regime.generate(make, prompts, 16, 0.0, spec)
    assert run.tokens == ar.tokens
    assert run.stats.spec.degraded_rounds == 0 and run.stats.accepted > 0 and run.stats.spec.lookups > 0


def test_a_forced_draft_without_its_measured_run_is_modelled_from_the_rank_law(tmp_path, monkeypatch):
    (tmp_path / "law.json").write_text(json.dumps({"agreement": LAW}))
    keep = regime.room

    def no_measured_ssd(report, clock, name):
        if "(measured" in name:
            report.cut.append(name)
            return False
        return keep(report, clock, name)

    monkeypatch.setattr(regime, "room", no_measured_ssd)
    settings = regime.BenchSettings(**{**FAST, "batches": (1,), "temperatures": (0.0,)}, out=tmp_path,
                                    rank_law=tmp_path / "law.json")
    report = regime.run_bench(settings)
    forced = [r for r in report.rows if r["draft"] == "qwen2.5-0.5b" and r["mode"] == "ssd"]
    assert [r["kind"] for r in forced] == ["modelled"]
    law = regime.Agreement(0.8, LAW["ranks_rejected"], LAW["ranks_bonus"])
    want = hit_rate(law, geometric_fanout(0.8, 1.0, forced[0]["k"], forced[0]["budget"]))
    assert forced[0]["hit_rate"] == pytest.approx(want) and 0 < want < 1
    assert forced[0]["hit_rate_from"] == "the rank law at the plan's schedule"


def test_the_shipped_rank_law_loads_and_its_writer_round_trips():
    from ssd.tools.bench.gpu_bench import RANK_LAW
    from ssd.tools.bench.rank_law import FORMAT, dumps

    data = json.loads(RANK_LAW.read_text())
    assert data["format"] == FORMAT and json.loads(dumps(data)) == data
    law = regime.load_rank_law(RANK_LAW)
    assert law.positions == len(law.ranks_bonus) > 100 and 0.5 < law.a < 1
    assert len(law.ranks_rejected) == sum(rank > 0 for rank in law.ranks_bonus)  # a rejection: not the draft's top
