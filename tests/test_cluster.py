"""The distributed runtime on CPU: real Ray actors, gloo links, tiny models.

The tests share one Cluster (its actors take seconds to start) in the worker's
one Ray (tests/conftest.py: shared_ray); the SSD-on-llama.cpp cluster, which
needs the cores this one holds, is in test_cluster_llamacpp.
"""

import dataclasses
import itertools
import random
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import GenerationConfig, SamplingConfig, load_config
from ssd.engine import AREngine
from ssd.engine.request import GenerationRequest, Processing
from ssd.models import build_tiny_model, load_tokenizer
from ssd.models.loading import TORCH_DTYPES
from tests.conftest import ROOT
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue

pytestmark = pytest.mark.cluster

CONFIG = load_config(ROOT / "configs" / "tiny-cluster.yaml")
GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


def local_ar(config, prompt, n, processing=None, **generation):
    target = build_tiny_model(config.target.tiny, TORCH_DTYPES[config.target.dtype])
    engine = AREngine(target, load_tokenizer(config.target))
    request = GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n, **generation), processing=processing)
    return engine.generate(request).token_ids


@pytest.fixture(scope="module")
def cluster(shared_ray):
    with Cluster(CONFIG, plan_placement("0", "1", 2, "cpu")) as c:
        yield c


def test_ssd_greedy_equals_ar_through_the_cluster(cluster):
    for prompt in PROMPTS:
        out = cluster.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
        assert out.token_ids == local_ar(CONFIG, prompt, 40)
        assert out.stats.mode == "ssd" and out.stats.spec.hits > 0 and out.stats.spec.degraded_rounds == 0


def test_logits_processing_and_end_conditions_travel_to_the_targets_actor(cluster):
    """logit_bias, penalties, vLLM's repetition penalty and allowed ids, and a stop token: SSD
    greedy through the actors == local AR with the same processing, which differs from AR without;
    the prompt's log-probabilities come back with the result."""
    spec = Processing(logit_bias=((3, 2.0),), presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.5, allowed_token_ids=tuple(range(12)))
    prompt = PROMPTS[0]
    want = local_ar(CONFIG, prompt, 40, spec)
    assert want != local_ar(CONFIG, prompt, 40) and max(want) < 12
    out = cluster.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40), processing=spec))
    assert out.token_ids == want and out.stats.mode == "ssd"
    stop_at = next(i for i, t in enumerate(want) if i >= 5 and t not in want[:i])  # the first time it appears
    ended = cluster.generate(GenerationRequest(
        prompt, GREEDY, GenerationConfig(max_new_tokens=40, stop_token_ids=[want[stop_at]]), processing=spec))
    assert ended.token_ids == want[: stop_at + 1] and ended.finish_reason == "stop"
    scored = cluster.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=4), prompt_logprobs=1))
    assert [e.token for e in scored.prompt_logprobs] == prompt[1:] and all(len(e.top) == 1 for e in scored.prompt_logprobs)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_step_call_runs_steps_until_a_row_leaves_with_output_unchanged(cluster, mode):
    """cluster.step_call_s: one Ray call keeps stepping (each step the engine's own, so
    greedy output is AR's) and returns when a row leaves; 0 is one step a call."""
    spec = dataclasses.replace(CONFIG.speculation, mode=mode)
    requests = [GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n), spec)
                for prompt, n in ((PROMPTS[0], 30), (PROMPTS[2], 12))]
    with cluster.batch_engine(mode) as engine:
        engine.call_s = 30.0  # nothing but a leaving row (or an empty batch) ends a call
        for request in requests:
            engine.admit(request)
        first = engine.step()
        assert [row.request for row in first] == [requests[1]] and len(engine.stepped_rows(2)) > 1
        assert set(engine.stepped_rows(2)) == {2}  # both rows in every step of the call
        assert first[0].result.token_ids == local_ar(CONFIG, PROMPTS[2], 12)
        (second,) = engine.step()
        assert second.result.token_ids == local_ar(CONFIG, PROMPTS[0], 30)
        assert set(engine.stepped_rows(1)) == {1}
        engine.call_s = 0.0
        engine.admit(dataclasses.replace(requests[1]))
        steps = 0
        while engine.rows:
            engine.step()
            steps += 1
            assert engine.stepped_rows(1) == [1]
        assert steps > 1


def mixed_waves_through(cluster, mode: str) -> tuple[int, int]:
    """tests/test_mixed_batches.py's waves through the cluster's batch engine, each row
    checked against AR alone in this process: (rows, SSD hits)."""
    from tests.test_mixed_batches import assert_as_alone, draw_wave, run_wave

    tokenizer = load_tokenizer(CONFIG.target)
    alone = AREngine(build_tiny_model(CONFIG.target.tiny, TORCH_DTYPES[CONFIG.target.dtype]), tokenizer)
    engine, rows, hits = cluster.batch_engine(mode), 0, 0
    try:
        for seed in range(3):
            rng, spec_rng = random.Random(seed), random.Random(-1 - seed)
            stems = [[rng.randrange(16) for _ in range(rng.randint(4, 24))] for _ in range(2)]
            for _ in range(2):
                wave = draw_wave(rng, spec_rng, mode, stems, tokenizer, 16)
                finished = run_wave(engine, wave)
                for arrival in wave:
                    done = finished[id(arrival.request)]
                    assert done.error is None, done.error
                    plain = dataclasses.replace(arrival.request, on_tokens=None, cancelled=None, speculation=None)
                    assert_as_alone(arrival.request, done.result, alone.generate(plain), 1e-4)
                    rows, hits = rows + 1, hits + done.result.stats.spec.hits
    finally:
        engine.close()
    return rows, hits


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_random_mixed_batches_through_the_cluster_equal_ar_alone(cluster, mode):
    """Sampling, processing, stops, logprobs, prompt logprobs, predictions, shared stems,
    arrivals and cancellations mixed: every row's tokens equal AR alone; log-probabilities
    to 1e-4 (this pair is fp32, whose logits move in the last bits with a forward's rows)."""
    rows, hits = mixed_waves_through(cluster, mode)
    assert rows >= 10 and (hits > 0) == (mode == "ssd")


def test_the_cluster_trials_see_a_request_that_loses_its_processing_on_the_way(cluster, monkeypatch):
    def portable(self):
        return dataclasses.replace(self, on_tokens=None, cancelled=None, on_logprobs=None, processing=None)

    monkeypatch.setattr(GenerationRequest, "portable", portable)
    with pytest.raises(AssertionError):
        mixed_waves_through(cluster, "ar")


def test_actors_run_at_the_drivers_priority(cluster):
    """Ray's raylet would start them at nice 15, so that any other busy process on
    the host took the CPU from the target and the draft first."""
    import os

    import ray

    actors = cluster.targets + [cluster.draft]
    seen = [where["niceness"] for where in ray.get([a.whereabouts.remote() for a in actors])]
    assert seen == cluster.actor_niceness == [os.nice(0)] * len(actors)


def test_ar_mode_through_the_cluster(cluster):
    spec = dataclasses.replace(CONFIG.speculation, mode="ar")
    out = cluster.generate(GenerationRequest(PROMPTS[0], GREEDY, GenerationConfig(max_new_tokens=20), spec))
    assert out.token_ids == local_ar(CONFIG, PROMPTS[0], 20)


def test_the_draft_core_joins_the_target_while_speculation_is_off(cluster):
    """k_policy K 0 at this batch size: the draft has nothing to do, so the target
    steps on both cores (two threads); a speculating request takes the draft's back."""
    import ray

    def target_cores():
        where = ray.get(cluster.targets[0].whereabouts.remote())
        return where["affinity"], where["threads"]

    off = dataclasses.replace(CONFIG.speculation, k_policy={1: 0})
    out = cluster.generate(GenerationRequest(PROMPTS[2], GREEDY, GenerationConfig(max_new_tokens=12), off))
    assert out.token_ids == local_ar(CONFIG, PROMPTS[2], 12) and out.stats.spec.lookups == 0
    assert target_cores() == ([0, 1], 2)
    on = cluster.generate(GenerationRequest(PROMPTS[2], GREEDY, GenerationConfig(max_new_tokens=12)))
    assert on.token_ids == out.token_ids and on.stats.spec.hits > 0
    assert target_cores() == ([0], 1)


def test_sampled_ssd_matches_target_through_the_cluster(cluster):
    """Joint of tokens 3-4 over 600 seeds; every token cached at every k, so
    rounds after the first are cache hits carrying q rows over gloo. The seeds
    run as rows of the target's batch (every row owns its streams: the first
    seeds, run again alone, must give the same tokens)."""
    from tests.test_distribution import run_rows

    vocab = CONFIG.target.tiny.vocab_size
    # Builds to the budget (no anytime cut, whose timing a row alone would not repeat), draft entries only.
    fanout = dataclasses.replace(CONFIG.speculation.fanout, kind="uniform", budget=3 * vocab, anytime=False)
    spec = dataclasses.replace(CONFIG.speculation, k=2, fanout=fanout, ngram_candidates=False)
    config = GenerationConfig(max_new_tokens=4)
    sampling = SamplingConfig(temperature=1.0)
    requests = [GenerationRequest([1, 2], dataclasses.replace(sampling, seed=s), config, spec) for s in range(600)]
    with cluster.batch_engine("ssd") as engine:
        outs = run_rows(engine, requests)
    for request, out in zip(requests[:12], outs):
        assert cluster.generate(request).token_ids == out.token_ids
    samples = [tuple(out.token_ids[2:4]) for out in outs]
    # The per-request spec reached the draft: with every outcome cached, every lookup hits
    # (the configured geometric budget of 8 would miss often at T = 1).
    lookups, hits = sum(o.stats.spec.lookups for o in outs), sum(o.stats.spec.hits for o in outs)
    assert lookups > 50 and hits == lookups
    target = build_tiny_model(CONFIG.target.tiny, torch.float32)
    expected = exact_marginal(target, [1, 2], 4, sampling, [2, 3])
    assert chi_square_pvalue(samples, expected) > ALPHA
    # Power: the same samples reject the draft's law (what an accept-all bug would give).
    draft = build_tiny_model(CONFIG.draft.tiny, torch.float32)
    assert chi_square_pvalue(samples, exact_marginal(draft, [1, 2], 4, sampling, [2, 3])) < ALPHA


def test_killed_draft_loses_no_request_and_comes_back(cluster, monkeypatch):
    import ray

    prompt, n = PROMPTS[0], 400
    expected = local_ar(CONFIG, prompt, n)
    rounds, killed = [], []
    # Hold the watcher's heal until the request has returned: a request that
    # waited for the heal returns only after the gate times out, heal included.
    gate, healed, heal = threading.Event(), threading.Event(), cluster.heal

    def gated_heal() -> None:
        gate.wait(timeout=30)
        heal()
        healed.set()

    monkeypatch.setattr(cluster, "heal", gated_heal)

    def kill_after_five_rounds(tokens):
        rounds.append(tokens)
        if len(rounds) == 5:  # mid-generation, for sure
            killed.append(cluster.draft_pid)
            ray.kill(cluster.draft, no_restart=False)  # Ray restarts it; the cluster re-links after

    out = cluster.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n), on_tokens=kill_after_five_rounds))
    assert not healed.is_set(), "the result waited for the heal"  # healing is not on the request's path
    gate.set()
    assert out.token_ids == expected
    assert [t for r in rounds for t in r] == expected  # nothing lost or repeated in the stream either
    assert out.stats.spec.degraded_rounds > 0, out.stats.summary()
    assert healed.wait(timeout=120) and cluster.wait_linked(timeout=120), "the draft never came back"
    assert cluster.draft_pid != killed[0]  # a new speculator process, not the killed one
    again = cluster.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
    assert again.token_ids == expected[:40]
    assert again.stats.spec.degraded_rounds == 0 and again.stats.spec.hits > 0, again.stats.summary()


def test_a_draft_killed_while_idle_is_healed_before_the_next_request(cluster):
    """The watcher notices the restarted speculator between requests; the next
    request speculates from its first round (mid-request adoption: test_ssd)."""
    import ray

    assert cluster.wait_linked(timeout=120)
    before = ray.get(cluster.draft.ready.remote())
    ray.kill(cluster.draft, no_restart=False)
    deadline = time.monotonic() + 120
    while cluster.draft_pid == before or not cluster.linked():  # healed: a new speculator, linked
        assert time.monotonic() < deadline, "the watcher did not heal the draft"
        time.sleep(0.5)
    out = cluster.generate(GenerationRequest(PROMPTS[1], GREEDY, GenerationConfig(max_new_tokens=40)))
    assert out.token_ids == local_ar(CONFIG, PROMPTS[1], 40)
    assert out.stats.spec.degraded_rounds == 0 and out.stats.spec.hits > 0, out.stats.summary()


def test_grpc_frontend_over_the_cluster_streams_and_aborts(cluster):
    from ssd.serve.client import GenerationClient
    from ssd.serve.cluster_backend import ClusterBackend
    from ssd.serve.options import ServeOptions
    from ssd.serve.server import GenerationServer

    server = GenerationServer(ServeOptions(port=0, grace_s=2.0), lambda: ClusterBackend(cluster))
    server.start()
    try:
        assert server.wait_ready(60)
        with GenerationClient(f"127.0.0.1:{server.port}") as client:
            out = client.generate(text="abcab", max_new_tokens=40, mode="ssd", timeout=60)
            ids = cluster.encode("abcab")
            assert out.token_ids == local_ar(CONFIG, ids, 40) and out.finish_reason == "length"
            assert len(out.rounds) > 1  # streamed round by round, not in one piece
            stream = client.stream(text="abcab", max_new_tokens=400, mode="ssd", timeout=60)
            messages = iter(stream)
            head = [next(messages)]  # accepted
            while not head[-1].token_ids:  # running (a batched row), not merely queued
                head.append(next(messages))
            assert client.abort(head[0].request_id)
            rest = list(messages)
            # A protobuf field is never None: check what the final message carries.
            finished, streamed = rest[-1].finished, [t for m in [*head, *rest] for t in m.token_ids]
            assert finished.reason == 4 and finished.HasField("stats")  # ABORTED, with the request's stats
            assert list(finished.output_token_ids) == streamed and finished.stats.new_tokens == len(streamed)
            assert len(streamed) < 400 and finished.stats.mode == 3
    finally:
        server.stop()


def test_ar_requests_batch_on_the_target_through_the_grpc_frontend(cluster):
    """Four clients at once: the server's scheduler drives a batch engine on
    target rank 0 (one Ray call per step); each gets its own AR output."""
    from concurrent.futures import ThreadPoolExecutor

    from ssd.serve.client import GenerationClient
    from ssd.serve.cluster_backend import ClusterBackend
    from ssd.serve.options import ServeOptions
    from ssd.serve.server import GenerationServer

    server = GenerationServer(ServeOptions(port=0, grace_s=2.0), lambda: ClusterBackend(cluster))
    server.start()
    texts = ["abcab", "ponm", "aaaabbbb", "mnop"]
    try:
        assert server.wait_ready(60)
        with GenerationClient(f"127.0.0.1:{server.port}") as client, ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda t: client.generate(text=t, max_new_tokens=30, mode="ar", timeout=120), texts))
        batch_sizes = server.metrics.snapshot().batch
    finally:
        server.stop()
    for text, out in zip(texts, outs):
        assert out.token_ids == local_ar(CONFIG, cluster.encode(text), 30) and out.finish_reason == "length"
    assert batch_sizes.n > 0 and batch_sizes.total / batch_sizes.n > 1.5, batch_sizes  # rows ran together


def test_openai_http_api_over_the_cluster(cluster):
    """launch/cluster.py --http-port: the OpenAI API over the actors (ssd.openai). SSD greedy
    == AR; logprobs come back with the result (in the stream's last chunk) and match the whole response's."""
    from ssd.serve.cluster_backend import ClusterBackend
    from tests.test_http import PROMPT, complete, oai, serving

    with serving(lambda: ClusterBackend(cluster)) as server:
        client = oai(server)
        whole = complete(client, False, False, max_tokens=30, temperature=0, logprobs=1)
        streamed = complete(client, False, True, max_tokens=30, temperature=0, logprobs=1,
                            stream_options={"include_usage": True})
        # A grammar llguidance refuses at its third token (tests/test_openai_api.py's LATE_FAILURE,
        # spelled in a..p): the target's actor fails that row, and the client gets a 400 naming it.
        rest = " | ".join('"c' + "".join(word) + '"' for word in itertools.islice(
            itertools.product("abcdefghijklmnop", repeat=3), 3001))
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                      logit_bias={str(cluster.encode("c")[0]): 100},
                                      extra_body={"structured_outputs": {"grammar": f"start: /ab+/ rest\nrest: {rest}"}})
        assert info.value.body["param"] == "structured_outputs.grammar" and "items" in info.value.body["message"]
    want = local_ar(CONFIG, cluster.encode(PROMPT), 30)
    assert whole["text"] == streamed["text"] == load_tokenizer(CONFIG.target).decode(want)
    assert [t for t, _, _ in whole["logprobs"]] == list(whole["text"])
    # The same tokens and log-probabilities; the values to fp32 rounding only: an anytime build's
    # length depends on timing, and a verification's logits on how many rows it scores.
    assert [(t, top.keys()) for t, _, top in whole["logprobs"]] == [(t, top.keys()) for t, _, top in streamed["logprobs"]]
    for (_, a, _), (_, b, _) in zip(whole["logprobs"], streamed["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)
    assert whole["stats"]["mode"] == "ssd" and streamed["usage"].completion_tokens == 30


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cpu", "--target-cores", "0", "--draft-core", "0"], "overlap"),
        (["--cpu", "--target-cores", "0-5"], "machine has"),
        (["--cpu", "--target-cores", "3-1"], "backwards"),
        (["--cpu", "--draft-core", "x"], "not a device list"),
        (["--target-gpus", "0", "--draft-gpu", "1"], "need GPUs"),
        (["--cpu", "--replicas", "0"], "cluster.replicas (--replicas) must be an integer >= 1, got 0"),
        (["--cpu", "--draft-node", " "], "cluster.draft_node must name a node"),
        (["--cpu", "--batch-concurrency", "0"], "serve.batch_concurrency must be in 1..max_queue"),
    ],
)
def test_launcher_argument_errors(args, message):
    """Refused before Ray starts, with a message naming the problem (in-process:
    the SIGTERM test below runs launch/cluster.py itself)."""
    from ssd.app.launcher import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert message in str(exit_.value.code)


def test_launcher_rejects_unknown_config_keys(tmp_path):
    from ssd.app.launcher import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("speculation: {fan_out: 3}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--cpu", "--config", str(bad)])
    assert "fan_out" in str(exit_.value.code)


def test_sigterm_drains_the_running_request_and_leaves_no_process_behind():
    """launch/cluster.py serving, a request streaming, SIGTERM and then SIGINT: the stream
    gets its final message, the launcher exits 0, and every process it started is gone."""
    import signal

    import grpc
    import psutil

    from ssd.cluster.workers import free_port
    from ssd.serve.client import GenerationClient

    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "cluster.py"), "--cpu", "--config", str(ROOT / "configs" / "tiny-cluster.yaml"),
         "--port", str(port), "--grace-s", "30"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        with GenerationClient(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if client.health(timeout=2) == "SERVING":
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline and launcher.poll() is None, "the launcher never served"
                time.sleep(0.5)
            started = psutil.Process(launcher.pid).children(recursive=True)
            stream = client.stream(text="abcab", max_new_tokens=500, timeout=120)
            first = next(stream)
            launcher.send_signal(signal.SIGTERM)
            second = next(stream)
            launcher.send_signal(signal.SIGINT)  # a second signal (Ctrl-C) must not cut the drain short
            messages = [first, second, *stream]
        assert messages[-1].HasField("finished") and messages[-1].finished.reason == 2  # LENGTH: drained, not cut
        assert sum(len(m.token_ids) for m in messages) == 500
        assert launcher.wait(timeout=120) == 0, launcher.stderr.read()[-3000:]
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_actors_send_ray_no_task_events():
    """Ray's GCS keeps an event record of every actor call (up to 100,000 by default): a
    serving cluster's GCS grew 14-15 MB per 1000 requests on the tiny pair with them, and
    held at 47-49 MB without (docs/cluster.md). Nothing here reads them."""
    from ssd.cluster.actors import RemoteDraft, RemoteTarget

    for actor in (RemoteTarget, RemoteDraft):
        assert actor._default_options["enable_task_events"] is False
