"""Model loading: tiny models, TinyTokenizer, the offline registry's errors, and (slow) the real pair."""

from __future__ import annotations

import hashlib
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ssd.config import ConfigError, ModelConfig, TinyModelConfig
from ssd.models.quant import precision_of
from ssd.models import (
    ModelAssetError,
    TinyTokenizer,
    build_tiny_model,
    load_model,
    load_tokenizer,
)
from ssd.models.offline import (
    DRAFT_NAME,
    OFFLINE_MODELS,
    TARGET_NAME,
    OfflineModel,
    assemble,
    ensure_offline_model,
    locate_parts,
)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- tiny models


def test_same_seed_same_weights() -> None:
    a = _weights(build_tiny_model(TinyModelConfig(seed=3)))
    b = _weights(build_tiny_model(TinyModelConfig(seed=3)))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seeds_differ() -> None:
    a = _weights(build_tiny_model(TinyModelConfig(seed=0)))
    b = _weights(build_tiny_model(TinyModelConfig(seed=1)))
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_building_leaves_global_rng_alone() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)
    build_tiny_model(TinyModelConfig(seed=7))
    assert torch.equal(torch.rand(5), expected)


def test_tiny_model_shape_and_untied_head() -> None:
    tcfg = TinyModelConfig(vocab_size=20, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    model = build_tiny_model(tcfg)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 20)


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp64", torch.float64)])
def test_load_model_honours_dtype(name: str, dtype: torch.dtype) -> None:
    model = load_model(ModelConfig(name="tiny", dtype=name))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model(input_ids=torch.tensor([[0, 1]])).logits.dtype == dtype


def test_dtypes_share_weights_up_to_rounding() -> None:
    w64 = load_model(ModelConfig(name="tiny", dtype="fp64")).lm_head.weight
    w32 = load_model(ModelConfig(name="tiny", dtype="fp32")).lm_head.weight
    assert torch.equal(w64.float(), w32)


def test_loaded_model_is_frozen_and_in_eval_mode() -> None:
    model = load_model(ModelConfig(name="tiny"))
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_int8_quantization_runs_and_is_close() -> None:
    # The tiny models' large init (0.5) makes activations large, so int8 errors
    # are ~10-20% here; "close" means far closer than a different model.
    tcfg = TinyModelConfig(hidden_size=64, intermediate_size=128, seed=2)
    ids = torch.tensor([[0, 5, 3, 9, 2, 7, 1, 4]])
    reference = load_model(ModelConfig(name="tiny", tiny=tcfg))(input_ids=ids).logits
    other = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128, seed=3))(input_ids=ids).logits
    quantized = load_model(ModelConfig(name="tiny", quantization="int8", tiny=tcfg))
    assert precision_of(quantized) == "int8"
    logits = quantized(input_ids=ids).logits
    assert logits.dtype == torch.float32
    error = (logits - reference).norm() / reference.norm()
    assert error < 0.3
    assert error < 0.3 * (other - reference).norm() / reference.norm()
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.9


def test_int8_refuses_non_fp32_dtype() -> None:
    with pytest.raises(ConfigError, match="fp32"):
        load_model(ModelConfig(name="tiny", dtype="bf16", quantization="int8"))


def test_unknown_name_error_says_what_was_tried(tmp_path: Path) -> None:
    # An invalid hub id fails validation without touching the network.
    name = str(tmp_path / "no such dir" / "x y")
    with pytest.raises(ModelAssetError, match="not an offline registry name.*not a local directory"):
        load_model(ModelConfig(name=name))


# --------------------------------------------------------------------------- TinyTokenizer


def test_tiny_tokenizer_round_trip() -> None:
    tok = TinyTokenizer(vocab_size=16)
    ids = list(range(16))
    text = tok.decode(ids)
    assert len(text) == 16 and text.startswith("abc")
    assert tok.encode(text) == ids
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(3) == "d"


def test_tiny_tokenizer_large_vocab_is_a_bijection() -> None:
    tok = TinyTokenizer(vocab_size=500)
    text = tok.decode(range(500))
    assert len(set(text)) == 500 and all(ch.isprintable() or ch == "\n" for ch in text)
    assert tok.encode(text) == list(range(500))


def test_tiny_tokenizer_eos_and_special_tokens() -> None:
    tok = load_tokenizer(ModelConfig(name="tiny", tiny=TinyModelConfig(eos_token_id=2)))
    assert tok.eos_token_id == 2 and tok.vocab_size == 16 and len(tok) == 16
    assert tok.decode([0, 2, 1]) == "acb"
    assert tok.decode([0, 2, 1], skip_special_tokens=True) == "ab"
    assert TinyTokenizer(16).eos_token_id is None


def test_tiny_tokenizer_rejects_unknown_characters() -> None:
    with pytest.raises(ValueError, match="'z'"):
        TinyTokenizer(vocab_size=16).encode("abz")


# --------------------------------------------------------------------------- offline registry


def _fake_package(root: Path, module: str, dist: str, version: str, payload: bytes, part: int) -> None:
    """A module with get_part_path() and dist-info metadata, like the real part packages."""
    pkg = root / module
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / f"part{part:02d}.bin").write_bytes(payload)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import os
            def get_part_path():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{part:02d}.bin")
            """
        )
    )
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """Three installed fake part packages; returns (entry factory, payloads)."""
    prefix = f"ssdfake{abs(hash(request.node.name)) % 10**8}"
    payloads = [b"alpha" * 100, b"beta" * 100, b"gamma" * 7]
    site = tmp_path / "site"
    for i, data in enumerate(payloads, start=1):
        _fake_package(site, f"{prefix}_part{i}", f"{prefix}-part{i}", "0.1.0", data, i)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield prefix, payloads
    for name in [m for m in sys.modules if m.startswith(prefix)]:
        del sys.modules[name]


def _entry(prefix: str, sha256: str, parts: int = 3, version: str = "0.1.0") -> OfflineModel:
    return OfflineModel(
        name="fake-model",
        package_prefix=f"{prefix}-part",
        module_prefix=f"{prefix}_part",
        parts=parts,
        version=version,
        sha256=sha256,
        gguf_filename="fake.gguf",
    )


def test_registry_has_the_default_pair() -> None:
    assert OFFLINE_MODELS[TARGET_NAME].parts == 22
    assert OFFLINE_MODELS[DRAFT_NAME].parts == 6
    with pytest.raises(TypeError):
        OFFLINE_MODELS["x"] = OFFLINE_MODELS[DRAFT_NAME]  # type: ignore[index]


def test_locate_parts_finds_them_in_order(fake_parts) -> None:
    prefix, payloads = fake_parts
    paths = locate_parts(_entry(prefix, "0" * 64))
    assert [p.read_bytes() for p in paths] == payloads


def test_missing_package_names_it_and_the_pip_command(fake_parts, tmp_path: Path) -> None:
    prefix, _ = fake_parts
    entry = _entry(prefix, "0" * 64, parts=5)  # parts 4 and 5 are not installed
    with pytest.raises(ModelAssetError) as info:
        ensure_offline_model("fake-model", registry={"fake-model": entry}, root=tmp_path / "cache")
    message = str(info.value)
    assert f"missing package {prefix}-part4==0.1.0" in message
    assert f"pip install {prefix}-part4==0.1.0" in message
    assert "pip install 'ssd[models]'" in message
    assert not (tmp_path / "cache" / "models" / "fake-model").exists()


def test_wrong_version_is_refused(fake_parts) -> None:
    prefix, _ = fake_parts
    with pytest.raises(ModelAssetError, match=rf"{prefix}-part1 is version 0.1.0, need 9.9.9"):
        locate_parts(_entry(prefix, "0" * 64, version="9.9.9"))


def test_bad_hash_names_expected_and_got(fake_parts, tmp_path: Path) -> None:
    prefix, payloads = fake_parts
    expected = "ab" * 32
    got = hashlib.sha256(b"".join(payloads)).hexdigest()
    cache = tmp_path / "cache"
    with pytest.raises(ModelAssetError) as info:
        ensure_offline_model("fake-model", registry={"fake-model": _entry(prefix, expected)}, root=cache)
    message = str(info.value)
    assert f"expected {expected}" in message and f"got {got}" in message and "fake.gguf" in message
    # Nothing half-built is left behind: no model dir, no work dir, no joined file.
    assert [p.name for p in (cache / "models").iterdir()] == [".fake-model.lock"]


def test_assemble_joins_in_order_and_checks_hash(fake_parts, tmp_path: Path) -> None:
    prefix, payloads = fake_parts
    joined = b"".join(payloads)
    out = tmp_path / "joined.bin"
    assemble(locate_parts(_entry(prefix, "0" * 64)), out, hashlib.sha256(joined).hexdigest())
    assert out.read_bytes() == joined


def test_existing_model_dir_is_used_without_parts(tmp_path: Path) -> None:
    # A complete cached dir short-circuits: no package is even imported.
    done = tmp_path / "models" / "fake-model"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    entry = _entry("ssdfake_not_installed", "0" * 64)
    assert ensure_offline_model("fake-model", registry={"fake-model": entry}, root=tmp_path) == done


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ssd.models.offline import cache_dir, model_dir

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert model_dir("m") == tmp_path / "models" / "m"
    monkeypatch.delenv("SSD_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "ssd"


def test_unknown_registry_name() -> None:
    with pytest.raises(ModelAssetError, match="not an offline model"):
        ensure_offline_model("nope", registry={})


# --------------------------------------------------------------------------- the real pair (slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", [DRAFT_NAME, TARGET_NAME])
def test_real_model_writes_plausible_code(name: str) -> None:
    """Converts on first use (about a minute, ~9 GB peak for the 1.5B), then loads in seconds."""
    cfg = ModelConfig(name=name)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    # The GGUF vocabulary is padded with [PAD...] tokens to the embedding size.
    assert len(tokenizer) == model.config.vocab_size == 151936
    assert tokenizer.encode("<|im_start|>user") == [151644, 872]
    ids = torch.tensor([tokenizer.encode("def fibonacci(n):")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:])
    assert "return" in text or "if n" in text, text
    assert "fibonacci" in text or "n - 1" in text or "n-1" in text or "<=" in text, text


def test_int8_is_refused_on_a_gpu_before_loading():
    with pytest.raises(ConfigError, match="model.quantization int8 runs on CPU only"):
        load_model(ModelConfig(name="tiny", quantization="int8"), device="cuda")


def test_a_checkpoint_loads_straight_onto_its_device(tmp_path: Path, monkeypatch) -> None:
    """On a GPU the weights are read onto it (device_map), never loaded on the host and moved."""
    import transformers

    class NoHostCopy(torch.nn.Module):
        def to(self, *args, **kwargs):
            raise AssertionError("the model was moved after loading: a whole host copy first")

    seen = {}

    def from_pretrained(source, **kwargs):
        seen.update(kwargs)
        return NoHostCopy()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_model(ModelConfig(name=str(tmp_path), dtype="bf16"), "cuda")
    assert seen["device_map"] == "cuda" and seen["dtype"] == torch.bfloat16
    seen.clear()
    load_model(ModelConfig(name=str(tmp_path), dtype="fp32"), "cpu")
    assert "device_map" not in seen  # the CPU path loads as it always did
