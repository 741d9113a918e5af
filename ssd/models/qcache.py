"""A disk cache of int8-quantized models: a restart reads the int8 weights instead
of re-reading the fp32 checkpoint and quantizing it again.

Why. The 1.5B target's fp32 checkpoint is 7 GB; reading it and quantizing every
Linear takes tens of seconds on a CPU host, and a target that crashed pays it
again before it serves. The int8 form is a quarter of the Linear bytes and
needs no quantization: it loads in seconds.

What is stored. An Int8Linear keeps its weights packed for fbgemm, an opaque
object that no file format holds; its int8 values and fp64 per-channel scales
(`Int8Linear.int8_weight`) are plain tensors that rebuild it bit for bit. The
safetensors file holds, for an Int8Linear at path P, `P.int8`, `P.scale` and
`P.bias` (if any), and every other tensor of the model under its own name:
parameters, persistent buffers, and the non-persistent buffers the model
computes when built (rotary `inv_freq`), which a skeleton on the meta device
lacks. The layers are stored unfused; `load_model` fuses after loading, as it
does after quantizing, so both paths end in the same code.

Key. A file's name carries a sha256 over the storage format, the torch version
(the int8 layout and kernels are torch's) and a fingerprint of the checkpoint:
config.json's bytes and each weight file's name, size and mtime. Hashing the
weights themselves would read 7 GB, which is the cost the cache removes; a
rewritten checkpoint gets a new mtime, hence a new key.

Safety. A file is written under a temporary name beside its final one and
renamed into place, so a complete file or none stands at the final name; a
lock per file makes concurrent starts of one model (replicas, a restart racing
a start) quantize once while the others wait and then read. A file that fails
to load (truncated, foreign, of another shape) is reported, replaced and the
model quantized from the checkpoint. `model.cache_quantized: false` or
SSD_QUANT_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ssd.models.offline import _locked, cache_dir
from ssd.models.quant import Int8Linear

logger = logging.getLogger(__name__)

FORMAT = "ssd-int8-per-row/1"  # bump when what a file holds, or how a layer is rebuilt, changes
ENV_SWITCH = "SSD_QUANT_CACHE"  # "0" turns the cache off for a process
_INT8, _SCALE = "int8", "scale"


def enabled(configured: bool = True) -> bool:
    return configured and os.environ.get(ENV_SWITCH, "1") != "0"


def quantized_dir(root: Path | None = None) -> Path:
    return (root if root is not None else cache_dir()) / "quantized"


# Files that hold a checkpoint's weights (safetensors, or PyTorch pickles).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(directory: Path) -> list[Path]:
    """The weight files under `directory`, sorted."""
    return sorted(f for f in directory.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def entry_path(source: Path, root: Path | None = None) -> Path:
    """Where the int8 form of the checkpoint in `source` is cached (whether or not it exists)."""
    digest = hashlib.sha256(f"{FORMAT}|torch {torch.__version__}|{fingerprint(source)}".encode())
    return quantized_dir(root) / f"{source.name}-int8-{digest.hexdigest()[:16]}.safetensors"


def fingerprint(source: Path) -> str:
    """config.json's bytes and each weight file's name, size and mtime: cheap, and changed by any rewrite."""
    digest = hashlib.sha256((source / "config.json").read_bytes())
    for path in weight_files(source):
        stat = path.stat()  # follows symlinks (the hub cache links to blobs)
        digest.update(f"{path.relative_to(source)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cached_int8(source: Path, quantize: Callable[[], nn.Module], root: Path | None = None) -> nn.Module:
    """The int8 model of checkpoint directory `source`: read from the cache, else `quantize()`d and stored.

    `quantize` returns the model with every Linear an Int8Linear, not yet fused.
    """
    path = entry_path(source, root)
    model = _load_or_none(path, source)
    if model is not None:
        return model
    with contextlib.ExitStack() as stack:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_locked(path.parent / f".{path.name}.lock"))
        except OSError as exc:  # a read-only cache folder costs the cache, not the start
            logger.warning("int8 cache folder %s unusable (%s); quantizing without it", path.parent, exc)
            return quantize()
        model = _load_or_none(path, source)  # written by another process while we waited
        if model is not None:
            return model
        path.unlink(missing_ok=True)  # a bad file: replaced below, or at least not read again
        model = quantize()
        _store(model, path, source)
    return model


def _load_or_none(path: Path, source: Path) -> nn.Module | None:
    if not path.is_file():
        return None
    started = time.perf_counter()
    try:
        model = load_int8(path, source)
    except Exception as exc:  # noqa: BLE001 - any unreadable file means: quantize from the checkpoint
        logger.warning("int8 cache %s is unusable (%s: %s); quantizing %s again",
                       path, type(exc).__name__, exc, source)
        return None
    logger.info("int8 weights of %s read from %s in %.1f s", source.name, path, time.perf_counter() - started)
    return model


def _store(model: nn.Module, path: Path, source: Path) -> None:
    """Write `model`'s int8 form to `path` atomically; a failed write (disk full) only costs the cache."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a killed writer; we hold the lock
        stale.unlink(missing_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(handle)
    try:
        save_file(int8_tensors(model), tmp, metadata={"format": FORMAT, "torch": torch.__version__,
                                                      "source": str(source), "key": path.name})
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 - disk full (an OSError, or safetensors' own error): the cache is optional
        logger.warning("could not write the int8 cache %s (%s); the next start quantizes again", path, exc)
        Path(tmp).unlink(missing_ok=True)
        return
    logger.info("int8 weights of %s cached in %s (%.1f GB, %.1f s)", source.name, path,
                path.stat().st_size / 1e9, time.perf_counter() - started)


def int8_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor `load_int8` needs to rebuild `model`, under its module path (see the module doc)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, Int8Linear):
            tensors[f"{dot}{_INT8}"], tensors[f"{dot}{_SCALE}"] = module.int8_weight()
            if module.bias is not None:
                tensors[f"{dot}bias"] = module.bias
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None:
                continue
            # safetensors refuses tensors that share memory; a copy is rare and small (tied buffers)
            tensors[f"{dot}{name}"] = tensor.detach().clone() if tensor.data_ptr() in seen else tensor.detach()
            seen.add(tensor.data_ptr())
    return tensors


def load_int8(path: Path, source: Path) -> nn.Module:
    """The model stored at `path`, rebuilt on a meta-device skeleton of `source`'s config.

    Raises if the file does not hold exactly the tensors the skeleton needs.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != FORMAT or metadata.get("key") != path.name:
        raise ValueError(f"not an {FORMAT} file for this key: {metadata}")
    tensors = load_file(str(path))
    model = _skeleton(source)
    for name in [n for n in tensors if n.endswith(f".{_INT8}")]:
        prefix = name[: -len(_INT8) - 1]
        bias = tensors.pop(f"{prefix}.bias", None)
        layer = Int8Linear.from_int8(tensors.pop(name), tensors.pop(f"{prefix}.{_SCALE}"), bias)
        _expect_linear(model, prefix, layer)
        owner, _, leaf = prefix.rpartition(".")
        setattr(model.get_submodule(owner), leaf, layer)
    for name, tensor in tensors.items():
        _assign(model, name, tensor)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{len(left)} tensors missing from the file, e.g. {left[:3]}")
    return model


def _skeleton(source: Path) -> nn.Module:
    """`source`'s model with every tensor on the meta device: built from its config, nothing allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.name_or_path = str(source)  # as from_pretrained sets it
    if (source / "generation_config.json").is_file():  # EOS ids (ssd.models.tokenizer.eos_token_ids)
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model


def _expect_linear(model: nn.Module, prefix: str, layer: Int8Linear) -> None:
    linear = model.get_submodule(prefix)
    if type(linear) is not nn.Linear or (linear.out_features, linear.in_features) != (
        layer.out_features, layer.in_features
    ):
        raise ValueError(f"{prefix}: the file has an int8 [{layer.out_features}, {layer.in_features}] "
                         f"layer where the model has {linear}")


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    current = owner._parameters.get(leaf, owner._buffers.get(leaf))
    if current is None or current.shape != tensor.shape or current.dtype != tensor.dtype:
        raise ValueError(f"{name}: the file has {tuple(tensor.shape)} {tensor.dtype}, the model "
                         f"{None if current is None else (tuple(current.shape), current.dtype)}")
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor
