"""Shared fixtures: a tiny target and a tiny draft that agrees with it often."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ssd.config import TinyModelConfig
from ssd.models import TinyTokenizer, build_tiny_model

# One intra-op thread: tiny models are dominated by per-op overhead, and the
# suite must not oversubscribe a 2-core CI machine.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
TINY = TinyModelConfig(vocab_size=16, seed=0)


def tiny_pair(tcfg: TinyModelConfig = TINY, noise: float = 0.03, dtype=torch.float64):
    """(target, draft): the draft is the target with relative Gaussian noise.

    noise 0.03 gives greedy acceptance around 0.5 with K = 4 on the 16-token
    model: both the accept and the reject branches are exercised constantly.
    """
    target = build_tiny_model(tcfg, dtype)
    draft = build_tiny_model(dataclasses.replace(tcfg, noise=noise), dtype)
    return target, draft


@pytest.fixture(scope="session")
def tiny_models():
    return tiny_pair()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return TinyTokenizer.from_config(TINY)


# --- the real pair's draft and tokenizer, loaded once per worker ---------------
# Every real-pair test drafts with the same int8 0.5B model (test_real_pair's
# fp32 and int8 targets, test_real_pair_bf16's bf16 one). A loaded model is
# shared read-only (ssd.models), so one copy serves them all.


@pytest.fixture(scope="session")
def real_draft():
    from ssd.config import ModelConfig
    from ssd.models import load_model
    from ssd.models.offline import DRAFT_NAME

    return load_model(ModelConfig(name=DRAFT_NAME, dtype="fp32", quantization="int8"))


@pytest.fixture(scope="session")
def real_tokenizer():
    from ssd.config import ModelConfig
    from ssd.models import load_tokenizer
    from ssd.models.offline import TARGET_NAME

    return load_tokenizer(ModelConfig(name=TARGET_NAME))


# --- one Ray per worker process -------------------------------------------------
# Ray takes ~5 s to start and ~1.5 s to stop. A Cluster started while Ray runs
# joins it and leaves it running (ssd.cluster.runtime), so the files whose
# clusters fit one local Ray ask for `shared_ray`: the first starts Ray the way
# a Cluster would (ssd.cluster.placing.start_ray: the actors at the driver's
# priority), the next ones find it running, and the session stops it. Files
# that need a Ray of their own (simulated nodes, logical GPUs, a Cluster that
# owns its Ray and is checked to stop it) ask for `own_ray` first: it stops a
# shared Ray this worker left running.


@pytest.fixture(scope="session")
def _ray_stopped_at_exit() -> Iterator[None]:
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def shared_ray(_ray_stopped_at_exit) -> Iterator[None]:
    import ray
    from ray.util import placement_group_table

    from ssd.cluster.placing import start_ray

    if not ray.is_initialized():
        start_ray(None)
    yield
    # The module's clusters must have given their cores back, or the next
    # module's would wait for room and fail far from the cause.
    left = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    assert not left, f"placement groups left in the shared Ray: {left}"


@pytest.fixture(scope="module")
def own_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


# --- sharing the machine between pytest-xdist workers ------------------------
# The suite runs on two workers (pyproject: -n 2, whole files per worker).
# Tests marked `cluster` (Ray actors pinned to cores, timings that matter)
# take the machine alone: a worker waits for the other worker's current test
# to end before starting one, and the other worker waits for it in turn.
# Tests marked `slow` (the real pair: gigabytes of memory, one core, two
# while SSD's draft thread runs) run one at a time, never beside a cluster
# test, but beside the other worker's ordinary tests (tiny models, megabytes):
# a slow test only ever needed the memory to itself, and keeping the other
# worker idle for its minutes of compute cost the suite about as long.
# A turnstile keeps a stream of ordinary tests from starving either kind.

EXCLUSIVE_MARKERS = ("cluster",)  # the machine alone
HEAVY_MARKERS = ("slow",)  # one at a time, beside ordinary tests


@contextmanager
def machine_share(exclusive: bool, heavy: bool = False) -> Iterator[None]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")
    base = Path(tempfile.gettempdir()) / f"ssd-tests-{run}"
    with (open(f"{base}.turnstile", "a+") as turnstile, open(f"{base}.machine", "a+") as machine,
          open(f"{base}.heavy", "a+") as heavy_lock):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        if heavy:  # always taken after the machine lock: no two workers wait on each other
            fcntl.flock(heavy_lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(heavy_lock, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_UN)


# --- the order files start in ---------------------------------------------------
# pytest-xdist hands whole files to the workers in collection order (pyproject:
# --no-loadscope-reorder; its default order is by test count). The files that
# take a minute or more start first, longest first, so that neither worker is
# left running one alone at the end; the two real-pair files apart, as only one
# slow test runs at a time. Files with cluster tests come last: they take the
# machine alone wherever they run, and the Ray they share (shared_ray) then
# idles beside no ordinary test; those that share it before those that stop
# it (own_ray). Every other file keeps pytest's order.
# Measured times on this 2-core machine: docs/architecture.md.

LONGEST_FIRST = (
    "test_real_pair.py", "test_ssd_distribution.py", "test_batch_ssd.py", "test_ssd.py", "test_http.py",
    "test_real_pair_bf16.py", "test_threads.py", "test_llamacpp_distribution.py", "test_distribution.py",
    "test_tp.py", "test_models.py", "test_gpu_smoke.py", "test_quant.py", "test_ablation.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    clustered = {item.path for item in items if item.get_closest_marker("cluster")}
    own_ray = {item.path for item in items if "own_ray" in getattr(item, "fixturenames", ())}

    def place(item: pytest.Item) -> tuple[int, int]:
        if item.path in clustered:
            return 2, int(item.path in own_ray)
        return (0, first[item.path.name]) if item.path.name in first else (1, 0)

    items.sort(key=place)  # stable: each file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of each test under the machine lock (module
    fixtures, e.g. a started cluster, are set up inside their first test's)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    exclusive = any(item.get_closest_marker(name) for name in EXCLUSIVE_MARKERS)
    heavy = any(item.get_closest_marker(name) for name in HEAVY_MARKERS)
    with machine_share(exclusive, heavy):
        yield
