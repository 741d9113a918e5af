"""SSD through the cluster with both actors on the llama.cpp backend (a module of
its own: Ray holds the two cores while another module's cluster is up)."""

import dataclasses

import pytest

pytest.importorskip("llama_cpp")

from ssd.cluster.devices import plan_placement  # noqa: E402
from ssd.cluster.runtime import Cluster  # noqa: E402
from ssd.config import GenerationConfig, SamplingConfig, load_config  # noqa: E402
from ssd.engine import AREngine  # noqa: E402
from ssd.engine.request import GenerationRequest  # noqa: E402
from ssd.models import load_model, load_tokenizer  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

pytestmark = pytest.mark.cluster

CONFIG = load_config(ROOT / "configs" / "tiny-cluster.yaml")
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


def test_ssd_on_the_llamacpp_backend_through_the_cluster():
    """Both actors load their model on llama.cpp (the tiny models written to GGUF); greedy
    SSD through the cluster equals AR on the same backend, with cache hits."""
    config = dataclasses.replace(
        CONFIG, target=dataclasses.replace(CONFIG.target, backend="llamacpp"),
        draft=dataclasses.replace(CONFIG.draft, backend="llamacpp"),
    )
    local = AREngine(load_model(config.target), load_tokenizer(config.target))
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as c:
        for prompt in PROMPTS:
            request = GenerationRequest(prompt, SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=40))
            out = c.generate(request)
            assert out.token_ids == local.generate(request).token_ids
            assert out.stats.mode == "ssd" and out.stats.spec.hits > 0 and out.stats.spec.degraded_rounds == 0
            assert out.stats.precision == "target gguf f32, draft gguf", out.stats.precision
