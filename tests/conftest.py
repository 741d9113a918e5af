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
# Tests marked `cluster` (Ray actors at nice 15, timings that matter) or
# `slow` (the real pair: gigabytes of memory) take the machine alone: a
# worker waits for the other worker's current test to end before starting
# one, and the other worker waits for it in turn. A turnstile keeps a stream
# of ordinary tests from starving them.

EXCLUSIVE_MARKERS = ("cluster", "slow")


@contextmanager
def machine_share(exclusive: bool) -> Iterator[None]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")
    base = Path(tempfile.gettempdir()) / f"ssd-tests-{run}"
    with open(f"{base}.turnstile", "a+") as turnstile, open(f"{base}.machine", "a+") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of each test under the machine lock (module
    fixtures, e.g. a started cluster, are set up inside their first test's)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    exclusive = any(item.get_closest_marker(name) for name in EXCLUSIVE_MARKERS)
    with machine_share(exclusive):
        yield
