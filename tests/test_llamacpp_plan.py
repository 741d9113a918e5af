"""SSD's start-up plan on the llama.cpp backend (ssd.saguaro.startup, ssd.saguaro.costs).

A tiny target and its noisy draft (the target's weights plus 5% noise) are
written to GGUF (ssd.models.gguf_export) and loaded with llama.cpp; the
plan's probes time them through ssd.models.backend as they time torch
models: every cost comes out positive and finite, the target's greedy
continuations and the draft's agreement are torch's, and the plan they give
is a speculation among the planner's candidates.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from ssd.models import TinyTokenizer  # noqa: E402
from ssd.models.gguf_export import export_gguf  # noqa: E402
from ssd.models.llamacpp import LlamaCppModel  # noqa: E402
from tests.test_llamacpp import CFG, _model  # noqa: E402
from ssd.saguaro import startup  # noqa: E402
from ssd.saguaro.costs import CostSettings, measure_costs  # noqa: E402
from ssd.saguaro.plan import DEFAULT_BUDGETS, DEFAULT_KS  # noqa: E402

@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(torch target, torch draft), (llama.cpp target, llama.cpp draft): the same weights."""
    target, draft = _model(), _model(dataclasses.replace(CFG, noise=0.05))
    folder = tmp_path_factory.mktemp("gguf")
    lt = LlamaCppModel(export_gguf(target, folder / "target.gguf"))
    ld = LlamaCppModel(export_gguf(draft, folder / "draft.gguf"))
    return (target, draft), (lt, ld)


@pytest.fixture(scope="module")
def probes(pairs):
    """Both probes on the llama.cpp pair, as plan_in_process runs them (one timed pass)."""
    _, (lt, ld) = pairs
    prompts = startup.sample_prompt_ids(TinyTokenizer(CFG.vocab_size))
    target_part = startup.target_probe(lt, repeats=1) | {"sequences": startup.continuations(lt, prompts)["sequences"]}
    draft_part = startup.draft_probe(ld, repeats=1)
    draft_part["agreement"] = startup.agreement(ld, target_part["sequences"], [len(p) for p in prompts]).to_json()
    return prompts, target_part, draft_part


def _positive(seconds) -> bool:
    return all(math.isfinite(s) and s > 0 for s in seconds)


def test_probes_time_every_cost(probes):
    _, target_part, draft_part = probes
    assert set(target_part) == startup.TARGET_PART and set(draft_part) == startup.DRAFT_PART
    assert sorted(target_part["verify_s"]) == list(startup.VERIFY_KS)
    assert sorted(draft_part["backup_s"]) == list(startup.BACKUP_KS)
    assert _positive([target_part["ar_step_s"], *target_part["verify_s"].values(), *draft_part["backup_s"].values()])
    assert _positive(s for _, _, s in target_part["rows_verify_s"])
    assert _positive(s for _, _, s in draft_part["rows_chain_s"])
    # fold rides on torch's tree decoder (llama.cpp's builds reuse): only reuse is timed, so the
    # plan never models a fold it would not run
    assert set(draft_part["build_s"]) == {"reuse"}
    builds = [(k, b) for k in startup.BUILD_KS for b in startup.BUILD_BUDGETS]
    for points in draft_part["build_s"].values():
        assert sorted((k, b) for k, b, _ in points) == builds
        assert _positive(s for _, _, s in points)


def test_continuations_and_agreement_are_torch_s(pairs, probes):
    """The target's greedy continuations are the torch target's, and the draft's ranks of
    them are the torch draft's (fp32 logits ~2e-6 apart: at most a near-tie may differ)."""
    (target, draft), _ = pairs
    prompts, target_part, draft_part = probes
    sequences = target_part["sequences"]
    assert sequences == startup._continue_rows(target, prompts, startup.CONTINUATION)
    assert [len(s) for s in sequences] == [len(p) + startup.CONTINUATION for p in prompts]
    got = draft_part["agreement"]
    want = startup.agreement(draft, sequences, [len(p) for p in prompts]).to_json()
    assert got["positions"] == want["positions"] == len(prompts) * startup.CONTINUATION
    assert abs(got["a"] - want["a"]) <= 1 / want["positions"]
    assert 0 < got["a"] < 0.99  # the noisy draft agrees often, not always


def test_plan_from_the_probes_is_a_valid_speculation(probes, pairs, tmp_path):
    _, target_part, draft_part = probes
    plan = startup.plan_from_probes(target_part, draft_part, {"backend": "llama.cpp"})
    best = plan.best
    assert best.k in DEFAULT_KS and best.budget in DEFAULT_BUDGETS and best.glue == "reuse"
    assert math.isfinite(best.tokens_per_s) and best.tokens_per_s > 0
    assert [row.rows for row in plan.rows] == [1, 2, 4, 8]
    assert plan.ar_tokens_per_s == pytest.approx(1 / target_part["ar_step_s"])
    # plan_in_process measures the same way, and caches what it measured
    _, (lt, ld) = pairs
    planned = startup.plan_in_process(lt, ld, TinyTokenizer(CFG.vocab_size), "lcpp", {}, directory=tmp_path)
    assert planned.best.k in DEFAULT_KS and planned.best.budget in DEFAULT_BUDGETS
    assert (tmp_path / "lcpp.json").is_file()


@pytest.mark.parametrize("glue", ["full", "reuse"])
def test_measure_costs(pairs, glue):
    """The ablation's cost model times a llama.cpp pair too (its branches: LlamaCppBranches)."""
    _, (lt, ld) = pairs
    costs = measure_costs(lt, ld, CostSettings(ks=(1, 3), budgets=(2, 6), repeats=1, glue=glue))
    assert _positive([costs.ar_step_s, *costs.verify_s.values(), *costs.backup_s.values(), *costs.build_s.values()])
    assert sorted(costs.build_s) == [(1, 2), (1, 6), (3, 2), (3, 6)]
