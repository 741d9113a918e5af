"""The gRPC endpoint: a real server on a loopback port over the tiny fp64 pair.

Exactness through the wire (stream == final == a direct engine run),
concurrency, cancel / deadline / Abort freeing the engine, engine faults,
validation, auth, TLS, health transitions, reflection and Stats.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ssd.config import GenerationConfig, SamplingConfig, load_config
from ssd.factory import make_engine
from ssd.engine.output import OutputTracker
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.serve import protos
from ssd.serve.backend import LocalBackend
from ssd.serve.client import GenerationClient, build_request
from ssd.serve.options import ServeOptions
from ssd.serve.server import SERVICE_NAME, GenerationServer
from ssd.serve.streaming import TextStream
from ssd.serve.validation import SEEDED_COUPLING
from tests.conftest import ROOT, static_ssd
from tests.spies import QPRIME_TOL, record_builds, saguaro_errors

PROMPT = "abcab"


class ControlledBackend:
    """The real backend, optionally gated, slowed or made to fail mid-generation."""

    def __init__(self, inner: LocalBackend, round_delay_s: float = 0.0,
                 fail_after_rounds: int | None = None, gate: threading.Event | None = None,
                 modes: tuple[str, ...] | None = None, max_rows: int | None = None) -> None:
        self.inner = inner
        self.max_rows = max_rows  # hold each engine at this many rows: later requests queue
        self.round_delay_s = round_delay_s
        self.fail_after_rounds = fail_after_rounds
        self.gate = gate
        self.info = inner.info if modes is None else dataclasses.replace(inner.info, modes=modes)

    def batch_engine(self, mode: str) -> "ControlledEngine":
        return ControlledEngine(self.inner.batch_engine(mode), self)

    def encode(self, text):
        return self.inner.encode(text)

    def apply_chat(self, messages):
        return self.inner.apply_chat(messages)

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens)

    def close(self) -> None:
        """The module's LocalBackend outlives each server."""


class ControlledEngine:
    """The real batch engine, its steps gated and slowed, its rows made to fail after some rounds."""

    def __init__(self, inner: Any, control: ControlledBackend) -> None:
        self.inner, self.control = inner, control

    def admit(self, request: GenerationRequest) -> None:
        rounds = 0

        def on_round(ids: list[int]) -> None:
            nonlocal rounds
            rounds += 1
            if self.control.fail_after_rounds is not None and rounds > self.control.fail_after_rounds:
                raise RuntimeError("injected engine fault")
            request.emit(ids)

        self.inner.admit(dataclasses.replace(request, on_tokens=on_round))

    def can_admit(self, request: GenerationRequest) -> bool:
        rows = self.control.max_rows
        return (rows is None or self.inner.rows < rows) and self.inner.can_admit(request)

    def step(self):
        if self.control.gate is not None:
            assert self.control.gate.wait(30), "test gate never opened"
        finished = self.inner.step()
        time.sleep(self.control.round_delay_s)  # after the round, as its tokens have streamed
        return finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def running(load: Callable[[], Any], wait: bool = True, **options: Any) -> Iterator[tuple[GenerationServer, GenerationClient]]:
    server = GenerationServer(ServeOptions(port=0, grace_s=2.0, **options), load)
    server.start()
    client = GenerationClient(f"127.0.0.1:{server.port}", token=options.get("token"))
    try:
        if wait:
            assert server.wait_ready(30)
        yield server, client
    finally:
        client.close()
        server.stop(grace_s=0.5)


@pytest.fixture(scope="module")
def config():
    return static_ssd(load_config(ROOT / "configs" / "tiny.yaml"))  # SSD stats compared with runs alone


@pytest.fixture(scope="module")
def backend(config):
    local = LocalBackend(config)
    yield local
    local.close()


@pytest.fixture(scope="module")
def served(backend):
    with running(lambda: ControlledBackend(backend)) as pair:
        yield pair


@pytest.fixture
def client(served):
    return served[1]


def direct(backend: LocalBackend, mode: str, temperature: float, seed: int, max_new: int, stop=(),
           coupling: str = SEEDED_COUPLING):
    """The same request straight through a fresh engine, no server (a seeded request that names
    no coupling is served coupled: validation.default_coupling)."""
    speculation = dataclasses.replace(backend.config.speculation, mode=mode)
    engine = make_engine(mode, backend.pair, speculation)
    try:
        return engine.generate(GenerationRequest(
            backend.encode(PROMPT), SamplingConfig(temperature=temperature, seed=seed, coupling=coupling),
            GenerationConfig(max_new_tokens=max_new, stop=list(stop)), speculation,
        ))
    finally:
        engine.close()


def code_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# --- exactness through the wire ---------------------------------------------


@pytest.mark.parametrize("mode,temperature,stop,coupling", [
    ("ar", 0.0, (), ""), ("sd", 0.0, (), ""), ("ssd", 0.0, (), ""), ("sd", 0.9, (), ""), ("ar", 0.9, (), ""),
    ("sd", 0.9, (), "standard"), ("ar", 0.9, (), "standard"), ("sd", 0.0, ("lla",), ""),
])
def test_stream_equals_final_and_direct_engine(client, backend, mode, temperature, stop, coupling):
    out = client.generate(text=PROMPT, mode=mode, temperature=temperature, seed=11,
                          max_new_tokens=40, stop=stop, coupling=coupling)
    want = direct(backend, mode, temperature, 11, 40, stop, coupling or SEEDED_COUPLING)
    assert out.token_ids == list(out.finished.output_token_ids) == want.token_ids
    assert out.text == out.finished.output_text == want.text
    assert out.finish_reason == want.finish_reason
    assert len(out.rounds) == out.stats.rounds + 1  # the first token, then one message per round
    assert out.stats.new_tokens == len(want.token_ids) and out.stats.mode == {"ar": 1, "sd": 2, "ssd": 3}[mode]


def test_stop_string_never_streams(client, backend):
    out = client.generate(text=PROMPT, max_new_tokens=60, stop=["lla"])
    assert out.finish_reason == "stop"
    assert "lla" not in out.text and "lla" in backend.decode(out.token_ids)


def test_eight_concurrent_streams_all_correct(served, backend):
    server, client = served
    seeds = list(range(8))
    results: dict[int, Any] = {}

    def run(seed: int) -> None:
        with GenerationClient(f"127.0.0.1:{server.port}") as own:
            results[seed] = own.generate(text=PROMPT, mode="sd", temperature=0.8, seed=seed,
                                         max_new_tokens=24, timeout=60)

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == seeds
    for seed, out in results.items():
        assert out.token_ids == direct(backend, "sd", 0.8, seed, 24).token_ids, seed
    assert len({tuple(r.token_ids) for r in results.values()}) > 1  # seeds do matter


# --- cancel, deadline, abort, admission, faults -----------------------------


@pytest.fixture
def slow(backend):
    """A server whose engine takes ~20 ms per round and runs one request at a time: a long
    request lasts seconds, and the next one waits in the queue behind it."""
    with running(lambda: ControlledBackend(backend, round_delay_s=0.02, max_rows=1), max_queue=3) as pair:
        yield pair


def _until_idle(client: GenerationClient, limit_s: float = 1.5) -> None:
    """Cancelled requests leave at the worker's next step: nothing running or waiting within limit_s."""
    deadline = time.monotonic() + limit_s
    while (stats := client.stats()).requests_running or stats.requests_waiting:
        assert time.monotonic() < deadline, f"{stats.requests_running} running, {stats.requests_waiting} waiting"
        time.sleep(0.01)


def _next_request_is_prompt(client: GenerationClient, limit_s: float = 1.5) -> None:
    started = time.monotonic()
    out = client.generate(text=PROMPT, mode="ar", max_new_tokens=2, timeout=10)
    assert out.finish_reason == "length"
    assert out.finished.stats.queue_s < limit_s
    assert time.monotonic() - started < limit_s


def test_client_cancel_frees_the_engine(slow):
    server, client = slow
    call = client.stream(text=PROMPT, mode="ar", max_new_tokens=400)
    for _ in range(4):
        next(call)
    call.cancel()
    _next_request_is_prompt(client)
    assert wait_until(lambda: client.stats().finished_by_reason["aborted"] == 1)


def test_deadline_stops_generation(slow):
    server, client = slow
    code, _ = code_of(lambda: client.generate(text=PROMPT, mode="ar", max_new_tokens=400, timeout=0.4))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _next_request_is_prompt(client)
    assert wait_until(lambda: client.stats().finished_by_reason["aborted"] == 1)


def test_abort_running_and_queued(slow):
    server, client = slow
    running_call = client.stream(text=PROMPT, mode="ar", max_new_tokens=400, request_id="long")
    assert next(running_call).request_id == "long"
    queued = client.stream(text=PROMPT, mode="ar", max_new_tokens=400)
    first = next(queued)
    assert first.accepted.queued_ahead == 1 and first.request_id  # server-assigned
    assert code_of(lambda: next(client.stream(text=PROMPT, request_id="long")))[0] == grpc.StatusCode.ALREADY_EXISTS

    started = time.monotonic()
    assert client.abort(first.request_id)
    rest = list(queued)
    assert time.monotonic() - started < 1.0  # it left the queue; no wait for the running one
    assert rest[-1].finished.reason == 4 and not any(m.token_ids for m in rest)  # ABORTED, nothing ran
    assert client.abort("long") and not client.abort("no-such-request")
    last = list(running_call)[-1]
    assert last.finished.reason == 4 and 0 < last.finished.stats.new_tokens < 400
    _next_request_is_prompt(client)


def test_admission_limit_is_resource_exhausted(slow):
    server, client = slow
    calls = [client.stream(text=PROMPT, mode="ar", max_new_tokens=400) for _ in range(3)]
    for call in calls:
        next(call)
    code, details = code_of(lambda: next(client.stream(text=PROMPT)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 3" in details
    for call in calls:
        call.cancel()
    _until_idle(client)
    _next_request_is_prompt(client)
    assert client.stats().requests_rejected == 1


def test_engine_fault_is_reported_and_survived(backend):
    with running(lambda: ControlledBackend(backend, fail_after_rounds=2)) as (server, client):
        messages = []
        with pytest.raises(grpc.RpcError) as info:
            for message in client.stream(text=PROMPT, max_new_tokens=30):
                messages.append(message)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "injected engine fault" in info.value.details()
        assert messages[-1].finished.reason == 5 and "injected engine fault" in messages[-1].finished.error
        assert sum(len(m.token_ids) for m in messages) > 0
        assert client.health() == "SERVING"
        assert client.stats().finished_by_reason["error"] == 1
    with running(lambda: ControlledBackend(backend)) as (server, client):  # the engine was rebuilt
        assert client.generate(text=PROMPT, max_new_tokens=8).finish_reason == "length"


# --- validation ---------------------------------------------------------------


BAD = [
    ({}, "prompt"),
    ({"text": ""}, "text"),
    ({"text": "xyz"}, "text"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, 16]}, "token_ids"),
    ({"token_ids": [1] * 500, "max_new_tokens": 32}, "token_ids"),
    ({"messages": []}, "chat"),
    ({"messages": [{"role": "user", "content": "abc"}]}, "chat"),  # tiny has no chat template
    ({"messages": [{"role": "", "content": "abc"}]}, "chat.messages[0].role"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_tokens": 40, "max_new_tokens": 32}, "min_tokens"),
    ({"coupling": "philox"}, "coupling"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 100_000}, "max_new_tokens"),
    ({"mode": 9}, "mode"),
    ({"mode": "sd", "k": 0}, "speculation.k"),
    ({"mode": "sd", "k": 17}, "speculation.k"),
    ({"mode": "ar", "k": 2}, "speculation.k"),
    ({"mode": "sd", "backup": "ngram"}, "speculation.backup"),
    ({"mode": "ssd", "backup": "oracle"}, "speculation.backup"),
    ({"mode": "ssd", "fanout_budget": 0}, "speculation.fanout_budget"),
    ({"mode": "ssd", "fanout_budget": 257}, "speculation.fanout_budget"),
    ({"mode": "ssd", "fanout_kind": "zipf"}, "speculation.fanout_kind"),
    ({"mode": "ssd", "saguaro_c": 1.5}, "speculation.saguaro_c"),
    ({"stop": ["a"] * 9}, "stop"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop": ["ab", "x" * 257]}, "stop[1]"),
    ({"request_id": "r" * 129}, "request_id"),
]


@pytest.mark.parametrize("fields,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(client, fields, field):
    request = {"text": PROMPT, **fields} if not {"text", "token_ids", "messages"} & set(fields) and fields else fields
    code, details = code_of(lambda: client.generate(**request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"{field}:"), details


def test_good_speculation_settings_are_honoured(client, backend, monkeypatch):
    """Each setting is seen to act, none only read back: K in the drafts, the
    backup in the stats, budget and kind in the cached outcomes, C in their q'
    rows. Every value differs from the server's default (K 4, geometric, 16, C 1, neural)."""
    settings = dict(mode="ssd", k=3, fanout_budget=6, fanout_kind="uniform", saguaro_c=0.5, backup="ngram")
    builds = record_builds(monkeypatch)  # the speculator runs in this process (a thread)
    out = client.generate(text=PROMPT, max_new_tokens=24, **settings)
    assert out.token_ids == direct(backend, "ar", 0.0, 0, 24).token_ids
    s = out.stats
    assert len(s.acceptance_by_position) == 3 and 0 < s.drafted <= 3 * s.rounds
    assert dict(s.spec.backups) == {"ngram": s.rounds - s.spec.hits}  # every miss, the first round included
    # uniform: 6 outcomes over k = 0..3, the remainder to the lowest k
    full = [b for b in builds if len(b.drafted) == 3]  # after a bonus-branch hit (glue "fold") a speculation has 2
    assert full and all(b.per_k(3) == [2, 2, 1, 1] for b in full)

    builds.clear()  # C acts on sampled rows only
    client.generate(text=PROMPT, max_new_tokens=12, temperature=1.0, seed=3, coupling="standard", **settings)
    assert builds and all(b.sampling.temperature == 1.0 for b in builds)
    for build in builds[:3]:
        assert max(saguaro_errors(backend.pair.draft, build, 0.5, [2, 2, 1, 1])) < QPRIME_TOL


def test_mode_without_its_model_is_refused(backend):
    with running(lambda: ControlledBackend(backend, modes=("ar",))) as (server, client):
        code, details = code_of(lambda: client.generate(text=PROMPT, mode="ssd"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("mode:") and "draft" in details
        assert client.generate(text=PROMPT, mode="ar", max_new_tokens=4).finish_reason == "length"


# --- security -------------------------------------------------------------------


def test_bearer_token(backend):
    with running(lambda: ControlledBackend(backend), token="s3cret") as (server, authed):
        target = f"127.0.0.1:{server.port}"
        for token in (None, "wrong"):
            with GenerationClient(target, token=token) as other:
                for call in (other.model_info, other.stats, lambda: other.abort("x"),
                             lambda: other.generate(text=PROMPT)):
                    assert code_of(call)[0] == grpc.StatusCode.UNAUTHENTICATED
                assert other.health() == "SERVING"  # probes stay open
                assert SERVICE_NAME in other.services()
        assert authed.generate(text=PROMPT, max_new_tokens=4).finish_reason == "length"


def test_no_token_needed_when_auth_is_off(client):
    assert client.metadata == [] and client.model_info().vocab_size == 16


def test_tls(backend, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with running(lambda: ControlledBackend(backend), tls_cert=cert, tls_key=key) as (server, plain):
        with GenerationClient(f"localhost:{server.port}", root_certificates=cert.read_bytes()) as secure:
            assert secure.generate(text=PROMPT, max_new_tokens=4).finish_reason == "length"
        assert code_of(lambda: plain.model_info(timeout=2))[0] == grpc.StatusCode.UNAVAILABLE


# --- lifecycle, reflection, info, stats -------------------------------------------


def test_health_follows_loading_and_shutdown(backend):
    loaded, generating = threading.Event(), threading.Event()

    def load():
        assert loaded.wait(30)
        return ControlledBackend(backend, gate=generating)

    with running(load, wait=False) as (server, client):
        assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
        assert code_of(lambda: client.generate(text=PROMPT))[0] == grpc.StatusCode.UNAVAILABLE
        loaded.set()
        assert server.wait_ready(30)
        assert client.health() == client.health(SERVICE_NAME) == "SERVING"

        call = client.stream(text=PROMPT, max_new_tokens=12)
        next(call)  # accepted; the engine waits on `generating`
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 10})
        stopper.start()
        assert wait_until(lambda: client.health() == "NOT_SERVING")
        assert code_of(lambda: client.generate(text=PROMPT))[0] == grpc.StatusCode.UNAVAILABLE
        generating.set()  # the in-flight request still completes
        rest = list(call)
        assert rest[-1].finished.reason == 2 and sum(len(m.token_ids) for m in rest) == 12
        stopper.join(10)
        assert not stopper.is_alive()


def test_reflection_lists_the_service(client):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(client.services())
    found = ProtoReflectionDescriptorDatabase(client.channel).FindFileContainingSymbol("ssd.v1.GenerateRequest")
    assert found.name == "ssd/v1/generation.proto"


def test_model_info(client):
    info = client.model_info()
    assert (info.target_model, info.draft_model, info.vocab_size) == ("tiny", "tiny", 16)
    assert list(info.modes) == [1, 2, 3] and info.limits.max_context_tokens == 512
    assert info.limits.max_new_tokens == 511 and info.limits.max_k == 16
    assert info.defaults.mode == 2 and info.defaults.max_new_tokens == 32


def test_stats_and_prometheus_text(client):
    before = client.stats()
    out = client.generate(text=PROMPT, mode="ssd", max_new_tokens=20)
    after = client.stats()
    assert after.generation_tokens_total - before.generation_tokens_total == len(out.token_ids)
    assert after.requests_total - before.requests_total == 1
    assert after.spec_cache_lookups_total - before.spec_cache_lookups_total == out.stats.spec.lookups > 0
    text = after.prometheus_text
    for name in ("ssd:num_requests_running", "ssd:num_requests_waiting", "ssd:generation_tokens_total",
                 "ssd:time_to_first_token_seconds_bucket", "ssd:request_success_total",
                 "ssd_spec_cache_hit_rate", 'ssd_spec_cache_hits_by_k_total{k="', 'ssd_spec_backups_total{kind="',
                 "ssd_spec_target_wait_seconds_total", "ssd_spec_degraded_rounds_total"):
        assert name in text, name
    assert f"ssd:generation_tokens_total {float(after.generation_tokens_total)}\n" in text
    assert f"ssd:time_to_first_token_seconds_count {float(sum(after.finished_by_reason.values()))}\n" in text
    per_token = {f.name: f for f in text_string_to_metric_families(text)}["ssd:time_per_output_token_seconds"]
    samples = {s.name: s.value for s in per_token.samples if s.name.endswith(("_sum", "_count"))}
    assert samples["ssd:time_per_output_token_seconds_count"] >= 1  # this request's 20 tokens at least
    e2e = {f.name: f for f in text_string_to_metric_families(text)}["ssd:e2e_request_latency_seconds"]
    e2e_sum = next(s.value for s in e2e.samples if s.name.endswith("_sum"))
    assert 0 < samples["ssd:time_per_output_token_seconds_sum"] < e2e_sum  # per token, less than whole requests


# --- pieces ---------------------------------------------------------------------


def test_protos_regenerate_from_source(tmp_path):
    protos.load()
    assert protos.is_current()
    protos.compile_protos(tmp_path)
    grpc_module = (tmp_path / "generation_pb2_grpc.py").read_text()
    assert "from . import generation_pb2" in grpc_module and "from ssd.v1" not in grpc_module
    assert protos.is_current(tmp_path)
    shipped = (protos.OUT_DIR / "generation_pb2.py").read_text()
    assert (tmp_path / "generation_pb2.py").read_text() == shipped


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    def decode(ids):  # ids are UTF-8 bytes, as with byte-level BPE
        return bytes(ids).decode("utf-8", errors="replace")

    text = "añb€c"
    data = list(text.encode())
    stream = TextStream(decode)
    deltas = [stream.push([b]) for b in data]
    assert "\ufffd" not in "".join(deltas) and "".join(deltas) == text

    stream = TextStream(decode, GenerationConfig(stop=["b€"]))
    deltas = [stream.push([b]) for b in data[:6]]  # up to and including the stop string
    final = text[: text.find("b€")]
    assert "".join(deltas) + stream.finish(final) == final == "añ"
    assert "b" not in "".join(deltas)


def test_text_stream_streams_past_a_stop_string_min_tokens_holds():
    """The stream follows the engine's rule (ssd.engine.output): "ab" within the first 3 tokens
    is held, so text keeps flowing; the "ab" that ends past them ends it, as in the final text."""
    tokens = [0, 1, 0, 1, 2, 0, 1]  # "ababcab"
    tok = TinyTokenizer(6)
    generation = GenerationConfig(max_new_tokens=20, stop=["ab"], min_tokens=3)
    tracker = OutputTracker(tok, generation, set())
    tracker.add(tokens)
    stream = TextStream(tok.decode, generation)
    deltas = [stream.push([t]) for t in tokens[:4]]
    assert deltas[:3] == ["", "a", "b"]  # a held-back character at a time (holdback 1)
    assert "".join(deltas) + stream.finish(tracker.text()) == tracker.text() == "ab"


def test_mode_and_finish_reason_names_come_from_the_proto():
    from ssd.config import MODES
    from ssd.serve.protos import enum_names

    assert tuple(enum_names("Mode").values()) == MODES
    assert set(enum_names("FinishReason").values()) == {"eos", "length", "stop", "aborted", "error"}


def test_an_asked_for_k_overrides_the_configured_k_policy(backend):
    """The policy applies to requests that leave K to the server."""
    from types import SimpleNamespace

    from ssd.serve.convert import from_proto
    from ssd.serve.options import ServeOptions
    from ssd.serve.validation import validate

    defaults = dataclasses.replace(backend.info.defaults, speculation=dataclasses.replace(
        backend.info.defaults.speculation, k_policy={1: 3, 4: 0}))
    stub = SimpleNamespace(info=dataclasses.replace(backend.info, defaults=defaults), encode=backend.encode,
                           apply_chat=backend.apply_chat)
    pb, _ = protos.load()
    chosen = validate(from_proto(build_request(pb, text=PROMPT, mode="sd")), stub, ServeOptions()).speculation
    asked = validate(from_proto(build_request(pb, text=PROMPT, mode="sd", k=2)), stub, ServeOptions()).speculation
    assert chosen.k_policy == {1: 3, 4: 0} and chosen.k_for(4) == 0
    assert asked.k_policy == {} and asked.k_for(4) == 2


# --- what a seed promises -------------------------------------------------------


def _builds_cut(monkeypatch: pytest.MonkeyPatch, asks: Callable[[int], int | None]) -> None:
    """Every anytime build stops at its asks(n)-th ask (n: the build's number; None: never), as if
    the next round's outcome arrived then: the shapes a busy or idle machine gives SSD's builds."""
    from ssd.saguaro import speculator as speculator_module

    builds = iter(range(10**9))

    class CutAt(speculator_module._Cut):
        def __init__(self, channel) -> None:
            super().__init__(channel)
            self.asked, self.limit = 0, asks(next(builds))

        def __call__(self) -> bool:
            self.asked += 1
            self.fired = self.fired or (self.limit is not None and self.asked >= self.limit)
            return self.fired

    monkeypatch.setattr(speculator_module, "_Cut", CutAt)


CUTS = {"never": lambda n: None, "at the first ask": lambda n: 1, "at the second": lambda n: 2,
        "every other build, at once": lambda n: 1 if n % 2 else None}


def test_a_seeded_ssd_request_repeats_whatever_its_builds_cut(monkeypatch):
    """A request with a seed and no coupling, at T = 0.7, four times to an SSD server whose
    anytime builds are cut at four different points: one text, AR's for the seed (coupled
    sampling is the default for seeded requests). The power: with coupling "standard" the same
    four runs do not all agree."""
    config = load_config(ROOT / "configs" / "tiny.yaml")
    config.serve_defaults = dataclasses.replace(config.serve_defaults, seed=None)  # seeded by the request alone
    assert config.speculation.fanout.anytime
    local = LocalBackend(config)
    try:
        with running(lambda: ControlledBackend(local)) as (_, client):
            def texts(**fields: Any) -> list[str]:
                out = []
                for asks in CUTS.values():
                    _builds_cut(monkeypatch, asks)
                    out.append(client.generate(text=PROMPT, mode="ssd", temperature=0.7, max_new_tokens=32,
                                               **fields).text)
                return out

            seeded = texts(seed=5)
            assert len(set(seeded)) == 1, seeded
            assert seeded[0] == client.generate(text=PROMPT, mode="ar", temperature=0.7, seed=5, max_new_tokens=32).text
            assert len(set(texts(seed=5, coupling="standard"))) > 1
            assert client.model_info().defaults.coupling == "auto"
    finally:
        local.close()


def test_a_request_that_names_no_coupling_gets_gumbel_when_seeded(backend):
    """validation's default: gumbel for a request seeded by itself or by serve_defaults.seed,
    sampling.coupling without a seed; serve_defaults.coupling, where set, for every request."""
    from types import SimpleNamespace

    from ssd.serve.convert import from_proto
    from ssd.serve.validation import validate

    pb, _ = protos.load()

    def coupling(serve_defaults: dict, **fields: Any) -> str:
        defaults = dataclasses.replace(backend.info.defaults, serve_defaults=dataclasses.replace(
            backend.info.defaults.serve_defaults, **serve_defaults))
        stub = SimpleNamespace(info=dataclasses.replace(backend.info, defaults=defaults), encode=backend.encode)
        request = from_proto(build_request(pb, text=PROMPT, mode="ssd", temperature=0.7, **fields))
        return validate(request, stub, ServeOptions()).sampling.coupling

    assert coupling({"seed": None}, seed=3) == "gumbel"
    assert coupling({"seed": None}) == "standard"
    assert coupling({"seed": 0}) == "gumbel"
    assert coupling({"seed": None}, seed=3, coupling="standard") == "standard"
    assert coupling({"seed": None, "coupling": "standard"}, seed=3) == "standard"
    assert coupling({"seed": None, "coupling": "gumbel"}) == "gumbel"
