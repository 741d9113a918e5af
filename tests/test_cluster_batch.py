"""The cluster's batch engine (ssd.cluster.batch.RemoteBatchEngine) while its
target restarts, against a stand-in for the cluster: no Ray actors run."""

from __future__ import annotations

import time

import pytest
import ray

import ssd.cluster.batch as batch_module
from ssd.cluster.batch import RemoteBatchEngine
from ssd.config import GenerationConfig, SamplingConfig
from ssd.engine.request import GenerationRequest, GeneratorUnavailable


class Call:
    def remote(self, *args):
        return "ref"


class DeadTarget:
    def __getattr__(self, method: str) -> Call:
        return Call()


class RestartingCluster:
    """A TargetHost whose target was lost and is not back yet."""

    name = "stand-in"
    targets = [DeadTarget()]
    target_restarts = 0

    def __init__(self) -> None:
        self.serving = True  # until the first call finds the target gone

    def wait_serving(self) -> None:
        """As the cluster's: block while the target restarts, up to RECOVERY_WAIT_S."""
        deadline = time.monotonic() + batch_module.RECOVERY_WAIT_S
        while not self.serving:
            if time.monotonic() > deadline:
                raise GeneratorUnavailable("the target is not back")
            time.sleep(0.01)

    def target_lost(self, why: str) -> None:
        self.serving = False

    def forward_failure(self, incarnation: int) -> str | None:
        return None  # a lost actor, not a failed tensor-parallel forward: rows that streamed nothing run again

    def look_now(self) -> None:
        pass


@pytest.fixture
def waiting(monkeypatch):
    """An engine holding one request that streamed nothing when the target was lost."""

    def lost(ref, timeout=None):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(batch_module.ray, "get", lost)
    cancel = []
    request = GenerationRequest([1, 2], SamplingConfig(), GenerationConfig(max_new_tokens=4),
                                cancelled=lambda: bool(cancel))
    engine = RemoteBatchEngine(RestartingCluster(), "ar")
    engine.admit(request)
    assert engine.rows == 1 and not engine.cluster.serving
    return engine, request, cancel


def test_a_request_waiting_for_the_restart_leaves_at_once_when_cancelled(waiting, monkeypatch):
    engine, request, cancel = waiting
    monkeypatch.setattr(batch_module, "RECOVERY_WAIT_S", 2.0)
    started = time.monotonic()
    assert engine.step() == [] and engine.rows == 1  # still waiting
    assert time.monotonic() - started < 0.5  # the step returned: it did not block on the restart
    cancel.append(True)
    started = time.monotonic()
    (finished,) = engine.step()
    assert time.monotonic() - started < 0.05
    assert finished.request is request and finished.result is None and finished.error is None  # aborted
    assert engine.rows == 0


def test_a_request_waits_for_the_restart_no_longer_than_recovery_wait_s(waiting, monkeypatch):
    engine, _, _ = waiting
    monkeypatch.setattr(batch_module, "RECOVERY_WAIT_S", 0.15)
    assert engine.step() == []
    time.sleep(0.2)
    with pytest.raises(GeneratorUnavailable, match="not back"):
        engine.step()
