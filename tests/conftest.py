"""Shared fixtures: a tiny target and a tiny draft that agrees with it often."""

from __future__ import annotations

import contextlib
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


def static_ssd(config):
    """`config` with SSD's builds at a fixed budget and the draft's entries only (no
    anytime cut, no free n-gram entries): for tests that compare an SSD request's
    counts with another run of it, which an anytime build's timing would change."""
    import dataclasses

    spec = config.speculation
    fanout = dataclasses.replace(spec.fanout, anytime=False)
    return dataclasses.replace(config, speculation=dataclasses.replace(spec, fanout=fanout, ngram_candidates=False))


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


# --- two workers, two lanes -------------------------------------------------------
# The suite runs on two pytest-xdist workers (pyproject: -n 2 --dist loadfile).
# Tests marked `slow` (the real pair: gigabytes of memory) and `cluster` (Ray
# actors pinned to cores 0 and 1, a Ray per worker, ports) must not run two of
# a kind at once. Each kind is a lane: all the files holding its tests form one
# unit of work that one worker runs start to end, its tests one after another
# (pytest_xdist_make_scheduler below), while the other worker runs the other
# lane, then ordinary files (tiny models, one thread each), whole files each.
# A lock per kind (machine_share) holds the same rule wherever the lanes do not
# apply (another --dist, more workers).
#
# Before, both kinds took the machine alone and the other worker idled through
# them: about 6 minutes of real-pair compute on one core, and about 8 minutes of
# clusters waiting for actor processes to import torch and transformers.

LANES = {  # kind -> its files, in the order they run; a file with a test of that kind must be listed
    "cluster": ("test_cluster.py", "test_cluster_llamacpp.py", "test_cluster_plan.py", "test_cluster_tp.py",
                "test_bench_load.py", "test_cluster_gpu.py", "test_faults.py", "test_multinode.py"),
    "slow": ("test_real_pair.py", "test_real_pair_bf16.py", "test_real_pair_llamacpp.py", "test_real_pair_http.py",
             "test_models.py"),
}
LANE_OF = {name: kind for kind, names in LANES.items() for name in names}

# Ordinary files that take a minute or so start first, longest first, so that
# neither worker is left running one alone at the end; the rest keep pytest's order.
LONGEST_FIRST = (
    "test_ssd_distribution.py", "test_coupling.py", "test_openai_api.py", "test_batch_ssd.py", "test_ssd.py",
    "test_http.py", "test_processing.py", "test_threads.py",
    "test_llamacpp_distribution.py", "test_distribution.py", "test_tp.py", "test_gpu_smoke.py", "test_quant.py",
    "test_ablation.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lanes first (the longer, cluster, first), then the ordinary files."""
    for item in items:
        for kind in LANES:
            if item.get_closest_marker(kind) and LANE_OF.get(item.path.name) != kind:
                raise pytest.UsageError(f"{item.path.name} has {kind} tests: list it in LANES['{kind}'] "
                                        f"(tests/conftest.py)")
    lanes = {name: rank for rank, name in enumerate(n for names in LANES.values() for n in names)}
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}

    def place(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in lanes:
            return 0, lanes[name]
        return (1, first[name]) if name in first else (2, 0)

    items.sort(key=place)  # stable: each file's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile, but each lane's files are one unit of work (one worker runs them in order).

    Units go out in collection order (--no-loadscope-reorder): the two lanes first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LaneScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            kind = LANE_OF.get(Path(path).name)
            return f"lane:{kind}" if kind else path

    return LaneScheduling(config, log)


@contextmanager
def machine_share(kinds: list[str]) -> Iterator[None]:
    """One test of each of `kinds` at a time across the workers of this run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")
    base = Path(tempfile.gettempdir()) / f"ssd-tests-{run}"
    with contextlib.ExitStack() as held:
        for kind in sorted(kinds):  # one order: no two workers wait on each other
            lock = held.enter_context(open(f"{base}.{kind}", "a+"))
            fcntl.flock(lock, fcntl.LOCK_EX)
            held.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown of each test under its kind's lock (module
    fixtures, e.g. a started cluster, are set up inside their first test's)."""
    kinds = [kind for kind in LANES if item.get_closest_marker(kind)]
    if "PYTEST_XDIST_WORKER" not in os.environ or not kinds:
        yield
        return
    with machine_share(kinds):
        yield


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count `n` inside the block (the GGUF kernels' products and llama.cpp's
    contexts follow it), the caller's again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
