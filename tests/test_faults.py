"""Fault injection through the whole stack: gRPC server, cluster, Ray actors, gloo link.

A seeded plan kills the speculator or the target rank (SIGKILL, as the OOM
killer or a crashed driver would) at a random round of a streaming request,
or while idle. A thread polls gRPC health throughout. Checked at every fault:
- draft killed: the request finishes with the output it would have had (its
  greedy AR output), health stays SERVING (the service runs degraded), and the
  draft is linked again in the background;
- target killed mid-stream: the RPC ends UNAVAILABLE after a prefix of the
  right output, health goes NOT_SERVING and back to SERVING, and the request
  run again gives the right output;
- target killed while idle: NOT_SERVING, then SERVING, then right output.
At the end every process the cluster started (and restarted) is gone.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import grpc
import pytest

from ssd.cluster.devices import plan_placement
from ssd.cluster.runtime import Cluster
from ssd.config import load_config
from tests.conftest import ROOT
from tests.test_cluster import local_ar

pytestmark = pytest.mark.cluster

CONFIG = load_config(ROOT / "configs" / "tiny-cluster.yaml")
SEED = 13
FAULTS = 6
NEW_TOKENS = 150
RECOVERY_S = 120.0
FINISH_REASON_ERROR = 5


class HealthLog:
    """Polls gRPC health every 50 ms in a thread: (time, status) on every change."""

    def __init__(self, client) -> None:
        self.client = client
        self.changes: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            try:
                status = self.client.health(timeout=2)
            except grpc.RpcError as exc:
                status = f"error {exc.code().name}"
            if not self.changes or self.changes[-1][1] != status:
                self.changes.append((time.monotonic(), status))

    def since(self, t: float) -> list[str]:
        """Statuses seen from time t on (the one in force at t first)."""
        before = [s for at, s in self.changes if at <= t][-1:]
        return before + [s for at, s in self.changes if at > t]

    def wait_serving_after(self, t: float, timeout: float) -> float:
        """Seconds from t until health reads SERVING again after going down."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = [(at, s) for at, s in self.changes if at > t]
            down = next((i for i, (_, s) in enumerate(statuses) if s != "SERVING"), None)
            if down is not None:
                back = next((at for at, s in statuses[down:] if s == "SERVING"), None)
                if back is not None:
                    return back - t
            time.sleep(0.05)
        raise AssertionError(f"health did not come back: {self.since(t)}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def stack(own_ray):
    import ray

    from ssd.serve.client import GenerationClient
    from ssd.serve.cluster_backend import ClusterBackend
    from ssd.serve.options import ServeOptions
    from ssd.serve.server import GenerationServer

    cluster = Cluster(CONFIG, plan_placement("0", "1", 2, "cpu"))
    server = GenerationServer(ServeOptions(port=0, grace_s=2.0), lambda: ClusterBackend(cluster))
    server.start()
    client = GenerationClient(f"127.0.0.1:{server.port}")
    pids: set[int] = set()
    try:
        assert server.wait_ready(60)
        health = HealthLog(client)
        yield cluster, client, health, pids
        health.stop()
    finally:
        client.close()
        server.stop()
        pids |= actor_pids(cluster)
        cluster.shutdown()
        assert not ray.is_initialized()
    assert_gone(pids)


def actor_pids(cluster: Cluster) -> set[int]:
    import ray

    try:
        return set(ray.get([a.ready.remote() for a in [*cluster.targets, cluster.draft]], timeout=30))
    except Exception:  # noqa: BLE001 - a dead actor has no pid to collect
        return set()


def assert_gone(pids: set[int]) -> None:
    import psutil

    deadline = time.monotonic() + 30
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, f"processes left behind: {alive}"


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def fault_plan(seed: int, n: int) -> list[tuple[str, int | None]]:
    """(role, round) pairs: round None kills while idle. Both roles, both timings, shuffled."""
    rng = random.Random(seed)
    plan = [("draft", rng.randint(2, 12)), ("target", rng.randint(2, 12)), ("target", None), ("draft", None)]
    plan += [(rng.choice(["draft", "target"]), rng.choice([None, rng.randint(1, 15)])) for _ in range(n - len(plan))]
    rng.shuffle(plan)
    return plan


def test_killed_workers_lose_no_request_and_health_tells_the_truth(stack):
    import ray

    cluster, client, health, pids = stack
    prompt = cluster.encode(CONFIG.prompt)
    expected = local_ar(CONFIG, prompt, NEW_TOKENS)
    for role, at_round in fault_plan(SEED, FAULTS):
        wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
        pids |= actor_pids(cluster)
        actor = cluster.targets[0] if role == "target" else cluster.draft
        pid = ray.get(actor.ready.remote())
        if at_round is None:
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            if role == "target":
                health.wait_serving_after(killed, RECOVERY_S)
        else:
            killed = stream_and_kill(client, pid, at_round, role, expected)
            assert_health_after(health, role, killed)
        out = client.generate(text=CONFIG.prompt, max_new_tokens=NEW_TOKENS, timeout=RECOVERY_S)
        assert out.token_ids == expected, (role, at_round)
    assert cluster.target_restarts == sum(role == "target" for role, _ in fault_plan(SEED, FAULTS))


def stream_and_kill(client, pid: int, at_round: int, role: str, expected: list[int]) -> float:
    """Stream the request, SIGKILL `pid` after `at_round` token messages; check what the client got."""
    streamed: list[int] = []
    killed = None
    stream = client.stream(text=CONFIG.prompt, max_new_tokens=NEW_TOKENS, timeout=RECOVERY_S)
    try:
        for message in stream:
            streamed.extend(message.token_ids)
            if message.token_ids:
                at_round -= 1
                if at_round == 0 and killed is None:
                    killed = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
            if message.HasField("finished") and role == "draft":
                assert list(message.finished.output_token_ids) == expected
            elif message.HasField("finished"):  # the final message says why, then the status
                assert message.finished.reason == FINISH_REASON_ERROR and "retry" in message.finished.error
        assert killed is not None, "the request finished before the planned round"
    except grpc.RpcError as exc:
        assert role == "target", f"a killed draft failed the request: {exc}"
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert "retry" in exc.details()
    assert streamed == expected[: len(streamed)], "the stream carried wrong tokens"
    if role == "draft":
        assert streamed == expected
    return killed


def assert_health_after(health: HealthLog, role: str, killed: float) -> None:
    if role == "target":
        health.wait_serving_after(killed, RECOVERY_S)
        assert "NOT_SERVING" in health.since(killed)
    else:
        time.sleep(0.3)  # let the poller see whatever followed the request
        assert set(health.since(killed)) == {"SERVING"}, "a lost draft must not take the service down"


def test_a_request_that_streamed_nothing_runs_again_once_the_target_is_back(stack, monkeypatch):
    """Killed before the request reached it: the request waits for the restart
    and runs from its prompt, invisible to the caller but for the delay."""
    import ray

    from ssd.cluster.batch import RemoteBatchEngine
    from ssd.config import GenerationConfig, SamplingConfig
    from ssd.engine.request import GenerationRequest

    cluster, _, health, pids = stack
    wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
    pids |= actor_pids(cluster)
    prompt = cluster.encode(CONFIG.prompt)
    killed = ray.get(cluster.targets[0].ready.remote())
    restarts, send = cluster.target_restarts, RemoteBatchEngine._send
    runs: list[int] = []  # the target restarts seen by each attempt to admit the request

    def send_after_a_kill(engine, method, *args):
        # The kill lands just before the first admission, so that attempt always
        # meets the dead target (the watcher cannot have restarted it yet).
        if method == "batch_admit":
            cluster.wait_serving()  # as the send does: the attempts after the kill wait for the restart
            if not runs:
                os.kill(killed, signal.SIGKILL)
            runs.append(cluster.target_restarts - restarts)
        return send(engine, method, *args)

    monkeypatch.setattr(RemoteBatchEngine, "_send", send_after_a_kill)
    out = cluster.generate(GenerationRequest(prompt, SamplingConfig(), GenerationConfig(max_new_tokens=40)))
    assert out.token_ids == local_ar(CONFIG, prompt, 40)
    assert runs == [0, 1], "the request must run once more, after the restart, and only then"
    assert cluster.serving and ray.get(cluster.targets[0].ready.remote()) != killed


def run_through_a_kill(stack, streams: bool, watcher_first: bool, sampling) -> tuple[list[int], int]:
    """A request through the cluster whose target is SIGKILLed once it has produced 5 tokens:
    (its tokens, how many its on_tokens saw). `watcher_first`: the kill lands between
    two step calls and the watcher restarts the target before the next one (as when another
    engine's call, or the watcher's ping, finds it gone first); else the next step call finds
    it dead. A request that never ends is aborted after RECOVERY_S (an assertion, not a hang)."""
    import ray

    from ssd.config import GenerationConfig
    from ssd.engine.request import GenerationRequest

    cluster, _, _, pids = stack
    wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
    pids.update(actor_pids(cluster))
    pid, restarts, seen, killed = ray.get(cluster.targets[0].ready.remote()), cluster.target_restarts, [], []
    deadline = time.monotonic() + RECOVERY_S

    def kill_after_five(tokens: list[int]) -> None:
        seen.extend(tokens)
        if len(seen) >= 5 and not killed:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
            if watcher_first:
                wait_until(lambda: cluster.target_restarts > restarts, RECOVERY_S, "the watcher did not restart it")

    request = GenerationRequest(cluster.encode("ponm"), sampling, GenerationConfig(max_new_tokens=NEW_TOKENS), on_tokens=kill_after_five,
                                cancelled=lambda: time.monotonic() > deadline, streams=streams)
    out = cluster.generate(request)
    assert out.finish_reason != "aborted", "the request never ended: its rows were lost with the target"
    return out.token_ids, len(seen)


@pytest.mark.parametrize("watcher_first, temperature", [(False, 0.0), (True, 1.0)],
                         ids=["next-call-finds-it-greedy", "watcher-restarts-it-first-coupled-sampling"])
def test_a_request_whose_client_waits_for_the_result_runs_again_after_a_mid_run_kill(stack, watcher_first,
                                                                                     temperature):
    """OpenAI's stream: false (GenerationRequest.streams False): killed after producing tokens
    nobody saw, the row runs again from its prompt and returns what it returns unkilled: AR's
    output (greedy), or, sampled under a seed with coupling, the same sample. A streamed
    request under the same kill fails UNAVAILABLE (its client saw a prefix a re-run need not
    reproduce), so the flag is what saves the first; and neither is left running forever on a
    target that never held it (watcher-restarts-it-first hung before)."""
    from ssd.config import GenerationConfig, SamplingConfig
    from ssd.engine.request import GenerationRequest, GeneratorUnavailable

    cluster = stack[0]
    sampling = SamplingConfig(temperature=temperature, seed=7, coupling="gumbel")
    out, seen = run_through_a_kill(stack, streams=False, watcher_first=watcher_first, sampling=sampling)
    unkilled = cluster.generate(GenerationRequest(cluster.encode("ponm"), sampling,
                                                  GenerationConfig(max_new_tokens=NEW_TOKENS))).token_ids
    assert out == unkilled
    if temperature == 0:
        assert out == local_ar(CONFIG, cluster.encode("ponm"), NEW_TOKENS)
    assert seen > NEW_TOKENS, "it ran again from its prompt: its tokens came twice"
    with pytest.raises(GeneratorUnavailable, match="retry the request"):
        run_through_a_kill(stack, streams=True, watcher_first=watcher_first, sampling=sampling)


def test_a_target_killed_mid_batch_fails_every_row_unavailable_and_comes_back(stack):
    """AR rows batched on the target: the kill fails every row UNAVAILABLE after
    a right prefix; once SERVING again, a new batch gives the right outputs."""
    import ray
    from concurrent.futures import ThreadPoolExecutor

    cluster, client, health, pids = stack
    wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
    pids |= actor_pids(cluster)
    texts = ["abcab", "ponm", "aaaabbbb"]
    expected = {t: local_ar(CONFIG, cluster.encode(t), 400) for t in texts}
    pid = ray.get(cluster.targets[0].ready.remote())
    started = threading.Barrier(len(texts))
    killed: list[float] = []

    def stream(text: str) -> tuple[list[int], grpc.StatusCode | None]:
        tokens: list[int] = []
        try:
            for message in client.stream(text=text, max_new_tokens=400, mode="ar", timeout=RECOVERY_S):
                tokens.extend(message.token_ids)
                if len(tokens) >= 5 and not killed:
                    started.wait(timeout=60)  # every row is running
                    if not killed:
                        killed.append(time.monotonic())
                        os.kill(pid, signal.SIGKILL)
        except grpc.RpcError as exc:
            return tokens, exc.code()
        return tokens, None

    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(stream, texts))
    for text, (tokens, code) in zip(texts, results):
        assert code == grpc.StatusCode.UNAVAILABLE, (text, code)
        assert tokens == expected[text][: len(tokens)]
    health.wait_serving_after(killed[0], RECOVERY_S)
    with ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(lambda t: client.generate(text=t, max_new_tokens=40, mode="ar", timeout=RECOVERY_S), texts))
    assert [o.token_ids for o in outs] == [expected[t][:40] for t in texts]


def test_a_draft_killed_mid_batch_loses_no_row(stack):
    """SSD rows batched on the target: the draft dies, every row finishes with its
    own right output (degraded meanwhile), health stays SERVING, the draft heals."""
    import ray
    from concurrent.futures import ThreadPoolExecutor

    cluster, client, health, pids = stack
    wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
    pids |= actor_pids(cluster)
    texts = ["abcab", "ponm", "aaaabbbb"]
    expected = {t: local_ar(CONFIG, cluster.encode(t), NEW_TOKENS) for t in texts}
    pid = ray.get(cluster.draft.ready.remote())
    started = threading.Barrier(len(texts))
    killed: list[float] = []

    def stream(text: str):
        out = client.generate(text=text, max_new_tokens=NEW_TOKENS, mode="ssd", timeout=RECOVERY_S,
                              on_message=lambda m: kill_once(m))
        return out

    def kill_once(message) -> None:
        if message.token_ids and not killed:
            started.wait(timeout=60)  # every row is running
            if not killed:
                killed.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)

    with ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(stream, texts))
    assert [o.token_ids for o in outs] == [expected[t] for t in texts]
    assert any(o.stats.spec.degraded_rounds > 0 for o in outs)  # the kill landed mid-batch
    time.sleep(0.3)
    assert set(health.since(killed[0])) == {"SERVING"}
    wait_until(lambda: cluster.linked(), RECOVERY_S, "the draft did not heal")


def test_a_warm_standby_takes_over_a_killed_target_within_seconds(stack):
    """cluster.warm_standby: the module's cluster given a standby now (cheaper than a
    cluster of its own). SIGKILL the idle target: health is SERVING again within 5 s,
    the standby's process is the target, greedy output is still AR's."""
    import ray

    cluster, client, health, pids = stack
    wait_until(lambda: cluster.serving and cluster.linked(), RECOVERY_S, "the cluster did not settle")
    cluster.config = dataclasses.replace(cluster.config,
                                         cluster=dataclasses.replace(cluster.config.cluster, warm_standby=True))
    cluster._start_standby()
    standby = ray.get(cluster._standby.ready.remote())
    pids |= actor_pids(cluster) | {standby}
    killed = time.monotonic()
    os.kill(ray.get(cluster.targets[0].ready.remote()), signal.SIGKILL)
    assert health.wait_serving_after(killed, RECOVERY_S) < 5.0, health.since(killed)
    assert ray.get(cluster.targets[0].ready.remote()) == standby
    out = client.generate(text=CONFIG.prompt, max_new_tokens=40, timeout=RECOVERY_S)
    assert out.token_ids == local_ar(CONFIG, cluster.encode(CONFIG.prompt), 40)
    # A new standby now loads in the background (not waited for here: launch/recovery.py's
    # second --warm-standby trial is taken over by it); shutdown stops it.
