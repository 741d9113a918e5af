"""The int8 cache (ssd.models.qcache): a model read back from it computes the very
logits of the freshly quantized one, and a bad, missing or disabled cache only
costs a quantization."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ssd.config import ModelConfig, TinyModelConfig
from ssd.models import build_tiny_model, load_model, loading, qcache
from ssd.models.quant import FusedGateUpMLP, Int8Linear, int8_supported, quantize_int8

# Only what quantizes or runs int8 matmuls needs the kernels (quantize_int8 refuses without
# them); the cache's key and the command-line switch are checked everywhere.
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="needs torch's x86 int8 kernels")

TCFG = TinyModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, seed=3)
EOS = [5, 7]
IDS = torch.tensor([[1, 2, 3, 4, 9, 30, 0, 17]])


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny fp32 checkpoint directory, and an empty cache root for the test."""
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(qcache.ENV_SWITCH, raising=False)
    model = build_tiny_model(TCFG)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(tmp_path / "tiny-ckpt", safe_serialization=True)
    return tmp_path / "tiny-ckpt"


def int8(source: Path, **fields) -> torch.nn.Module:
    return load_model(ModelConfig(name=str(source), quantization="int8", **fields))


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(IDS).logits


def entry(source: Path) -> Path:
    return qcache.entry_path(source)


def forbid_quantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("read the fp32 checkpoint: the cache was not used")

    monkeypatch.setattr(loading, "_from_pretrained", refuse)


@needs_int8
def test_cached_model_gives_bit_identical_logits(checkpoint, monkeypatch):
    fresh = int8(checkpoint, cache_quantized=False)
    assert not entry(checkpoint).exists()
    first = int8(checkpoint)  # quantizes and writes the cache
    assert entry(checkpoint).is_file()
    forbid_quantizing(monkeypatch)
    cached = int8(checkpoint)
    assert torch.equal(logits(cached), logits(fresh))
    assert torch.equal(logits(first), logits(fresh))
    # Built like the fresh one: fused, row attention, frozen, the checkpoint's EOS ids.
    assert isinstance(cached.model.layers[0].mlp, FusedGateUpMLP)
    assert cached.config._attn_implementation == fresh.config._attn_implementation
    assert not any(p.requires_grad for p in cached.parameters()) and not cached.training
    assert list(cached.generation_config.eos_token_id) == EOS
    assert not any(t.is_meta for t in [*cached.parameters(), *cached.buffers()])


@needs_int8
def test_file_holds_int8_weights_not_fp32(checkpoint):
    model = quantize_int8(build_tiny_model(TCFG))
    tensors = qcache.int8_tensors(model)
    assert tensors["lm_head.int8"].dtype == torch.int8
    assert tensors["lm_head.scale"].dtype == torch.float64
    assert "model.layers.0.self_attn.q_proj.bias" in tensors  # Qwen2's q/k/v carry biases
    assert "model.rotary_emb.inv_freq" in tensors  # non-persistent: the meta skeleton lacks it
    assert not any(n.endswith("_anchor") for n in tensors)  # Int8Linear rebuilds its own


@needs_int8
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_file_falls_back_to_quantizing(checkpoint, damage, caplog):
    fresh = logits(int8(checkpoint, cache_quantized=False))
    int8(checkpoint)
    path = entry(checkpoint)
    good = path.read_bytes()
    path.write_bytes({"truncated": good[: len(good) // 2], "garbage": os.urandom(4096), "empty": b""}[damage])
    with caplog.at_level(logging.WARNING, logger="ssd.models.qcache"):
        model = int8(checkpoint)
    assert "unusable" in caplog.text
    assert torch.equal(logits(model), fresh)
    assert path.stat().st_size == len(good)  # rewritten: the next start reads it again
    assert torch.equal(logits(loading.use_row_attention(loading.fuse_projections(
        qcache.load_int8(path, checkpoint)))), fresh)


@needs_int8
def test_file_of_another_shape_is_refused(checkpoint, tmp_path):
    """A file whose tensors do not fit the skeleton (here: written for another model) is not loaded."""
    other = build_tiny_model(TinyModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, seed=3))
    int8(checkpoint)
    path = entry(checkpoint)
    from safetensors.torch import save_file

    save_file(qcache.int8_tensors(quantize_int8(other)), path,
              metadata={"format": qcache.FORMAT, "key": path.name})
    with pytest.raises(ValueError, match="the file has"):
        qcache.load_int8(path, checkpoint)
    assert torch.equal(logits(int8(checkpoint)), logits(int8(checkpoint, cache_quantized=False)))


@needs_int8
@pytest.mark.parametrize("switch", ["config", "env"])
def test_cache_can_be_turned_off(checkpoint, monkeypatch, switch):
    if switch == "env":
        monkeypatch.setenv(qcache.ENV_SWITCH, "0")
    int8(checkpoint, cache_quantized=switch != "config")
    assert not qcache.quantized_dir().exists()


def test_key_follows_checkpoint_and_torch_version(checkpoint, monkeypatch):
    before = entry(checkpoint)
    weights = checkpoint / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    rewritten = entry(checkpoint)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert len({before, rewritten, entry(checkpoint)}) == 3


@needs_int8
def test_concurrent_starts_quantize_once(checkpoint):
    """Two loads of one model at once: one quantizes and writes, the other waits and reads."""
    calls: list[float] = []
    results: dict[int, torch.nn.Module] = {}

    def quantize() -> torch.nn.Module:
        calls.append(time.monotonic())
        time.sleep(0.5)  # long enough that the other thread arrives while this one holds the lock
        return quantize_int8(loading._from_pretrained(str(checkpoint), torch.float32))

    def start(n: int) -> None:
        results[n] = qcache.cached_int8(checkpoint, quantize)

    threads = [threading.Thread(target=start, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    a, b = (loading.use_row_attention(loading.fuse_projections(results[n])).eval() for n in range(2))
    assert torch.equal(logits(a), logits(b))


@needs_int8
def test_stale_temp_file_is_cleared(checkpoint):
    path = entry(checkpoint)
    path.parent.mkdir(parents=True)
    stale = path.parent / f".{path.name}.tmp-killed"
    stale.write_bytes(b"half a file")
    int8(checkpoint)
    assert not stale.exists() and path.is_file()


@needs_int8
def test_layers_round_trip_through_plain_tensors():
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(64, 48))
    ints, scales = layer.int8_weight()
    again = Int8Linear.from_int8(ints.clone(), scales.clone(), layer.bias.clone())
    x = torch.randn(5, 64)
    assert torch.equal(again(x), layer(x))


def test_no_quant_cache_flag_turns_it_off_for_both_models():
    import argparse

    from ssd.app.cli import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    on = config_from_args(parser.parse_args(["--target-precision", "int8"]))
    off = config_from_args(parser.parse_args(["--no-quant-cache", "--target-precision", "int8"]))
    assert on.target.cache_quantized and on.draft.cache_quantized
    assert not off.target.cache_quantized and not off.draft.cache_quantized
    assert off.target.quantization == "int8"  # the precision override kept beside it


@needs_int8
def test_unwritable_cache_folder_only_costs_the_cache(checkpoint, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SSD_CACHE_DIR", str(blocker))  # <file>/quantized cannot be created
    with caplog.at_level(logging.WARNING, logger="ssd.models.qcache"):
        model = int8(checkpoint)
    assert "unusable" in caplog.text
    assert torch.equal(logits(model), logits(int8(checkpoint, cache_quantized=False)))
