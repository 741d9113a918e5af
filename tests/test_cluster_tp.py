"""A tensor-parallel target through the cluster: TP=2 greedy == TP=1, and a
forward that fails on any rank fails its request and restarts the group.

A module of its own: its two target ranks take both cores, so no other
cluster (like test_cluster's shared one) may be holding them.
"""

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig
from ssd.engine.request import GenerationRequest, GeneratorUnavailable
from tests.test_cluster import CONFIG, GREEDY, PROMPTS, local_ar

pytestmark = pytest.mark.cluster

# fp64: TP=2 sums the ranks' partial products in another order than one
# rank does; in fp32 that moves logits by ~1e-5 and could flip a near-tie.
# step_deadline_s: a hung rank is seen within it (a tiny step takes milliseconds).
# tp_timeout_s: the collectives' limit, above it (the deadline sees a hang first) and kept
# from idle ranks by the leader's keepalive (ssd.models.tp).
DEADLINE_S = 10.0
TP_TIMEOUT_S = 30.0
TP_CONFIG = dataclasses.replace(
    CONFIG, speculation=dataclasses.replace(CONFIG.speculation, mode="ar"),
    target=dataclasses.replace(CONFIG.target, dtype="fp64"),
    cluster=dataclasses.replace(CONFIG.cluster, step_deadline_s=DEADLINE_S, tp_timeout_s=TP_TIMEOUT_S),
)
HANG_S = 90.0  # a failed forward must end its request well before this; before the fix it never did


@pytest.fixture(scope="module")
def tp2(shared_ray):
    with Cluster(TP_CONFIG, plan_placement("0-1", None, 2, "cpu")) as cluster:
        yield cluster


def generate(cluster: Cluster, prompt: list[int], n: int = 32):
    request = GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n), TP_CONFIG.speculation)
    pool = ThreadPoolExecutor(1)  # a hang fails the test instead of the suite
    try:
        return pool.submit(cluster.generate, request).result(timeout=HANG_S)
    finally:
        pool.shutdown(wait=False)  # never join a hung call


def test_a_started_group_has_run_a_forward_on_every_rank_before_it_serves(tp2):
    """SERVING means computed, not merely loaded: at start rank 0 runs one forward, which its
    follower mirrors (then a reset), so a pair that loads but cannot compute fails its start.
    First in this module: no request has run on this group yet."""
    from ssd.models import tp

    assert tp2.serving and tp2.target_restarts == 0
    assert ray.get(tp2.targets[1].__ray_call__.remote(lambda worker: tp.commands_mirrored())) == 2
    timeout = ray.get(tp2.targets[0].__ray_call__.remote(lambda worker: worker.leader.timeout))
    assert timeout.total_seconds() == TP_TIMEOUT_S  # cluster.tp_timeout_s


def test_tensor_parallel_target_equals_single_rank(tp2):
    for prompt in PROMPTS:
        assert generate(tp2, prompt).token_ids == local_ar(TP_CONFIG, prompt, 32)
    # Two ranks really ran: rank 1 is still mirroring rank 0 (it returns only when stopped).
    assert len(tp2.targets) == 2 and not ray.wait(tp2._followers, timeout=0)[0]


def test_rows_batch_on_a_tensor_parallel_target(tp2):
    """Several requests step together on the group (each row mirrored on rank 1), each equal to AR alone."""
    requests = [GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=n), TP_CONFIG.speculation)
                for p, n in zip(PROMPTS, (20, 12, 16))]
    results, widest = {}, 0
    with tp2.batch_engine("ar") as engine:
        for request in requests:
            engine.admit(request)
        while engine.rows:
            rows = engine.rows
            for finished in engine.step():
                results[id(finished.request)] = finished.result
            widest = max(widest, *engine.stepped_rows(rows))
    assert widest == len(requests)
    for request in requests:
        want = local_ar(TP_CONFIG, request.prompt_ids, request.generation.max_new_tokens)
        assert results[id(request)].token_ids == want


def fail_forward_at(worker, n: int) -> None:
    """Run inside a target actor: its n-th KVSequence forward from now raises (a CUDA OOM, say)."""
    from ssd.models import kv

    original, calls = kv.KVSequence.forward, itertools.count(1)

    def forward(self, ids, last_only=False):
        if next(calls) == n:
            raise RuntimeError("injected: CUDA out of memory")
        return original(self, ids, last_only)

    kv.KVSequence.forward = forward


@pytest.mark.parametrize("rank", [1, 0], ids=["follower", "leader"])
def test_a_failed_forward_fails_the_request_and_restarts_the_group(tp2, rank):
    tp2.wait_serving()
    restarts = tp2.target_restarts
    ray.get(tp2.targets[rank].__ray_call__.remote(fail_forward_at, 3))  # prefill, a decode, then this one
    started = time.monotonic()
    with pytest.raises(GeneratorUnavailable, match=rf"forward failed on target rank {rank}.*injected: CUDA out of memory"):
        generate(tp2, PROMPTS[0])
    assert time.monotonic() - started < HANG_S
    deadline = time.monotonic() + HANG_S
    while tp2.target_restarts == restarts and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tp2.target_restarts == restarts + 1  # the whole group, as for a lost rank
    assert generate(tp2, PROMPTS[2]).token_ids == local_ar(TP_CONFIG, PROMPTS[2], 32)


def sleep_forward_at(worker, n: int, seconds: float) -> None:
    """Run inside a target actor: its n-th KVSequence forward from now sleeps `seconds` first (a hung
    rank: the other rank then waits in the forward's all-reduce, over gloo)."""
    from ssd.models import kv

    original, calls = kv.KVSequence.forward, itertools.count(1)

    def forward(self, ids, last_only=False):
        if next(calls) == n:
            time.sleep(seconds)
        return original(self, ids, last_only)

    kv.KVSequence.forward = forward


def test_a_rank_that_hangs_in_a_forward_ends_its_request_and_health_within_the_step_deadline(tp2):
    """Before the deadline the request waited forever, SERVING: nothing times a single cluster's step."""
    tp2.wait_serving()
    restarts = tp2.target_restarts
    health: list[tuple[bool, float]] = []
    tp2.add_health_listener(lambda serving, why: health.append((serving, time.monotonic())))
    ray.get(tp2.targets[1].__ray_call__.remote(sleep_forward_at, 3, 3600.0))  # prefill, a decode, then hang
    started = time.monotonic()
    with pytest.raises(GeneratorUnavailable, match=r"past cluster.step_deadline_s \(10 s\)"):
        generate(tp2, PROMPTS[1])
    assert time.monotonic() - started < DEADLINE_S + 10
    assert health and health[0][0] is False and health[0][1] - started < DEADLINE_S + 10  # NOT_SERVING
    deadline = time.monotonic() + HANG_S
    while tp2.target_restarts == restarts and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tp2.target_restarts == restarts + 1
    assert generate(tp2, PROMPTS[1]).token_ids == local_ar(TP_CONFIG, PROMPTS[1], 32)

