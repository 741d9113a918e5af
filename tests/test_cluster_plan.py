"""SSD's start-up plan on the cluster: each half timed on its own actor, the
plan's K, budget and glue in force for requests without settings of their own."""

from __future__ import annotations

import dataclasses
import json

import pytest
import ray

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import RuntimeConfig, load_config
from ssd.engine.request import GenerationRequest
from tests.conftest import ROOT
from tests.test_cluster import local_ar

pytestmark = pytest.mark.cluster

CONFIG = load_config(ROOT / "configs" / "tiny-cluster.yaml")


def test_the_cluster_plans_at_start_and_runs_the_plan(shared_ray, tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    config = dataclasses.replace(CONFIG, runtime=RuntimeConfig(plan=True, plan_keeps=["glue"]))
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as cluster:
        plans = list((tmp_path / "plans").glob("*.json"))
        assert len(plans) == 1  # measured on the actors, cached here
        wide_s = json.loads(plans[0].read_text())["target"]["ar_wide_step_s"]  # the draft's core lent
        assert cluster.plan.ar_wide_tokens_per_s == pytest.approx(1 / wide_s)
        assert cluster.config.speculation.k_policy == cluster.plan.k_policy
        chosen = cluster.config.speculation
        assert chosen.glue == CONFIG.speculation.glue  # kept, as asked
        worker = ray.get(cluster.targets[0].__ray_call__.remote(lambda self: self.config.speculation))
        assert worker == chosen
        assert 0 < cluster.link_round_trip_s < 1 and cluster.plan.best.link_s == cluster.link_round_trip_s
        prompt = cluster.encode(CONFIG.prompt)
        out = cluster.generate(GenerationRequest(prompt, CONFIG.sampling, CONFIG.generation))
        assert out.token_ids == local_ar(CONFIG, prompt, CONFIG.generation.max_new_tokens)
        # the plan's K drafted each round, unless AR on both cores was the faster plan at one row
        drafted = 0 if cluster.plan.lends_draft_core else chosen.k
        assert len(out.stats.acceptance_by_position) == drafted


def test_the_launcher_s_one_shot_generation_runs_the_cluster_s_planned_settings(capsys):
    """`launch/cluster.py "prompt"` sends the cluster's speculation (the plan's), not the config file's."""
    from types import SimpleNamespace

    from ssd.app.launcher import run_one

    planned = dataclasses.replace(CONFIG.speculation, k=2)
    sent = []
    result = SimpleNamespace(text="x", finish_reason="length", stats=SimpleNamespace(summary=lambda: ""))
    cluster = SimpleNamespace(config=dataclasses.replace(CONFIG, speculation=planned), encode=lambda text, chat: [1],
                              generate=lambda request: (sent.append(request), result)[1])
    run_one(cluster, CONFIG, "abc", chat=False)
    assert sent[0].speculation == planned != CONFIG.speculation
