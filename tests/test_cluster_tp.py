"""A tensor-parallel target through the cluster: TP=2 greedy == TP=1.

A module of its own: its two target ranks take both cores, so no other
cluster (like test_cluster's shared one) may be holding them.
"""

import dataclasses

import pytest
import ray

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig
from ssd.engine.request import GenerationRequest
from tests.test_cluster import CONFIG, GREEDY, PROMPTS, local_ar

pytestmark = pytest.mark.cluster


def test_tensor_parallel_target_equals_single_rank():
    # fp64: TP=2 sums the ranks' partial products in another order than one
    # rank does; in fp32 that moves logits by ~1e-5 and could flip a near-tie.
    config = dataclasses.replace(
        CONFIG, speculation=dataclasses.replace(CONFIG.speculation, mode="ar"),
        target=dataclasses.replace(CONFIG.target, dtype="fp64"),
    )
    with Cluster(config, plan_placement("0-1", None, 2, "cpu")) as tp2:
        for prompt in PROMPTS:
            out = tp2.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=32), config.speculation))
            assert out.token_ids == local_ar(config, prompt, 32)
        # Two ranks really ran: rank 1 is still mirroring rank 0 (it returns only when stopped).
        assert len(tp2.targets) == 2 and not ray.wait(tp2._followers, timeout=0)[0]
