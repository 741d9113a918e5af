"""launch/gpu_smoke.py at small shapes on the CPU, so the GPU smoke run cannot rot.

One in-process run (ssd.tools.bench.smoke.run_smoke) and one run of the CLI in a
subprocess with every dependency the GPU box lacks unimportable (Ray among them), its
second process included. Both start a spawned draft process, whose imports take most of the
time; the CLI is started first so the two overlap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssd.saguaro.costs import load_costs
from ssd.tools.ablation.trace import RecordSettings, record_trace, save_trace
from ssd.tools.bench.branch_check import branch_case, compare, sequential, tree
from ssd.tools.bench.smoke import SmokeSettings, model_specs, run_smoke, summary_text
from ssd.config import GenerationConfig, SamplingConfig
from ssd.models.shapes import build_random_model, fingerprint, shape_config
from tests.conftest import ROOT

KS, BUDGETS = (1, 2), (4, 8)
# Small and quick: two K, two budgets, one timed repeat, short sequences.
SMALL = {"max_new_tokens": 16, "prompts": 2, "prompt_len": 12, "repeats": 1, "prefix": 32, "link_rounds": 10,
         "sampling_samples": 200}
CLI_ARGS = ["--device", "cpu", "--shapes", "small", "--ks", *map(str, KS), "--budgets", *map(str, BUDGETS),
            *[arg for name, value in SMALL.items() for arg in (f"--{name.replace('_', '-')}", str(value))]]
# Our dependencies that the GPU machine's image lacks (it has torch, transformers, numpy,
# pyyaml, msgpack, grpcio, protobuf, safetensors, tokenizers, tqdm, matplotlib): importing
# any of them, here or in the spawned draft process, raises ImportError.
ABSENT_ON_GPU_BOX = ("ray", "gguf", "llama_cpp", "llguidance", "fastapi", "starlette", "uvicorn", "pydantic",
                     "grpc_tools", "grpc_health", "grpc_reflection")
BLOCK_ABSENT = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_ON_GPU_BOX)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory, tiny_models, tiny_tokenizer) -> Path:
    """A greedy trace of the tiny pair: what `ablate.py plan` replays next to the costs."""
    settings = RecordSettings(SamplingConfig(), GenerationConfig(max_new_tokens=24), top_n=16)
    trace = record_trace(*tiny_models, tiny_tokenizer, [[1, 2, 3], [5, 6]], settings,
                         {"target": {"name": "tiny"}, "draft": {"name": "tiny"}})
    return save_trace(trace, tmp_path_factory.mktemp("trace") / "t.safetensors")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, trace_file):
    """The CLI, started at once with what the GPU box lacks blocked through sitecustomize;
    yields (process, out dir)."""
    shim = tmp_path_factory.mktemp("no_ray")
    (shim / "sitecustomize.py").write_text(BLOCK_ABSENT)
    out = tmp_path_factory.mktemp("smoke_cli")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)])}
    # Files, not pipes: nobody reads a pipe while the in-process run goes on, and a full one would block the CLI.
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "launch" / "gpu_smoke.py"), *CLI_ARGS, "--out", str(out),
             "--trace", str(trace_file), "--timeout-s", "120", "--log-level", "WARNING"],
            env=env, cwd=ROOT, stdout=stdout, stderr=stderr, text=True,
        )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_smoke_in_process(cli_run, tmp_path):
    settings = SmokeSettings(device="cpu", shapes="small", out=tmp_path, ks=KS, budgets=BUDGETS, timeout_s=120, **SMALL)
    report = run_smoke(settings)
    assert report.passed, summary_text(report)
    for pair in ("real pair", "noisy pair"):
        check = report.checks[f"generation: {pair}"]
        everything = {"sd": True, "ssd": True, "ar rows": True, "sd rows": True, "ssd rows": True}
        assert check["equal_to_ar"] == everything and check["ssd_degraded_rounds"] == 0
        assert check["draft_same_in_both_processes"]
    noisy = report.checks["generation: noisy pair"]
    assert noisy["accepted"]["sd"] > 0 and noisy["accepted"]["ssd"] > 0 and noisy["ssd_hit_rate"] > 0
    branches = report.checks["branches"]
    assert {"fp32/math", "fp32/flash"} <= set(branches["ran"])  # the CPU's two SDPA backends
    assert all(branches["results"][key]["token_mismatches"] == 0 for key in branches["ran"])
    assert list(report.checks["graphs"]["devices"]) == ["cpu"]  # another index only on a multi-GPU machine
    assert sorted(report.checks["graphs"]["batched"]) == [2, 8]  # 2 rows and batching.max_rows
    assert report.checks["sampling"]["samples"] == 200
    costs = load_costs(tmp_path / "costs.json")
    assert set(costs.verify_s) == set(KS) and set(costs.backup_s) == set(KS)
    assert set(costs.build_s) == {(k, b) for k in KS for b in BUDGETS}
    assert set(costs.meta["tree_step_s"]) == {str(b) for b in BUDGETS}
    hot = report.timings["hot_path"]  # per row vs one call, static eager (graphs: CUDA only)
    assert set(hot["target decode"]) == {"per_row", "one_call", "static"}
    batches = {f"target decode batch of {n}" for n in (2, 8)}  # 2 and batching.max_rows sequences
    assert set(hot) == {"target decode", f"target verify K={settings.k}", *(f"draft tree step B={b}" for b in BUDGETS),
                        *batches}
    assert all(set(hot[name]) == {"packed", "batched static"} for name in batches)
    assert costs.meta["machine"]["cpu_model"] and costs.meta["device"] == "cpu"
    assert costs.meta["link_round_trip_ms"]["round (header only)"]["median_ms"] > 0
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["passed"] and saved["format"] == "ssd-gpu-smoke/1"


def test_cli_without_ray_and_plan_reads_its_costs(cli_run, trace_file, capsys):
    proc, out = cli_run
    proc.wait(timeout=300)
    stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
    assert proc.returncode == 0, stdout + stderr[-4000:]
    assert "gpu smoke: PASSED" in stdout and "plan: AR" in stdout
    report = json.loads((out / "smoke.json").read_text())
    assert report["passed"] and report["plan"]["sd"]["k"] in KS
    from ssd.tools.ablation import cli as ablate

    ablate.main(["plan", "--trace", str(trace_file), "--costs", str(out / "costs.json"),
                 "--ks", *map(str, KS), "--budgets", *map(str, BUDGETS), "--log-level", "WARNING"])
    assert "SD at its best K=" in capsys.readouterr().out


@pytest.mark.parametrize("name, total, non_embedding", [
    ("qwen2.5-coder-1.5b-instruct", 1.54e9, 1.31e9),  # the published counts
    ("qwen2.5-coder-0.5b-instruct", 0.49e9, 0.36e9),
])
def test_shape_configs_give_the_published_sizes(name, total, non_embedding):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):  # shapes only: nothing is allocated
        model = Qwen2ForCausalLM(Qwen2Config(**shape_config(name)))
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(total, rel=0.01)
    assert params - model.model.embed_tokens.weight.numel() == pytest.approx(non_embedding, rel=0.01)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as released
    assert model.config.rope_parameters["rope_theta"] == 1e6


def test_random_models_rebuild_identically_and_noise_changes_them():
    target, draft = model_specs(SmokeSettings())["noisy pair"]
    assert fingerprint(build_random_model(draft)) == fingerprint(build_random_model(draft))
    assert fingerprint(build_random_model(target)) != fingerprint(build_random_model(draft))


def test_sampling_check_catches_a_broken_verifier():
    """The T > 0 check has power: a verifier that accepts every draft fails it."""
    from ssd.sampling import sample
    from ssd.tools.bench.sampling_check import check_sampling
    from ssd.verify import Outcome

    def accept_all(drafted, q, p, gen, greedy=False):
        return Outcome(len(drafted), sample(p[-1], gen))

    result = check_sampling("cpu", samples=200, verifier=accept_all)
    assert not result["passed"] and result["pvalue"] < 1e-6


def test_branch_check_catches_a_wrong_prefix():
    """The comparison has power: branches that see one cached entry too few are caught."""
    model = build_random_model(model_specs(SmokeSettings())["real pair"][1])
    case = branch_case(model.config.vocab_size, context_len=24, branches=6, steps=3)
    tokens, ref = sequential(model, case)
    assert compare(tokens, ref, tree(model, case, tokens), 2e-3)["passed"]
    shifted = dataclasses.replace(case, prefix_lens=[p - 1 for p in case.prefix_lens])
    result = compare(tokens, ref, tree(model, shifted, tokens), 2e-3)
    assert not result["passed"] and result["max_rel_logit_diff"] > 0.01
