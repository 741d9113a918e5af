"""Continuous batching through the wire, and the Prometheus /metrics endpoint.

A real gRPC server on loopback over a fake Engine (the batched engines
are built elsewhere): every row's tokens are a function of its seed, so each
client can check it got exactly its own stream while the rows share steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ssd.config import ConfigError, load_config
from ssd.engine.batch import Engine, Finished
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest, GenerationResult
from ssd.models import load_tokenizer
from ssd.serve.backend import TokenizerMixin, backend_info
from ssd.serve.client import GenerationClient
from ssd.serve.options import ServeOptions
from tests.conftest import ROOT
from tests.test_serve import PROMPT, code_of, running, wait_until

ABORTED, ERROR = 4, 5  # ssd.v1.FinishReason


def expected(seed: int, n: int) -> list[int]:
    """The fake's tokens for a row: distinct per seed, ids the tiny tokenizer decodes."""
    return [(seed * 5 + i) % 16 for i in range(n)]


@dataclass
class EngineLog:
    """What the fake engines saw, shared by all of one backend's engines."""

    steps: list[tuple[str, int, bool]] = field(default_factory=list)  # (mode, rows, held by the gate)
    admitted: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def max_rows(self, mode: str) -> int:
        return max((rows for m, rows, _ in self.steps if m == mode), default=0)


@dataclass
class Row:
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)


class FakeBatchEngine(Engine):
    """One token per row per step. A request id starting with "fail" fails its row
    after two tokens; one starting with "crash" makes the whole step raise."""

    def __init__(self, mode: str, backend: FakeBackend) -> None:
        self.mode = mode
        self.backend = backend
        self.log = backend.log
        self._rows: list[Row] = []

    @property
    def rows(self) -> int:
        return len(self._rows)

    def can_admit(self, request: GenerationRequest) -> bool:
        return len(self._rows) < (1 if self.mode in self.backend.one_row else self.backend.max_rows)

    def admit(self, request: GenerationRequest) -> None:
        self.log.admitted.append(request.request_id)
        self._rows.append(Row(request))

    def step(self) -> list[Finished]:
        held = self.backend.gate is not None and not self.backend.gate.is_set()
        self.log.steps.append((self.mode, len(self._rows), held))
        finished = [self._leave(row, "aborted") for row in list(self._rows) if row.request.is_cancelled()]
        if held:
            time.sleep(0.005)  # held: rows wait, cancels still land
            return finished
        time.sleep(self.backend.step_delay_s)
        if any(row.request.request_id.startswith("crash") for row in self._rows):
            raise RuntimeError("injected step fault")
        for row in list(self._rows):
            finished += self._advance(row)
        return finished

    def _advance(self, row: Row) -> list[Finished]:
        request = row.request
        if request.request_id.startswith("fail") and len(row.tokens) >= 2:
            self._rows.remove(row)
            return [Finished(request, None, RuntimeError("injected row fault"))]
        token = expected(request.sampling.seed, len(row.tokens) + 1)[-1]
        row.tokens.append(token)
        request.emit([token])
        if len(row.tokens) < request.generation.max_new_tokens:
            return []
        return [self._leave(row, "length")]

    def _leave(self, row: Row, reason: str) -> Finished:
        self._rows.remove(row)
        if reason == "aborted":
            self.log.aborted.append(row.request.request_id)
        return Finished(row.request, self.backend.result(row.request, row.tokens, reason, self.mode))

    def close(self) -> None:
        self.log.closed.append(self.mode)


class FakeBackend(TokenizerMixin):
    """The tiny tokenizer and info; a fake batch engine per mode, those in `one_row` held at one row."""

    def __init__(self, max_rows: int = 8, step_delay_s: float = 0.0, gate: threading.Event | None = None,
                 one_row: tuple[str, ...] = ()) -> None:
        config = load_config(ROOT / "configs" / "tiny.yaml")
        self.tokenizer = load_tokenizer(config.target)
        self.info = backend_info(config, self.tokenizer, modes=("ar", "sd", "ssd"), max_context_tokens=512,
                                 eos_token_ids=())
        self.max_rows, self.step_delay_s, self.gate, self.one_row = max_rows, step_delay_s, gate, one_row
        self.log = EngineLog()

    def batch_engine(self, mode: str) -> FakeBatchEngine:
        return FakeBatchEngine(mode, self)

    def result(self, request: GenerationRequest, tokens: list[int], reason: str, mode: str) -> GenerationResult:
        stats = GenerationStats(mode=mode, prompt_tokens=len(request.prompt_ids), new_tokens=len(tokens),
                                rounds=max(len(tokens) - 1, 0))
        return GenerationResult(list(tokens), self.decode(tokens), reason, stats)

    def close(self) -> None:
        pass


def stream_all(server: Any, results: dict[Any, Any], key: Any, **request: Any) -> threading.Thread:
    """A client on its own channel running one request to its end, in a thread."""
    def run() -> None:
        with GenerationClient(f"127.0.0.1:{server.port}") as own:
            try:
                results[key] = own.generate(text=PROMPT, timeout=60, **request)
            except grpc.RpcError as exc:
                results[key] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def counts(client: GenerationClient) -> tuple[int, int]:
    stats = client.stats()
    return stats.requests_running, stats.requests_waiting


def assert_own_tokens(out: Any, seed: int, n: int) -> None:
    want = expected(seed, n)
    assert out.finish_reason == "length", (seed, out.finish_reason)
    assert out.token_ids == list(out.finished.output_token_ids) == want, seed
    assert out.rounds == [[t] for t in want]  # one message per step, only this row's token
    assert out.text == out.finished.output_text == "".join("abcdefghijklmnop"[t] for t in want)


# --- continuous batching --------------------------------------------------------


def test_eight_streams_run_together_each_gets_its_own_tokens():
    fake = FakeBackend(gate=threading.Event())
    with running(lambda: fake) as (server, client):
        results: dict[int, Any] = {}
        threads = [stream_all(server, results, seed, mode="ar", seed=seed, max_new_tokens=12) for seed in range(8)]
        assert wait_until(lambda: counts(client) == (8, 0), timeout=20), counts(client)
        fake.gate.set()
        for thread in threads:
            thread.join(60)
        assert sorted(results) == list(range(8))
        for seed, out in results.items():
            assert_own_tokens(out, seed, 12)
    assert fake.log.max_rows("ar") == 8
    assert fake.log.closed == ["ar"]  # the worker closes what it made


def test_rows_limit_admits_in_arrival_order():
    fake = FakeBackend(max_rows=3, gate=threading.Event())
    with running(lambda: fake) as (_, client):
        calls = []
        for i in range(8):
            call = client.stream(text=PROMPT, mode="sd", seed=i, max_new_tokens=6, request_id=f"r{i}")
            assert next(call).accepted.queued_ahead == i
            calls.append(call)
        assert wait_until(lambda: counts(client) == (3, 5))
        fake.gate.set()
        outs = [list(call) for call in calls]
    assert fake.log.admitted == [f"r{i}" for i in range(8)]
    assert fake.log.max_rows("sd") == 3
    for i, messages in enumerate(outs):
        assert [m.token_ids[0] for m in messages if m.token_ids] == expected(i, 6)


def test_priority_orders_the_queue_and_ties_keep_arrival_order():
    """vLLM's priority: a lower value is admitted sooner; equal ones in arrival order."""
    fake = FakeBackend(max_rows=1, gate=threading.Event())
    with running(lambda: fake) as (_, client):
        calls = []
        for name, priority in (("r0", 0), ("r1", 5), ("r2", 0), ("r3", -1), ("r4", 0)):
            calls.append(client.stream(text=PROMPT, mode="ar", seed=len(calls), max_new_tokens=3, request_id=name,
                                       priority=priority))
            next(calls[-1])
        assert wait_until(lambda: counts(client) == (1, 4))
        fake.gate.set()
        for seed, call in enumerate(calls):
            assert [m.token_ids[0] for m in call if m.token_ids] == expected(seed, 3)
    assert fake.log.admitted == ["r0", "r3", "r2", "r4", "r1"]


def test_a_head_that_does_not_fit_holds_back_other_modes():
    """FIFO across modes: sd has room, but the sd request arrived after an ar one
    that waits for an ar row, so it waits too (nothing is overtaken forever)."""
    fake = FakeBackend(max_rows=1, gate=threading.Event())
    with running(lambda: fake) as (_, client):
        calls = []
        for seed, name in enumerate(("ar-0", "ar-1", "sd-2")):
            calls.append(client.stream(text=PROMPT, mode=name[:2], seed=seed, max_new_tokens=4, request_id=name))
            next(calls[-1])
        assert wait_until(lambda: counts(client) == (1, 2))
        time.sleep(0.05)  # rounds pass; still nobody overtakes
        assert counts(client) == (1, 2) and fake.log.admitted == ["ar-0"]
        fake.gate.set()
        for seed, call in enumerate(calls):
            assert [m.token_ids[0] for m in call if m.token_ids] == expected(seed, 4)
    assert fake.log.admitted == ["ar-0", "ar-1", "sd-2"]


def test_cancelled_and_expired_rows_leave_without_disturbing_others():
    fake = FakeBackend(step_delay_s=0.02)
    with running(lambda: fake) as (server, client):
        results: dict[str, Any] = {}
        keeper = stream_all(server, results, "keep", mode="ar", seed=3, max_new_tokens=60)
        late = stream_all(server, results, "late", mode="ar", seed=4, max_new_tokens=400, request_id="late")
        call = client.stream(text=PROMPT, mode="ar", seed=5, max_new_tokens=400, request_id="gone")
        got = [next(call) for _ in range(4)]  # accepted, then three rounds
        call.cancel()
        # The deadline is set after the rows share steps, so it runs out mid-batch.
        results["expired"] = code_of(lambda: client.generate(text=PROMPT, mode="ar", seed=6, max_new_tokens=400,
                                                               timeout=0.4, request_id="expired"))
        assert client.abort("late")
        keeper.join(30)
        late.join(30)
        assert_own_tokens(results["keep"], 3, 60)
        assert [m.token_ids[0] for m in got[1:]] == expected(5, 3)
        assert results["expired"][0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert results["late"].finish_reason == "aborted"
        assert wait_until(lambda: client.stats().finished_by_reason["aborted"] == 3)
    assert {"gone", "expired", "late"} <= set(fake.log.aborted)
    assert fake.log.max_rows("ar") >= 3


def test_failing_row_is_internal_while_the_others_finish():
    fake = FakeBackend(gate=threading.Event())
    with running(lambda: fake) as (server, client):
        results: dict[str, Any] = {}
        threads = [stream_all(server, results, name, mode="ar", seed=seed, max_new_tokens=20, request_id=name)
                   for seed, name in enumerate(("ok-0", "fail-1", "ok-2"))]
        assert wait_until(lambda: counts(client) == (3, 0))
        fake.gate.set()
        for thread in threads:
            thread.join(30)
        failed = results["fail-1"]
        assert failed.code() == grpc.StatusCode.INTERNAL and "injected row fault" in failed.details()
        assert_own_tokens(results["ok-0"], 0, 20)
        assert_own_tokens(results["ok-2"], 2, 20)
        messages = []
        with pytest.raises(grpc.RpcError):
            for message in client.stream(text=PROMPT, mode="ar", seed=1, max_new_tokens=9, request_id="fail-again"):
                messages.append(message)
        assert [m.token_ids[0] for m in messages if m.token_ids] == expected(1, 2)
        assert messages[-1].finished.reason == ERROR and "injected row fault" in messages[-1].finished.error
        assert client.health() == "SERVING"
        assert client.stats().finished_by_reason["error"] == 2


def test_failing_step_fails_its_rows_and_the_mode_gets_a_fresh_engine():
    fake = FakeBackend(gate=threading.Event())
    with running(lambda: fake) as (server, client):
        results: dict[str, Any] = {}
        threads = [stream_all(server, results, name, mode="sd", seed=1, max_new_tokens=5, request_id=name)
                   for name in ("crash-0", "bystander")]
        assert wait_until(lambda: counts(client) == (2, 0))
        fake.gate.set()
        for thread in threads:
            thread.join(30)
        assert all(results[n].code() == grpc.StatusCode.INTERNAL for n in ("crash-0", "bystander"))
        assert fake.log.closed == ["sd"]
        assert_own_tokens(client.generate(text=PROMPT, mode="sd", seed=2, max_new_tokens=5), 2, 5)


def test_queue_full_is_resource_exhausted_with_rows_running():
    fake = FakeBackend(gate=threading.Event())
    with running(lambda: fake, max_queue=3) as (_, client):
        calls = [client.stream(text=PROMPT, mode="ar", seed=i, max_new_tokens=400) for i in range(3)]
        for call in calls:
            next(call)
        assert wait_until(lambda: counts(client) == (3, 0))
        code, details = code_of(lambda: next(client.stream(text=PROMPT, mode="ar")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 3" in details
        for call in calls:
            call.cancel()
        assert wait_until(lambda: counts(client) == (0, 0))
        fake.gate.set()
        assert_own_tokens(client.generate(text=PROMPT, mode="ar", seed=7, max_new_tokens=4), 7, 4)
        assert client.stats().requests_rejected == 1


def test_abort_stops_one_batched_row():
    fake = FakeBackend(step_delay_s=0.02)
    with running(lambda: fake) as (server, client):
        results: dict[str, Any] = {}
        keeper = stream_all(server, results, "keep", mode="sd", seed=2, max_new_tokens=40)
        call = client.stream(text=PROMPT, mode="sd", seed=9, max_new_tokens=400, request_id="drop")
        got = [next(call) for _ in range(4)]
        assert client.abort("drop")
        rest = list(call)
        keeper.join(30)
        assert rest[-1].finished.reason == ABORTED
        streamed = [m.token_ids[0] for m in got[1:] + rest if m.token_ids]
        assert 3 <= len(streamed) < 400 and streamed == expected(9, len(streamed))
        assert list(rest[-1].finished.output_token_ids) == streamed
        assert_own_tokens(results["keep"], 2, 40)
        assert not client.abort("drop")  # it is gone
    assert fake.log.aborted == ["drop"]


def test_shutdown_with_grace_drains_running_rows():
    fake = FakeBackend(step_delay_s=0.01, gate=threading.Event())
    with running(lambda: fake) as (server, client):
        results: dict[int, Any] = {}
        threads = [stream_all(server, results, seed, mode="ar", seed=seed, max_new_tokens=25) for seed in range(4)]
        assert wait_until(lambda: counts(client) == (4, 0))
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 10})
        stopper.start()
        assert wait_until(lambda: client.health() == "NOT_SERVING")
        assert code_of(lambda: client.generate(text=PROMPT))[0] == grpc.StatusCode.UNAVAILABLE
        fake.gate.set()  # the rows start only once shutdown has begun
        for thread in threads:
            thread.join(30)
        stopper.join(15)
        assert not stopper.is_alive()
        for seed, out in results.items():
            assert_own_tokens(out, seed, 25)
    assert sorted(results) == list(range(4)) and fake.log.aborted == [] and fake.log.closed == ["ar"]


def test_modes_take_turns_and_a_one_row_mode_runs_its_requests_one_at_a_time():
    """A mode held at one row (batching.max_rows 1)
    takes the one path too: its requests queue for the row, and it steps in turn."""
    fake = FakeBackend(gate=threading.Event(), one_row=("ssd",))
    with running(lambda: fake) as (server, client):
        calls = {name: client.stream(text=PROMPT, mode=name[:2], seed=seed, max_new_tokens=8, request_id=name)
                 for seed, name in enumerate(("ar-0", "sd-1", "ar-2", "sd-3"))}
        for call in calls.values():
            next(call)
        results: dict[int, Any] = {}
        threads = [stream_all(server, results, seed, mode="ssd", seed=seed, max_new_tokens=8) for seed in (4, 5)]
        assert wait_until(lambda: counts(client) == (5, 1)), counts(client)  # one ssd row runs, the other waits
        fake.gate.set()
        for seed, (name, call) in enumerate(calls.items()):
            messages = list(call)
            assert [m.token_ids[0] for m in messages if m.token_ids] == expected(seed, 8), name
        for thread in threads:
            thread.join(60)
        for seed, out in results.items():
            assert_own_tokens(out, seed, 8)
    stepped = [mode for mode, rows, held in fake.log.steps if rows and not held]
    assert stepped.count("ar") == stepped.count("sd") == 8 and stepped.count("ssd") == 16
    assert all(a != b for a, b in itertools.pairwise(stepped[:24]))  # in turn while all three have rows
    assert fake.log.max_rows("ssd") == 1 and len(fake.log.admitted) == 6


# --- /metrics -------------------------------------------------------------------


def scrape(port: int) -> dict[str, Any]:
    """GET /metrics; {sample name + sorted labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_metrics_endpoint_serves_prometheus_text():
    fake = FakeBackend(max_rows=2, gate=threading.Event())
    with running(lambda: fake, metrics_port=0) as (server, client):
        assert server.metrics_port and server.metrics_port != server.port
        calls = [client.stream(text=PROMPT, mode="ar", seed=i, max_new_tokens=5) for i in range(3)]
        for call in calls:
            next(call)
        assert wait_until(lambda: counts(client) == (2, 1))
        held = scrape(server.metrics_port)
        assert held["ssd:num_requests_running"] == 2 and held["ssd:num_requests_waiting"] == 1
        fake.gate.set()
        for call in calls:
            list(call)
        assert wait_until(lambda: scrape(server.metrics_port)["ssd:num_requests_running"] == 0)
        m = scrape(server.metrics_port)
        assert m["ssd:request_admitted_total"] == 3 and m["ssd:request_rejected_total"] == 0
        assert m["ssd:request_success_total{finished_reason=length}"] == 3
        assert m["ssd:generation_tokens_total"] == 15
        assert m["ssd:request_queue_time_seconds_count"] == 3 and "ssd:request_queue_time_seconds_bucket{le=+Inf}" in m
        assert m["ssd:batch_size_bucket{le=2.0}"] == m["ssd:batch_size_count"] >= 5  # never more than 2 rows
        assert m["ssd:batch_size_bucket{le=1.0}"] >= 1 and m["ssd:batch_size_sum"] == sum(
            rows for _, rows, _ in fake.log.steps)
        text = client.stats().prometheus_text  # the same registry writes the Stats RPC's text
        assert "ssd:request_admitted_total 3.0\n" in text and "ssd:batch_size_bucket" in text


class PollingBatchEngine(FakeBatchEngine):
    """Replicas' engine's shape (ssd.cluster.replicas): every other call sends no step, only
    waits (`stepped_rows` []), the others one step of all rows."""

    polls = 0

    def step(self) -> list[Finished]:
        self.polls += 1
        if self.polls % 2:
            self.sent = []
            return []
        self.sent = [self.rows]
        return super().step()

    def stepped_rows(self, rows_before: int) -> list[int]:
        return self.sent


def test_batch_size_counts_the_steps_an_engine_sent_not_its_polls():
    fake = FakeBackend()
    fake.batch_engine = lambda mode: PollingBatchEngine(mode, fake)
    with running(lambda: fake, metrics_port=0) as (server, client):
        assert client.generate(text=PROMPT, mode="ar", seed=1, max_new_tokens=6).finish_reason == "length"
        m = scrape(server.metrics_port)
    assert m["ssd:batch_size_count"] == len(fake.log.steps) == 6


def test_each_server_steps_at_its_own_thread_count_beside_another():
    """Two servers in one process (the serving bench runs one per thread count): each
    one's engine steps at its runtime.threads, though torch hands the count set last in
    the process to threads it initialises."""
    import torch

    seen: dict[int, list[int]] = {1: [], 2: []}

    def backend(threads: int) -> FakeBackend:
        fake = FakeBackend()
        defaults = fake.info.defaults
        runtime = dataclasses.replace(defaults.runtime, threads=threads)
        fake.info = dataclasses.replace(fake.info, defaults=dataclasses.replace(defaults, runtime=runtime))

        class Recording(FakeBatchEngine):
            def step(self) -> list[Finished]:
                torch.randn(512, 512) @ torch.randn(512, 512)  # intra-op work: torch (re)initialises its threads
                seen[threads].append(torch.get_num_threads())
                return super().step()

        fake.batch_engine = lambda mode: Recording(mode, fake)
        return fake

    before = torch.get_num_threads()
    try:
        with running(lambda: backend(1)) as (_, one), running(lambda: backend(2)) as (_, two):
            for client in (one, two, one, two):
                assert client.generate(text=PROMPT, mode="ar", seed=1, max_new_tokens=3).finish_reason == "length"
    finally:
        torch.set_num_threads(before)
    assert set(seen[1]) == {1} and set(seen[2]) == {2}, seen


def test_two_servers_have_their_own_registries_and_metrics_are_off_by_default():
    with running(lambda: FakeBackend(), metrics_port=0) as (first, first_client), \
            running(lambda: FakeBackend(), metrics_port=0) as (second, _):
        first_client.generate(text=PROMPT, mode="ar", max_new_tokens=3)
        assert first.metrics_port != second.metrics_port
        assert scrape(first.metrics_port)["ssd:request_admitted_total"] == 1
        assert scrape(second.metrics_port)["ssd:request_admitted_total"] == 0
        assert first.registry is not second.registry
    with running(lambda: FakeBackend()) as (server, _):
        assert server.metrics_port is None


def test_metrics_port_option():
    import argparse

    from ssd.app.cli import add_serve_args, serve_options_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_options_from_args(parser.parse_args([])).metrics_port is None
    assert serve_options_from_args(parser.parse_args(["--metrics-port", "0"])).metrics_port == 0
    assert serve_options_from_args(parser.parse_args(["--metrics-port", "9400"])).metrics_port == 9400
    with pytest.raises(ConfigError, match="metrics_port"):
        ServeOptions(metrics_port=70000)


# --- the LocalBackend hook ------------------------------------------------------


def test_local_backend_batches_every_mode_through_make_engine(monkeypatch):
    """ar, sd and ssd are batched, each by the engine make_engine builds with the config's limits."""
    import ssd.serve.backend as backend_module
    from ssd.serve.backend import LocalBackend

    config = load_config(ROOT / "configs" / "tiny.yaml")
    local = LocalBackend(config)
    try:
        fake = FakeBackend()
        made = []

        def make_engine(mode, pair, speculation, batching):
            made.append((mode, batching))
            return FakeBatchEngine(mode, fake)

        monkeypatch.setattr(backend_module, "make_engine", make_engine)
        assert isinstance(local.batch_engine("sd"), FakeBatchEngine)
        assert isinstance(local.batch_engine("ssd"), FakeBatchEngine)
        assert made == [("sd", config.batching), ("ssd", config.batching)]
        with running(lambda: local) as (_, client):
            assert_own_tokens(client.generate(text=PROMPT, mode="ar", seed=5, max_new_tokens=6), 5, 6)
            assert client.generate(text=PROMPT, mode="ssd", max_new_tokens=4).finish_reason == "length"
        assert fake.log.admitted and sorted(fake.log.closed) == ["ar", "ssd"]
    finally:
        local.close()


def test_the_engines_run_with_the_configured_torch_threads():
    """Under OpenMP torch's thread count belongs to each OS thread: runtime.threads must
    be set in the worker thread that runs the engines, not only where the models load."""
    import torch

    seen: list[int] = []

    class Counting(FakeBatchEngine):
        def step(self):
            seen.append(torch.get_num_threads())
            return super().step()

    fake = FakeBackend()
    fake.batch_engine = lambda mode: Counting(mode, fake)
    fake.info = dataclasses.replace(fake.info, defaults=dataclasses.replace(
        fake.info.defaults, runtime=dataclasses.replace(fake.info.defaults.runtime, threads=1)))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with running(lambda: fake) as (server, client):
            client.generate(text=PROMPT, mode="ar", max_new_tokens=2, timeout=30)
    finally:
        torch.set_num_threads(saved)
    assert seen and set(seen) == {1}
