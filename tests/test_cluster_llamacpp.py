"""SSD through the cluster with both actors on llama.cpp (the tiny models written to GGUF).

A module of its own: its Cluster needs the two cores that test_cluster's
module-wide Cluster holds while that module runs.
"""

import dataclasses

import pytest

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig
from ssd.engine import AREngine
from ssd.engine.request import GenerationRequest
from ssd.models import load_model, load_tokenizer
from tests.test_cluster import CONFIG, GREEDY, PROMPTS

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")

pytestmark = pytest.mark.cluster


def test_ssd_on_the_llamacpp_backend_through_the_cluster(shared_ray):
    """Both actors load their model on llama.cpp; greedy SSD through the
    cluster equals AR on the same backend, with cache hits."""
    config = dataclasses.replace(
        CONFIG, target=dataclasses.replace(CONFIG.target, backend="llamacpp"),
        draft=dataclasses.replace(CONFIG.draft, backend="llamacpp"),
    )
    local = AREngine(load_model(config.target), load_tokenizer(config.target))
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as c:
        for prompt in PROMPTS:
            request = GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40))
            out = c.generate(request)
            assert out.token_ids == local.generate(request).token_ids
            assert out.stats.mode == "ssd" and out.stats.spec.hits > 0 and out.stats.spec.degraded_rounds == 0
            assert out.stats.precision == "target gguf f32, draft gguf f32", out.stats.precision  # as each loaded
