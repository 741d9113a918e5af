"""The prefix cache through the Ray cluster: the engine on target rank 0 keeps a finished
request's whole prompt chunks, the driver's idle calls (RemoteBatchEngine.warm, what the serving
worker makes between requests) prefill its reply there, and a chat's next turn takes both; its
greedy output is local AR's, in AR and SSD."""

from __future__ import annotations

import dataclasses

import pytest

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig, SamplingConfig
from ssd.engine.prefix import whole_chunks
from ssd.engine.request import GenerationRequest
from tests.test_cluster import CONFIG, local_ar

CHUNK = 4
GREEDY = SamplingConfig(temperature=0.0)
PROMPT = [(7 * i + 3) % 16 for i in range(14)]


@pytest.fixture(scope="module")
def cluster(shared_ray):
    config = dataclasses.replace(CONFIG, batching=dataclasses.replace(CONFIG.batching, prefill_chunk=CHUNK))
    with Cluster(config, plan_placement("0", "1", 2, "cpu")) as c:
        yield c


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_chats_next_turn_takes_the_last_prompt_and_its_reply_on_the_target(cluster, mode):
    spec = dataclasses.replace(CONFIG.speculation, mode=mode)
    prompt = PROMPT if mode == "ar" else PROMPT[::-1]  # each mode's engine has its own cache
    with cluster.batch_engine(mode) as engine:
        first = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=12), spec))
        assert first.stats.cached_prompt_tokens == 0
        warmed = 0
        while engine.warm():
            warmed += 1
        assert warmed > 0
        turn = prompt + first.token_ids + [1, 2, 3]
        second = engine.generate(GenerationRequest(turn, GREEDY, GenerationConfig(max_new_tokens=12), spec))
    held = prompt + first.token_ids
    assert second.stats.cached_prompt_tokens == whole_chunks(held, len(held), CHUNK) > len(prompt)
    assert second.token_ids == local_ar(CONFIG, turn, 12)
