"""Batched rows graphed (issue 34, item 3): the parts that need no GPU.

On CUDA every sequence of a lean model holds a slot of its model's shared
KV store (ssd.models.shared_kv), and a packed forward of several sequences
runs as one static-shape forward over that store (one attention call per
layer for the batch), captured as a CUDA graph per bucket
(ssd.models.graphs.BatchedForward). Here the CUDA choice is forced on the
CPU (`static_on_cpu`: sequences take slots, the static forwards run eagerly,
the very functions a graph would record) and checked against the lean
packed forward, through the engines, and for what a shared store must not
do: leak a stale value into a new sequence, keep its peak size forever, or
go wrong when a capture fails.
"""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import graphs
from ssd.models import kv as kv_module
from ssd.models.graphs import BatchedForward, GraphedForward, pool_for
from ssd.models.kv import Feed, KVSequence, feed_rows
from tests.families import FAMILIES, build_family
from tests.test_batch import run_batch
from tests.test_graphs import captured_with, graph_warnings, stand_in_capture

# fp64: the static forward sums attention over the whole capacity in one
# call where the lean forward sums each row's prefix on its own; only the
# summation order differs (~1e-15 relative), so 1e-10 leaves room and still
# catches any wrong entry (O(1e-2) and up on these models).
TOL64 = dict(rtol=1e-10, atol=1e-10)
# fp32: the same, at fp32's ~1e-7 rounding per sum over a few hundred terms.
TOL32 = dict(rtol=1e-5, atol=1e-5)
PREFIXES = ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3], [5, 5, 5, 5, 5], [9, 8])


@pytest.fixture
def static_on_cpu(monkeypatch):
    """KVSequence as on CUDA (slots of the shared store, the static forwards), run eagerly."""
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)


def pairs(model, n: int) -> tuple[list[KVSequence], list[KVSequence]]:
    """n sequences on `model`'s shared store and n lean ones (a copy of the model: a pool of its own),
    each pair prefilled alike with PREFIXES (single-sequence forwards)."""
    twin = copy.deepcopy(model)
    lean = [KVSequence(twin) for _ in range(n)]
    shared = [KVSequence(model, slots=True) for _ in range(n)]
    for a, b, prefix in zip(shared, lean, PREFIXES):
        assert a._graphed is not None and b._graphed is None
        a.forward(prefix)
        b.forward(prefix)
    return shared, lean


def batches(n: int) -> list[list[tuple[int, list[int], dict]]]:
    """Rounds of (sequence index, ids, Feed options): decode of some rows (others are padding),
    verification of ragged lengths, tree-masked uncommitted rows beside committed ones, a
    sequence's logits for its last row only."""
    return [
        [(0, [7], {}), (2, [1], {}), (3, [4], {"last_only": True})],
        [(i, [(3 * i + j) % 16 for j in range(1 + (2 * i) % 5)], {}) for i in range(n)],
        [(1, [2, 3, 4], {"commit": 0, "visible": "tree"}), (0, [6, 6], {}), (4, [1], {})],
    ]


def run(seqs: list[KVSequence], round_: list[tuple[int, list[int], dict]]) -> list[torch.Tensor]:
    feeds = []
    for index, ids, options in round_:
        kv, options = seqs[index], dict(options)
        if options.pop("visible", None) == "tree":  # a chain of uncommitted entries after the cache
            m, n = len(ids), kv.cached
            visible = torch.ones(m, n + m, dtype=torch.bool)
            visible[:, n:] = torch.ones(m, m, dtype=torch.bool).tril()
            options.update(positions=torch.arange(n, n + m), visible=visible)
        feeds.append(Feed(kv, ids, options.pop("commit", len(ids)), **options))
    return feed_rows(feeds)


def compare(shared, lean, tol) -> float:
    """Every batch of `batches` on both sets; the largest absolute difference seen."""
    worst = 0.0
    for round_ in batches(len(shared)):
        for got, want in zip(run(shared, round_), run(lean, round_), strict=True):
            torch.testing.assert_close(got, want, **tol)
            worst = max(worst, float((got - want).abs().max()))
    assert [kv.tokens for kv in shared] == [kv.tokens for kv in lean]
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_the_batched_static_forward_equals_the_lean_packed_forward(family):
    """Measured on this machine: 5.6e-17 at most, every family (logits of order 0.1-1)."""
    model = build_family(family)
    shared, lean = pairs(model, len(PREFIXES))
    worst = compare(shared, lean, TOL64)
    runner = pool_for(model).batched_runner
    assert runner is not None and runner.eager_runs == 3 and runner.replays == 0
    assert pool_for(model).shared.slots == 8  # five sequences: the bucket of eight, three slots padding
    logging.getLogger(__name__).info("%s fp64: max abs diff %.1e", family, worst)


def test_the_batched_static_forward_in_fp32():
    """Measured on this machine: 6.0e-8 at most."""
    model = build_family("qwen2", dtype=torch.float32)
    shared, lean = pairs(model, len(PREFIXES))
    worst = compare(shared, lean, TOL32)
    assert worst < 1e-5
    logging.getLogger(__name__).info("qwen2 fp32: max abs diff %.1e", worst)


def test_stand_in_graph_replays_of_the_batch_equal_the_lean_forward(monkeypatch):
    """With graphs 'on' (stand-in captures that replay the recorded function on their own
    buffers), buckets are captured once, checked (check_replay), and replayed on new inputs."""
    model = build_family("llama")
    monkeypatch.setattr(graphs, "use_cuda_graphs", lambda device: True)

    def capture(self, key, *inputs):
        static = tuple(t.clone() for t in inputs)
        logits = self._forward(*static)
        captured = captured_with(lambda: logits.copy_(self._forward(*static)), logits, static)
        graphs.check_replay(captured, self._forward, torch.device("cpu"))
        self._captured[key] = captured
        return captured

    monkeypatch.setattr(GraphedForward, "_capture", capture)
    shared, lean = pairs(model, len(PREFIXES))
    compare(shared, lean, TOL64)
    again = [[(0, [3], {}), (2, [2], {}), (3, [1], {})]]  # the decode bucket once more: a replay
    for got, want in zip(run(shared, again[0]), run(lean, again[0]), strict=True):
        torch.testing.assert_close(got, want, **TOL64)
    runner = pool_for(model).batched_runner
    assert runner.eager_runs == 0 and runner.replays == 4
    assert len(runner.buckets) == 3 and all(b[0] == 8 for b in runner.buckets)  # (slots, T, capacity)


def request(prompt, n, k=None) -> GenerationRequest:
    speculation = SpeculationConfig(mode="sd", k=k) if k else None
    return GenerationRequest(prompt, SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=n),
                             speculation)


ROWS = [([1, 2, 3], 20, 4), ([5], 12, 2), ([7, 7, 7, 7, 0, 1, 9, 12, 15], 16, 3), ([11, 4], 9, 5)]


def test_greedy_batched_engines_on_the_static_path_equal_ar_alone(tiny_models, tiny_tokenizer, monkeypatch):
    alone = [AREngine(tiny_models[0], tiny_tokenizer).generate(request(p, n)).token_ids for p, n, _ in ROWS]
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    target, draft = (copy.deepcopy(m) for m in tiny_models)  # pools of their own
    ar = AREngine(target, tiny_tokenizer)
    sd = SDEngine(target, draft, tiny_tokenizer)
    for engine, rows in ((ar, [request(p, n) for p, n, _ in ROWS]), (sd, [request(*row) for row in ROWS])):
        outs = run_batch(engine, rows)
        assert [f.error for f in outs] == [None] * len(rows)
        assert [f.result.token_ids for f in outs] == alone
    for model in (target, draft):
        assert pool_for(model).batched_runner.eager_runs > 0  # the batched static forward ran


def test_greedy_batched_ssd_on_the_static_path_equals_ar_alone(tiny_models, tiny_tokenizer, monkeypatch):
    """SSD's target batch, and its speculator thread's builds (every row's branches as one packed
    forward of tree-masked feeds) on the draft's store, both through the batched static forward."""
    from tests import test_batch_ssd

    alone = [AREngine(tiny_models[0], tiny_tokenizer).generate(request(p, n)).token_ids for p, n, _ in ROWS]
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    target, draft = (copy.deepcopy(m) for m in tiny_models)
    rows = [test_batch_ssd.request(p, n, k=k, budget=6) for p, n, k in ROWS]
    with test_batch_ssd.linked(target, draft, tiny_tokenizer) as (engine, _, _):
        outs = [test_batch_ssd.ok(f) for f in test_batch_ssd.run_batch(engine, rows)]
    assert [out.token_ids for out in outs] == alone
    for model in (target, draft):
        assert pool_for(model).batched_runner.eager_runs > 0


def test_sampled_sd_batches_on_the_static_path_keep_the_target_law(monkeypatch):
    """T=1, test_distribution's fp64 small pair: SD's seeds as rows of batches with every packed
    forward through the batched static forward (and the first seeds run alone equal to their
    rows); tokens 1-4 against the target's enumerated law."""
    from tests.stats import ALPHA, chi_square_pvalue
    from tests.test_distribution import STRONG_SAMPLES, draw, exact_joint, small_models

    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)
    target, draft = small_models()
    sampling = SamplingConfig(temperature=1.0)
    draws = draw((target, draft), sampling, samples=STRONG_SAMPLES)
    assert pool_for(target).batched_runner.eager_runs > 0  # the batched static forward ran
    pvalue = chi_square_pvalue(draws.samples, exact_joint(target, sampling))
    assert pvalue > ALPHA, f"sampled SD on the batched static path deviates from the target: p = {pvalue:.2e}"


def test_a_nan_in_a_released_slot_reaches_no_later_sequence():
    model = build_family("qwen2")
    reference = KVSequence(copy.deepcopy(model))
    first, other = KVSequence(model, slots=True), KVSequence(model, slots=True)
    first.forward([1, 2, 3, 4])
    slot, store = first.cache.slot, pool_for(model).shared
    del first
    gc.collect()
    other.forward([9, 9])  # the released slot is zeroed before this forward...
    for t in store.keys + store.values:
        t[slot].fill_(float("nan"))  # ... so only the hand-out's zeroing stops what is written after
    later = KVSequence(model, slots=True)
    assert later.cache.slot == slot
    ids = [[5, 6, 7], [1], [2, 3]]
    want = [reference.forward(ids[0]), reference.forward(ids[1]), reference.forward(ids[2])]
    got = [later.forward(ids[0])] + feed_rows([Feed(later, ids[1], 1), Feed(other, [4], 1)])[:1]
    got += feed_rows([Feed(later, ids[2], 2), Feed(other, [4, 5], 2)])[:1]
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, **TOL64)


def test_padding_rows_see_no_nan_of_a_free_slot(monkeypatch, static_on_cpu):
    """A released slot is zeroed before the next forward: the padding row a batch puts in it
    reads entry 0 of it, and must compute finite values (SDPA's NaN for a NaN key)."""
    model = build_family("qwen2")
    seqs = [KVSequence(model) for _ in range(3)]
    for kv in seqs:
        kv.forward([1, 2])
    store = pool_for(model).shared
    slot = seqs[1].cache.slot
    for t in store.keys + store.values:
        t[slot].fill_(float("nan"))  # a poisoned sequence...
    del seqs[1]
    gc.collect()  # ... leaves
    real, seen = graphs.batched_static_forward, []

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(graphs, "batched_static_forward", spy)
    feed_rows([Feed(kv, [3], 1) for kv in seqs])
    assert len(seen) == 1 and torch.isfinite(seen[0]).all()  # every row, padding included


def test_the_store_shrinks_when_the_batch_and_the_contexts_do(static_on_cpu):
    model = build_family("mistral")
    seqs = [KVSequence(model) for _ in range(5)]
    long = [(5 * i) % 16 for i in range(300)]  # past the initial 256 entries
    for i in range(5):
        seqs[i].forward(long if i == 4 else [1 + i, 2])
    store = pool_for(model).shared
    assert (store.slots, store.capacity) == (8, 512)
    peak = store.nbytes()
    assert peak == 2 * 2 * 9 * 2 * 512 * 8 * 8  # layers, keys and values, 8 + scratch rows, kv heads, 512, dim, fp64
    keep = seqs[:2]
    reference = [KVSequence(copy.deepcopy(model)) for _ in keep]
    for i, kv in enumerate(reference):
        kv.forward([1 + i, 2])
    del seqs
    gc.collect()
    for got, want in zip(feed_rows([Feed(kv, [7], 1) for kv in keep]),
                         [kv.forward([7]) for kv in reference], strict=True):
        torch.testing.assert_close(got, want, **TOL64)  # the survivors' entries moved with the shrink
    assert (store.slots, store.capacity) == (2, 256)
    assert store.nbytes() == peak * 3 // 9 // 2


def test_two_threads_on_one_store_while_it_grows_and_shrinks(monkeypatch):
    """A model runs from several threads (the server's drafting, the speculator's builds), each
    with its own sequences: the store's lock keeps every forward off another's reallocation.
    A race check, so not a proof: with `SharedKV.use` taking no lock it failed one run in three
    on this 2-core machine."""
    import threading

    model = build_family("qwen2")
    twin = copy.deepcopy(model)
    lean = {seed: [KVSequence(twin) for _ in range(3)] for seed in (0, 5)}
    monkeypatch.setattr(kv_module, "use_cuda_graphs", lambda device: True)  # for both threads, throughout
    shared = {seed: [KVSequence(model) for _ in range(3)] for seed in (0, 5)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for step in range(12):
                ids = [[(seed + step + i) % 16] for i in range(3)]
                got = feed_rows([Feed(kv, x, 1) for kv, x in zip(shared[seed], ids)])
                for g, kv, x in zip(got, lean[seed], ids, strict=True):
                    torch.testing.assert_close(g, kv.forward(x), **TOL64)
                if seed and step % 4 == 0:  # a long sequence comes and goes: capacity 512, then 256
                    extra = KVSequence(model)
                    extra.forward([(3 * i) % 16 for i in range(60)])
                    extra.forward([(5 * i) % 16 for i in range(60)] * 4)
                    del extra
                    gc.collect()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in shared]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store = pool_for(model).shared
    assert store.version >= 7 and store.capacity == 256  # grown and shrunk three times, over 8 slots


def test_a_shrink_drops_the_graphs_made_over_the_old_store(monkeypatch):
    """Graphs record addresses: after the store reallocates, none made over the old tensors is
    kept (their memory goes back at once), nor the runners of slots the store no longer has."""
    model = build_family("llama")
    monkeypatch.setattr(graphs, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(GraphedForward, "_capture", stand_in_capture(stale=False))
    shared, lean = pairs(model, len(PREFIXES))
    compare(shared, lean, TOL64)
    pool = pool_for(model)
    assert len(pool.batched_runner.buckets) == 3 and sorted(pool._runners) == [0, 1, 2, 3, 4]
    del shared[2:]
    gc.collect()
    for kv in (shared[1], lean[1]):
        kv.drop_uncommitted()  # the tree round's entries
    ids = [[3], [4]]
    for got, want in zip(feed_rows([Feed(kv, x, 1) for kv, x in zip(shared, ids)]),
                         [kv.forward(x) for kv, x in zip(lean, ids)], strict=True):
        torch.testing.assert_close(got, want, **TOL64)
    assert pool.shared.slots == 2 and pool.batched_runner.buckets == [(2, 1, 256)]
    assert sorted(pool._runners) == [0, 1] and all(not r.buckets for r in pool._runners.values())


def test_a_failed_batch_capture_turns_graphs_off_once_and_the_batch_runs_on(monkeypatch, caplog):
    model = build_family("qwen3")
    monkeypatch.setattr(graphs, "use_cuda_graphs", lambda device: True)
    monkeypatch.setattr(GraphedForward, "_capture", stand_in_capture(stale=False))  # single sequences: fine
    attempts = []

    def failing(self, key, *inputs):
        attempts.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(BatchedForward, "_capture", failing)
    shared, lean = pairs(model, len(PREFIXES))
    with caplog.at_level(logging.WARNING, logger=graphs.__name__):
        compare(shared, lean, TOL64)
    pool = pool_for(model)
    assert len(attempts) == 1 and "stream is capturing" in pool.disabled
    assert pool.batched_runner.eager_runs == 1  # the failed bucket's call; then the lean packed forward
    assert len(graph_warnings(caplog)) == 1
    later = KVSequence(model)
    assert later._graphed is None  # a later sequence: no slot, no graphs


@pytest.mark.parametrize("capture", ["cpu", "replays", "fails"])
def test_the_smoke_times_the_batch_and_says_what_ran(monkeypatch, capture: str):
    """launch/gpu_smoke.py's batch timing: the lean packed forward against the batched one,
    labelled by what ran (a graph on CUDA, or the eager fallback after a failed capture)."""
    from ssd.tools.bench import hot_path

    model = build_family("llama")
    if capture != "cpu":
        monkeypatch.setattr(hot_path, "use_cuda_graphs", lambda device: True)
        monkeypatch.setattr(graphs, "use_cuda_graphs", lambda device: True)
        monkeypatch.setattr(GraphedForward, "_capture", stand_in_capture(stale=False))
    if capture == "fails":
        monkeypatch.setattr(BatchedForward, "_capture", lambda *a: (_ for _ in ()).throw(RuntimeError("no capture")))
    timings = hot_path.time_batches(model, (2, 3), prefix=6, repeats=2)
    label = {"cpu": "batched static", "replays": "batched graph", "fails": hot_path.FAILED_BATCH_GRAPH}[capture]
    assert {name: set(variants) for name, variants in timings.items()} == {
        "target decode batch of 2": {"packed", label}, "target decode batch of 3": {"packed", label}}
    runner = pool_for(model).batched_runner
    assert runner.replays == (6 if capture == "replays" else 0)  # warm-up and two repeats, two sizes
