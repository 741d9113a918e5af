"""Cluster start-up: models are fetched once in the driver, before any actor
starts, and the actors' load timeout scales with the model (or is configured)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ssd.cluster import placing, runtime
from ssd.cluster.devices import plan_placement
from ssd.config import ClusterConfig, ConfigError, load_config
from ssd.models import loading
from tests.conftest import ROOT

CONFIG = load_config(ROOT / "configs" / "tiny-cluster.yaml")


def weights(directory: Path, nbytes: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"\0" * nbytes)
    (directory / "config.json").write_text("{}")
    return directory


def test_a_hub_model_is_downloaded_once_and_sized(tmp_path, monkeypatch):
    import huggingface_hub

    downloads = []

    def snapshot_download(name, **kwargs):
        downloads.append(name)
        return str(weights(tmp_path / "snapshot", 4096))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert loading.prefetch("some-org/some-model") == 4096
    assert downloads == ["some-org/some-model"]
    assert loading.prefetch(str(weights(tmp_path / "local", 100))) == 100 and len(downloads) == 1  # no download
    assert loading.prefetch("tiny") == 0


def test_the_load_timeout_scales_with_the_weights_or_is_configured():
    assert placing.start_timeout_s(CONFIG, 0) == placing.START_TIMEOUT_S
    big = placing.start_timeout_s(CONFIG, 140 * 10**9)  # a 70B model in bf16
    assert big >= placing.START_TIMEOUT_S + 1400
    configured = dataclasses.replace(CONFIG, cluster=dataclasses.replace(CONFIG.cluster, start_timeout_s=7200.0))
    assert placing.start_timeout_s(configured, 140 * 10**9) == 7200.0
    with pytest.raises(ConfigError, match="start_timeout_s"):
        ClusterConfig(start_timeout_s=0)


def test_the_driver_fetches_before_any_actor_starts(monkeypatch):
    class Stop(Exception):
        pass

    calls = []

    def reserve(self, *args):
        calls.append("reserve")
        raise Stop

    monkeypatch.setattr(runtime, "prefetch_models", lambda config, with_draft, device: calls.append("prefetch") or {})
    monkeypatch.setattr(runtime.Cluster, "_reserve", reserve)
    monkeypatch.setattr(runtime.ray, "is_initialized", lambda: True)  # no Ray is started
    with pytest.raises(Stop):
        runtime.Cluster(CONFIG, plan_placement("0", "1", 2, "cpu"))
    assert calls == ["prefetch", "reserve"]
