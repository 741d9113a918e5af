"""One loaded model, many threads: every forward gets exactly its own logits.

The server runs forwards of one model from several threads at once: the
batched SD engine drafts in the worker thread while the SSD speculator builds
its cache with the same draft model in its own thread, and in-process SSD may
give one model both roles. A model is shared read-only; a KV cache, a branch
decoder, an engine belong to one thread (ssd.models.__init__ states the
rule). These tests hold the model to it under a GIL that switches threads
every microsecond: an earlier int8 fused projection kept its current input
and outputs on the module between the q/k/v calls and failed them
(tuple index errors, shape errors, and silently wrong logits).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

import pytest
import torch

from ssd.config import (
    BatchingConfig, GenerationConfig, ModelConfig, SamplingConfig, SpeculationConfig, TinyModelConfig, load_config,
)
from ssd.engine.batch import Finished
from ssd.factory import LoadedPair, make_engine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, load_model
from ssd.models.fast import FastForward
from ssd.models.quant import int8_supported
from ssd.serve.backend import LocalBackend
from ssd.serve.client import GenerationClient
from ssd.serve.options import ServeOptions
from ssd.serve.server import GenerationServer
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not int8_supported(), reason="needs torch's x86 int8 kernels")

# 16 threads x 80 forwards. On e87de67, per forward at 16 threads: 6% failed
# on the lean forward (286 errors and 16 wrong logits in 4,800) and 7% on
# transformers' (322 and 23): some 80 failures expected here, none now.
# With 2 threads failures were 1 in ~3,000.
THREADS, FORWARDS = 16, 80
INPUTS = [torch.arange(1, 5), torch.arange(3, 11), torch.tensor([2]), torch.arange(0, 16)]


def int8_model(noise: float = 0.0) -> torch.nn.Module:
    tiny = TinyModelConfig(vocab_size=16, seed=0, noise=noise)
    return load_model(ModelConfig(name="tiny", dtype="fp32", quantization="int8", tiny=tiny))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return int8_model()


@contextmanager
def switching_every_microsecond() -> Iterator[None]:
    """Make the interpreter hand the GIL over as often as it can: races show up in seconds."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_in_threads(work: Callable[[int], str], threads: int) -> collections.Counter:
    """work(thread index) -> an outcome name, from `threads` threads at once; the outcomes counted."""
    outcomes: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def body(index: int) -> None:
        try:
            outcome = work(index)
        except Exception as exc:  # the failure we are counting, not a test error
            outcome = f"{type(exc).__name__}: {exc}"[:80]
        with lock:
            outcomes[outcome] += 1

    pool = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    with switching_every_microsecond():
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(120)
    return outcomes


def lean_forward(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    fast = FastForward(model)
    return lambda ids: fast(fast.new_cache(), ids, torch.arange(len(ids)), 0)  # a cache per call: one owner


def transformers_forward(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids[None]).logits[0]

    return run


@pytest.mark.parametrize("carrier", [lean_forward, transformers_forward], ids=["lean", "transformers"])
def test_one_int8_model_gives_every_thread_its_own_logits(model, carrier):
    run = carrier(model)
    reference = [run(ids) for ids in INPUTS]  # one thread

    def work(index: int) -> str:
        for i in range(FORWARDS):
            which = (i + index) % len(INPUTS)  # neighbours run other shapes at the same moment
            if not torch.equal(run(INPUTS[which]), reference[which]):
                return "wrong logits"
        return "equal"

    outcomes = run_in_threads(work, THREADS)
    assert outcomes == {"equal": THREADS}, outcomes


GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5, 9], [7, 7, 0, 1], [12, 3, 3, 8, 1], [4], [15, 14, 2]]


def request(prompt: list[int], mode: str, max_new: int = 20) -> GenerationRequest:
    speculation = SpeculationConfig(mode=mode, k=3)
    return GenerationRequest(list(prompt), GREEDY, GenerationConfig(max_new_tokens=max_new), speculation)


def run_batch(engine, requests: list[GenerationRequest]) -> list[Finished]:
    for r in requests:
        engine.admit(r)
    finished: list[Finished] = []
    while engine.rows:
        finished += engine.step()
    return finished


def test_in_process_ssd_with_one_int8_model_in_both_roles_is_exact():
    """The target's verification (engine thread) and the speculator's cache build
    (its own thread) run the same int8 model at once."""
    model = int8_model()
    pair = LoadedPair(model, model, TinyTokenizer(16))
    ar = make_engine("ar", pair, SpeculationConfig())
    expected = {tuple(p): ar.generate(request(p, "ar")).token_ids for p in PROMPTS}
    engine = make_engine("ssd", pair, SpeculationConfig(k=3), BatchingConfig())
    try:
        with switching_every_microsecond():
            finished = [f for _ in range(3) for f in run_batch(engine, [request(p, "ssd") for p in PROMPTS])]
    finally:
        engine.close()
    errors = [f.error for f in finished if f.error is not None]
    assert not errors, errors[:3]
    for f in finished:
        assert f.result.token_ids == expected[tuple(f.request.prompt_ids)]
    assert sum(f.result.stats.spec.degraded_rounds for f in finished) == 0  # the speculator never failed
    assert sum(f.result.stats.spec.hits for f in finished) > 0  # the cache served rounds


@pytest.fixture(scope="module")
def int8_config():
    config = load_config(ROOT / "configs" / "tiny.yaml")
    def int8(model: ModelConfig) -> ModelConfig:
        return dataclasses.replace(model, dtype="fp32", quantization="int8")

    return dataclasses.replace(config, target=int8(config.target), draft=int8(config.draft))


# 16 requests a wave. On e87de67 this test failed 1 run in 9 here (the draft's
# forwards in the two threads overlap only now and then); the forward-level
# test above is the one that fails every time.
WAVES = 3


def test_server_runs_sd_and_ssd_requests_at_once_on_an_int8_pair(int8_config):
    """The batched SD engine drafts in the worker thread while SSD's speculator
    builds with the same draft model in its own: every request ends with AR's tokens."""
    backend = LocalBackend(int8_config)
    prompts = [[(3 * i + j) % 16 for j in range(2 + i % 4)] for i in range(8)]
    ar = make_engine("ar", backend.pair, SpeculationConfig(), BatchingConfig())
    expected = {tuple(f.request.prompt_ids): f.result.token_ids for f in run_batch(ar, [request(p, "ar", 24) for p in prompts])}
    server = GenerationServer(ServeOptions(port=0, grace_s=2.0), lambda: backend)
    server.start()
    outcomes: dict[tuple[str, int], Any] = {}

    def call(mode: str, index: int) -> None:
        with GenerationClient(f"127.0.0.1:{server.port}") as client:
            try:
                out = client.generate(token_ids=prompts[index], mode=mode, k=3, temperature=0.0, max_new_tokens=24, timeout=120)
                outcomes[mode, index] = out.token_ids
            except grpc.RpcError as exc:
                outcomes[mode, index] = f"{exc.code().name}: {exc.details()}"

    try:
        assert server.wait_ready(30)
        for wave in range(WAVES):
            clients = [threading.Thread(target=call, args=(m, i)) for i in range(len(prompts)) for m in ("sd", "ssd")]
            with switching_every_microsecond():
                for t in clients:
                    t.start()
                for t in clients:
                    t.join(120)
            wrong = {key: out for key, out in outcomes.items() if out != expected[tuple(prompts[key[1]])]}
            assert len(outcomes) == 2 * len(prompts) and not wrong, (wave, wrong)
            outcomes.clear()
    finally:
        server.stop(grace_s=0.5)
        backend.close()
