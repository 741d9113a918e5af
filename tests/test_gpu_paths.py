"""The GPU hot path's choices, checked on the CPU by forcing them.

On CUDA the lean forward runs each segment's attention as one SDPA call
(ssd.models.fast.one_call_attention); on the CPU it keeps one call per row.
Forced on the CPU, the one-call path must give the per-row path's logits up
to floating-point summation order, for every shape the engines use. The
static-shape forward that CUDA graphs capture (ssd.models.graphs) runs
eagerly here and must equal the lean forward likewise.
"""

from __future__ import annotations

import pytest
import torch

from ssd.models.fast import FastForward, one_call_attention
from ssd.models.graphs import GraphedForward, causal_mask, padded_mask, use_cuda_graphs
from ssd.models.kv import KVSequence, forward_rows

TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: only the order of a softmax's sums may differ


def sequence(model, one_call: bool) -> KVSequence:
    kv = KVSequence(model, fast=True)
    kv._fast = FastForward(model, one_call=one_call)
    kv.reset()
    return kv


def script(kv: KVSequence) -> list[torch.Tensor]:
    """Prefill, decode, verification-sized forwards, a long prefill, tree-masked rows."""
    out = [kv.forward([1, 2, 3, 4, 5, 6, 7])]
    out += [kv.forward([t], last_only=True) for t in (8, 9)]
    out.append(kv.forward([10, 11, 12, 13, 14]))  # verify K = 4
    kv.rollback(3)
    out.append(kv.forward([(5 * i) % 16 for i in range(80)]))  # past ROW_LIMIT: a causal mask either way
    n = kv.cached
    visible = torch.ones(3, n + 3, dtype=torch.bool)
    visible[:, n:] = torch.eye(3, dtype=torch.bool)  # three branches that see the prefix and themselves
    visible[1, n - 5 : n] = False
    out.append(kv.extend([1, 2, 3], torch.tensor([n, n, n - 5]), visible))
    return out


def test_attention_is_one_call_on_cuda_and_per_row_elsewhere():
    assert one_call_attention(torch.device("cuda", 0)) and one_call_attention("cuda")
    assert not one_call_attention(torch.device("cpu"))


def test_the_one_call_path_equals_the_per_row_path(tiny_models):
    target, _ = tiny_models  # 4 query heads over 2 kv heads: the grouped fold is exercised
    assert target.config.num_attention_heads != target.config.num_key_value_heads
    for got, want in zip(script(sequence(target, True)), script(sequence(target, False)), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_packed_rows_agree_on_both_paths(tiny_models):
    target, _ = tiny_models
    ids = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    results = []
    for one_call in (True, False):
        rows = [sequence(target, one_call) for _ in ids]
        for row, prefix in zip(rows, ([3, 3], [1, 2, 3, 4, 5], [7])):
            row.forward(prefix)
        results.append(forward_rows(rows, ids))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **TOL)


# --- static shapes (CUDA graphs on CUDA, the same function eagerly here) ------

def test_cuda_graphs_only_on_cuda(tiny_models):
    assert use_cuda_graphs("cuda") and use_cuda_graphs(torch.device("cuda", 1))
    assert not use_cuda_graphs("cpu")
    fast = FastForward(tiny_models[0])
    assert not GraphedForward(fast, fast.new_cache()).graphs


def test_the_static_path_equals_the_lean_forward(tiny_models):
    """Decode, verification and a tree step through the fixed-shape forward
    (whole-capacity attention under a mask, slots as a tensor) give the lean
    forward's logits and leave the same cache."""
    target, _ = tiny_models
    fast = FastForward(target)
    eager, static = fast.new_cache(), fast.new_cache()
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    for cache in (eager, static):
        fast(cache, prompt, torch.arange(7), 0)
    runner = GraphedForward(fast, static)
    n, capacity = 7, static.capacity

    def both(ids, positions, mask=None):
        nonlocal n
        ids, positions = torch.tensor(ids), torch.tensor(positions)
        m = ids.shape[0]
        want = fast(eager, ids, positions, n, mask)
        full = causal_mask(n, m, capacity, "cpu") if mask is None else padded_mask(mask, capacity)
        got = runner(ids, positions, torch.arange(n, n + m), full)
        torch.testing.assert_close(got, want, **TOL)
        n += m

    both([8], [7])  # decode
    both([9, 10, 11, 12, 13], [8, 9, 10, 11, 12])  # verify K = 4
    visible = torch.ones(3, n + 3, dtype=torch.bool)
    visible[:, n:] = torch.eye(3, dtype=torch.bool)
    visible[2, n - 4 : n] = False  # a branch off a shorter prefix
    both([1, 2, 3], [n, n, n - 4], visible)  # a tree step: three branches
    for layer in range(len(eager.keys)):
        torch.testing.assert_close(static.keys[layer][:, :n], eager.keys[layer][:, :n], **TOL)
        torch.testing.assert_close(static.values[layer][:, :n], eager.values[layer][:, :n], **TOL)


def test_the_static_path_refuses_a_mask_of_another_shape(tiny_models):
    fast = FastForward(tiny_models[0])
    runner = GraphedForward(fast, fast.new_cache())
    with pytest.raises(ValueError, match="capacity"):
        runner(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.ones(1, 8, dtype=torch.bool))


def test_the_smoke_run_times_every_hot_path_variant(tiny_models, monkeypatch):
    """launch/gpu_smoke.py's timings of the above: each is the median time of its own
    variant's forward, at its shape, on its model, the warm-up (a graph's capture) untimed.

    A stand-in clock that each real forward advances by a cost known per variant, rows and
    model (and by a second more at a cache's first timed forward, as a lazy init or a
    capture costs) makes every timing exact; a stand-in CUDA graph that replays the static
    forward lets the graph variant, which exists on CUDA only, run here too."""
    from ssd.models import fast as fast_module
    from ssd.models import graphs
    from ssd.tools.bench import hot_path

    target, draft = tiny_models
    now, seen = [0.0], []  # the caches timed so far (kept: an id could be reused)
    per_row = {"per_row": 1e-3, "one_call": 2e-3, "static": 3e-3, "graph": 7e-3}  # seconds a row on the target
    scale = {id(target): 1.0, id(draft): 10.0}
    warm_up = 1.0

    def spend(cache, variant: str, model, rows: int, masked: bool = False) -> None:
        now[0] += per_row[variant] * rows * scale[id(model)] * (5 if masked else 1)
        if not any(cache is c for c in seen):
            seen.append(cache)
            now[0] += warm_up

    lean_call, static_forward = fast_module.FastForward.__call__, graphs.static_forward

    def lean(self, cache, ids, positions, start, mask=None, keep=None):
        out = lean_call(self, cache, ids, positions, start, mask, keep)
        if start:  # not the untimed prefill of the context
            one_call = self._attend is fast_module._attend_one_call
            spend(cache, "one_call" if one_call else "per_row", self.model, ids.shape[0], mask is not None)
        return out

    def static(fast, cache, ids, *rest):
        out = static_forward(fast, cache, ids, *rest)
        spend(cache, "static", fast.model, ids.shape[0])
        return out

    def capture(self, key, *inputs):
        inputs = tuple(t.clone() for t in inputs)
        logits = static_forward(self.fast, self.cache, *inputs)
        spend(self.cache, "graph", self.fast.model, 0)  # the capture: the warm-up's second

        class Replay:
            def replay(self_):
                logits.copy_(static_forward(self.fast, self.cache, *inputs))
                spend(self.cache, "graph", self.fast.model, key[0])

        self._captured[key] = graphs._Captured(Replay(), inputs, logits)
        return self._captured[key]

    monkeypatch.setattr(hot_path, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(fast_module.FastForward, "__call__", lean)
    monkeypatch.setattr(graphs, "static_forward", static)
    monkeypatch.setattr(graphs.GraphedForward, "_capture", capture)
    monkeypatch.setattr(hot_path, "use_cuda_graphs", lambda device: True)

    timings = hot_path.time_hot_path(target, draft, k=2, budgets=(3,), prefix=8, repeats=1)
    ms = {(name, v): 1e3 * s for name, variants in timings.items() for v, s in variants.items()}
    want = {("target decode", "per_row"): 1, ("target decode", "one_call"): 2,
            ("target decode", "static"): 3, ("target decode", "graph"): 7,
            ("target verify K=2", "per_row"): 3, ("target verify K=2", "one_call"): 6,  # K + 1 rows
            ("target verify K=2", "static"): 9, ("target verify K=2", "graph"): 21,
            # B rows on the draft (10x) under a tree mask (5x); the lean forward attends per row on the CPU
            ("draft tree step B=3", "lean"): 150, ("draft tree step B=3", "static"): 90,
            ("draft tree step B=3", "graph"): 210}
    assert ms.keys() == want.keys()
    assert ms == pytest.approx(want, rel=1e-9)


def test_sequences_on_the_static_path_decode_as_the_lean_forward(tiny_models, monkeypatch):
    """KVSequence as on CUDA (static path; eager here, since graphs need CUDA): every cache
    operation's logits, and greedy SD == AR through the engines, as on the lean forward."""
    from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
    from ssd.engine import AREngine, SDEngine
    from ssd.engine.request import GenerationRequest
    from ssd.models import TinyTokenizer
    from ssd.models import kv as kv_module
    from tests.conftest import TINY

    target, draft = tiny_models
    lean = script(KVSequence(target))
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    seq = KVSequence(target)
    assert seq._static
    for got, want in zip(script(seq), lean, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert seq._graphed is not None and not seq._graphed.graphs  # the static path ran, eagerly
    tok, gen = TinyTokenizer.from_config(TINY), GenerationConfig(max_new_tokens=24, ignore_eos=True)
    request = GenerationRequest([1, 2, 3], SamplingConfig(temperature=0.0), gen)
    static_sd = SDEngine(target, draft, tok, SpeculationConfig(mode="sd", k=3)).generate(request).token_ids
    monkeypatch.undo()
    assert static_sd == AREngine(target, tok).generate(request).token_ids


def test_graph_buckets_replay_with_fresh_inputs_and_drop_on_reallocation(tiny_models, monkeypatch):
    """GraphedForward's bookkeeping, with a stand-in for the CUDA graph that
    replays the static forward on the graph's own input buffers."""
    from ssd.models import graphs

    def capture(self, key, *inputs):
        static = tuple(t.clone() for t in inputs)
        logits = graphs.static_forward(self.fast, self.cache, *static)

        class Replay:
            def replay(self_):
                logits.copy_(graphs.static_forward(self.fast, self.cache, *static))

        self._captured[key] = graphs._Captured(Replay(), static, logits)
        return self._captured[key]

    monkeypatch.setattr(graphs.GraphedForward, "_capture", capture)
    target, _ = tiny_models
    fast = FastForward(target)
    eager, cache = fast.new_cache(), fast.new_cache()
    runner = GraphedForward(fast, cache, graphs=True)
    for n in range(6):  # one bucket, replayed with each step's inputs
        ids, positions = torch.tensor([n + 1]), torch.tensor([n])
        want = fast(eager, ids, positions, n)
        got = runner(ids, positions, positions, causal_mask(n, 1, cache.capacity, "cpu"))
        torch.testing.assert_close(got, want, **TOL)
    assert runner.buckets == [(1, 256)]
    cache.reserve(300, keep=6)  # reallocated: the old bucket's buffers are gone
    runner(torch.tensor([7]), torch.tensor([6]), torch.tensor([6]), causal_mask(6, 1, cache.capacity, "cpu"))
    assert runner.buckets == [(1, 512)]


def test_only_repeating_shapes_are_captured():
    """Decode, verification, glue and tree steps: yes; a prompt's prefill (one graph per length): no."""
    from ssd.models.invariant import ROW_LIMIT
    from ssd.models.kv import _graph_shaped

    assert _graph_shaped(1, last_only=True) and _graph_shaped(5, last_only=False)
    assert not _graph_shaped(40, last_only=True) and not _graph_shaped(ROW_LIMIT + 1, last_only=False)


def test_a_new_sequence_takes_the_cache_and_graphs_a_finished_one_gave_back(tiny_models, monkeypatch):
    """The engines make a sequence per request: graphs are captured once per model and
    bucket, not once per request, because caches go back to the model's pool."""
    import gc

    from ssd.models import kv as kv_module
    from ssd.models.graphs import pool_for

    target = copy_of(tiny_models[0])  # a pool of its own
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    first = KVSequence(target)
    first.forward([1, 2, 3])
    cache = first.cache
    second = KVSequence(target)  # both alive: two caches
    assert second.cache is not cache
    del first
    gc.collect()
    assert pool_for(target).free == 1
    third = KVSequence(target)
    assert third.cache is cache and third.length == 0  # reused, and empty to the sequence
    torch.testing.assert_close(third.forward([4, 5]), KVSequence(tiny_models[0], fast=True).forward([4, 5]), **TOL)
    del second, third


def copy_of(model):
    import copy

    return copy.deepcopy(model)
