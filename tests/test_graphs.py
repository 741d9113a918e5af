"""CUDA graphs that cannot go silently wrong: the parts that need no GPU.

What CUDA alone can show (capture on the model's device, the stream put back
after a failed capture) runs in launch/gpu_smoke.py when a GPU is lent
(ssd.tools.bench.graph_check). Here, with stand-ins for the capture: models
refused up front, a failed capture's fallback and its one log line, the
replay check that turns an empty graph into an error, the pool holding no
model alive, and timings labelled by what ran.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import weakref

import pytest
import torch

from ssd.models import graphs
from ssd.models import kv as kv_module
from ssd.models.fast import FastForward
from ssd.models.graphs import EmptyGraphError, GraphedForward, _Captured, check_replay, graph_refusal, pool_for
from ssd.models.kv import KVSequence
from tests.families import build_family
from tests.test_gpu_paths import TOL, script


@pytest.fixture
def on_cuda(monkeypatch):
    """KVSequence and GraphedForward as on CUDA (captures go to whatever `_capture` is)."""
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(graphs, "use_cuda_graphs", lambda device: True)


def graph_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == graphs.__name__ and r.levelno == logging.WARNING]


def test_host_syncing_and_sharded_models_are_refused_up_front() -> None:
    assert graph_refusal(build_family("llama")) is None
    for rope in ("dynamic", "longrope"):
        model = build_family("llama", rope_parameters={"rope_type": rope, "factor": 2.0, "rope_theta": 1e4,
                                                        "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                                                        "original_max_position_embeddings": 256})
        assert rope in graph_refusal(model)
    sharded = build_family("qwen2")
    sharded._tp_size = 2
    assert "tensor-parallel" in graph_refusal(sharded)


def test_a_refused_model_never_captures_and_says_so_once(on_cuda, monkeypatch, caplog) -> None:
    model = build_family("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    monkeypatch.setattr(GraphedForward, "_capture", lambda *a: pytest.fail("a refused model was captured"))
    with caplog.at_level(logging.WARNING, logger=graphs.__name__):
        seqs = [KVSequence(model) for _ in range(2)]
        want = script(KVSequence(model, fast=False))
        for seq in seqs:
            assert seq.lean and not seq._static
            for got, ref in zip(script(seq), want, strict=True):
                torch.testing.assert_close(got, ref, **TOL)
    assert len(graph_warnings(caplog)) == 1 and "dynamic" in graph_warnings(caplog)[0]


def test_a_failed_capture_turns_graphs_off_for_the_model_once(on_cuda, monkeypatch, caplog, tiny_models) -> None:
    target = copy.deepcopy(tiny_models[0])  # a pool of its own
    attempts = []

    def failing(self, key, *inputs):
        attempts.append(key)
        self.cache.keys[0].add_(0)  # touched, as a half-run capture may
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedForward, "_capture", failing)
    want = script(KVSequence(target, fast=False))
    with caplog.at_level(logging.WARNING, logger=graphs.__name__):
        first = KVSequence(target)
        assert first._static
        for got, ref in zip(script(first), want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        second = KVSequence(target)  # a later request: no capture attempted again
        for got, ref in zip(script(second), want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
    assert len(attempts) == 1
    assert pool_for(target).disabled and "stream is capturing" in pool_for(target).disabled
    assert first._graphed.eager_runs == 1 and first._graphed.replays == 0  # the failed call, then the lean forward
    assert not second._static
    assert len(graph_warnings(caplog)) == 1


def captured_with(replay, logits: torch.Tensor, inputs: tuple[torch.Tensor, ...] = ()) -> _Captured:
    return _Captured(type("Graph", (), {"replay": staticmethod(replay)})(), inputs, logits)


def test_an_empty_or_stale_graph_is_an_error_not_a_result() -> None:
    """check_replay replays on the capture's inputs and on other token ids: a graph that
    writes nothing, or that always returns its capture-time logits, is refused."""
    cpu = torch.device("cpu")

    def eager(ids: torch.Tensor) -> torch.Tensor:
        return torch.outer(ids.double(), torch.arange(16.0, dtype=torch.float64)) + 1

    ids = torch.tensor([3, 5, 7])
    logits = eager(ids)  # what the capture itself computed
    good = captured_with(lambda: logits.copy_(eager(good.inputs[0])), logits, (ids,))
    check_replay(good, eager, cpu)
    assert torch.equal(good.inputs[0], ids)  # the capture's inputs are back in the buffers
    with pytest.raises(EmptyGraphError, match="unwritten"):
        check_replay(captured_with(lambda: None, logits.clone(), (ids.clone(),)), eager, cpu)
    frozen = eager(ids)
    stale = captured_with(lambda: stale.logits.copy_(frozen), frozen.clone(), (ids.clone(),))
    with pytest.raises(EmptyGraphError, match="differs"):
        check_replay(stale, eager, cpu)


def test_an_empty_capture_falls_back_like_a_failed_one(on_cuda, monkeypatch, tiny_models) -> None:
    """GraphedForward's capture runs check_replay: a stand-in capture recording nothing is refused."""
    target = copy.deepcopy(tiny_models[0])

    def empty(self, key, *inputs):
        static = tuple(t.clone() for t in inputs)
        captured = captured_with(lambda: None, graphs.static_forward(self.fast, self.cache, *static), static)
        check_replay(captured, functools.partial(graphs.static_forward, self.fast, self.cache), torch.device("cpu"))
        return captured

    monkeypatch.setattr(GraphedForward, "_capture", empty)
    seq = KVSequence(target)
    want = KVSequence(target, fast=False)
    for ids in ([1, 2, 3], [4], [5]):
        torch.testing.assert_close(seq.forward(ids), want.forward(ids), **TOL)
    assert "unwritten" in pool_for(target).disabled


def test_the_pool_keeps_no_model_alive(on_cuda, tiny_models) -> None:
    model = copy.deepcopy(tiny_models[0])
    seq = KVSequence(model)
    seq.forward([1, 2, 3])
    pool, alive = pool_for(model), weakref.ref(model)
    del seq
    gc.collect()
    assert pool.free == 1 and all(runner.fast is None for runner in pool._runners.values())
    del model
    gc.collect()
    assert alive() is None


def test_timings_say_when_no_graph_ran(monkeypatch, tiny_models) -> None:
    from ssd.tools.bench import hot_path

    monkeypatch.setattr(hot_path, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(GraphedForward, "_capture", lambda *a: (_ for _ in ()).throw(RuntimeError("no capture")))
    timings = hot_path.time_rows(tiny_models[0], rows=1, prefix=4, repeats=1)
    assert hot_path.FAILED_GRAPH in timings and "graph" not in timings
    runner = GraphedForward(FastForward(tiny_models[0]), FastForward(tiny_models[0]).new_cache(), graphs=True)
    runner.replays = 3
    assert hot_path.variant_label("graph", runner) == "graph" and hot_path.variant_label("static", runner) == "static"


def stand_in_capture(stale: bool):
    """A `_capture` whose 'graph' replays the static forward on its buffers, or (stale) replays nothing."""
    def capture(self, key, *inputs):
        static = tuple(t.clone() for t in inputs)
        logits = self._forward(*static)  # a sequence's static forward, or a batch's

        def replay():
            if not stale:
                logits.copy_(self._forward(*static))

        self._captured[key] = captured_with(replay, logits, static)
        return self._captured[key]
    return capture


@pytest.mark.parametrize("stale", [False, True])
def test_the_smoke_graph_check_passes_replays_and_catches_stale_ones(on_cuda, monkeypatch, stale: bool) -> None:
    """launch/gpu_smoke.py's graph check, with stand-in graphs: faithful ones pass, and
    one that returns its capture-time logits (an empty graph, unchecked) fails it."""
    from ssd.tools.bench import graph_check
    from ssd.tools.bench.smoke import SmokeSettings, model_specs

    monkeypatch.setattr(graph_check, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(GraphedForward, "_capture", stand_in_capture(stale))
    result = graph_check.check_graphs_on(model_specs(SmokeSettings())["real pair"][1], "cpu")
    assert result["graph_replays"] > 0
    assert result["passed"] is not stale, str(result)
    if stale:
        assert result["repeated_outputs"] > 0 and result["max_rel_diff"] > 0.1


@pytest.mark.parametrize("stale", [False, True])
def test_the_smoke_batched_graph_check_passes_replays_and_catches_stale_ones(on_cuda, monkeypatch, stale: bool) -> None:
    """The same for the batched rows' check (2 rows here; the smoke runs 2 and batching.max_rows)."""
    from ssd.tools.bench import graph_check
    from ssd.tools.bench.smoke import SmokeSettings, model_specs

    monkeypatch.setattr(graph_check, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(GraphedForward, "_capture", stand_in_capture(stale))
    result = graph_check.check_batched_on(model_specs(SmokeSettings())["real pair"][1], "cpu", rows=2)
    assert result["graph_replays"] > 0 and all(bucket[0] == 2 for bucket in result["buckets"])
    assert result["passed"] is not stale, str(result)
    if stale:
        assert result["repeated_outputs"] > 0


def test_the_smoke_branch_check_captures_graphs_under_each_backend(on_cuda, monkeypatch) -> None:
    """A graph keeps the attention kernel of its capture: the branch check must capture anew
    under each SDPA backend it compares (a model's pool would replay the first backend's)."""
    from torch.nn.attention import SDPBackend

    from ssd.tools.bench.branch_check import branch_case, check_branches

    captured_under: list[str] = []
    faithful = stand_in_capture(stale=False)

    def capture(self, key, *inputs):
        captured_under.append("math" if torch.backends.cuda.math_sdp_enabled() else "flash")
        return faithful(self, key, *inputs)

    monkeypatch.setattr(GraphedForward, "_capture", capture)
    model = build_family("qwen2").float()
    case = branch_case(model.config.vocab_size, context_len=12, branches=4, steps=3)
    result = check_branches({"fp32": model}, case, {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION})
    assert result["passed"] and result["ran"] == ["fp32/math", "fp32/flash"], result
    assert set(captured_under) == {"math", "flash"}
    assert all(result["results"][key]["graph_replays"] > 0 for key in result["ran"])
