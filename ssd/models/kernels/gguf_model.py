"""A transformers Qwen2 model whose linear layers compute on a GGUF file's own k-quant blocks.

`load_gguf_model(path)` reads the file once: the config from its metadata, each Q4_K / Q6_K weight repacked into a QLinear
(ssd.models.kernels.qlinear; q/k/v and gate/up also fused, sharing the same
buffers), everything else (embedding, norms, biases) dequantized to fp32. The
model then runs through the lean forward (ssd.models.fast) like any torch
model, so the engines, the KV cache, tree drafting and the exactness machinery
are the torch backend's. Linear weights of another type (or whose input size
is not a multiple of 256) are dequantized to fp32 nn.Linear layers, and the
load says how many.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ssd.models.kernels.build import load
from ssd.models.kernels.qlinear import QLinear, supported

log = logging.getLogger(__name__)

ARCHITECTURES = ("qwen2",)


class GGUFModelError(ValueError):
    """The file is not a model these kernels can run; the message says why."""


def load_gguf_model(path: str | Path) -> nn.Module:
    """The model in `path`, from the repacked copy in the cache when there is one (about a second;
    the first load reads, dequantizes and repacks for ~30 s on one core, then stores it)."""
    path = Path(path)
    cached = cache_path(path)
    if cached.is_file():
        try:
            return torch.load(cached, mmap=True, weights_only=False)
        except Exception as exc:  # a damaged or foreign file costs a rebuild, never the load
            log.warning("%s: unreadable (%s); rebuilding from %s", cached, exc, path.name)
    model = _read(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        torch.save(model, partial)
        os.replace(partial, cached)  # atomic: a concurrent writer stored the same model
    except OSError as exc:
        log.warning("could not keep the repacked model in %s: %s", cached.parent, exc)
    return model


def cache_path(path: Path) -> Path:
    """Where the repacked model of GGUF file `path` is kept: per file, layout code and torch version."""
    from ssd.models.kernels.build import cache_dir

    stat = path.stat()
    code = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("qlinear.py", "gguf_model.py"))
    key = hashlib.sha256(repr((str(path.resolve()), stat.st_size, stat.st_mtime_ns, torch.__version__)).encode()
                         + code).hexdigest()[:20]
    return cache_dir() / "models" / f"{path.stem}-{key}.pt"


def _read(path: Path) -> nn.Module:
    import gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    config = Qwen2Config(**_config_fields(reader, tensors, path), attn_implementation="sdpa")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    fallback = _fill(model, tensors, names)
    if config.tie_word_embeddings:
        model.lm_head = _linear(tensors["token_embd.weight"], None)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers, on the CPU
    _fuse(model)
    if fallback:
        log.warning("%s: %d linear layers are of types the kernels lack (%s); they run in fp32",
                    path.name, len(fallback), ", ".join(sorted(fallback)[:4]))
    model.eval().requires_grad_(False)
    return model


def _config_fields(reader, tensors: dict, path: Path) -> dict:
    """Qwen2Config's fields from the file's metadata (llama.cpp's key names)."""
    def field(key: str, default=None):
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFModelError(f"{path.name}: architecture {arch!r}; the GGUF kernels run "
                             f"{', '.join(ARCHITECTURES)} (use model.backend llamacpp)")
    fields = {
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
    }
    missing = [name for name, value in fields.items() if value is None and not name.endswith("token_id")]
    if missing:
        raise GGUFModelError(f"{path.name}: no {', '.join(missing)} in its metadata")
    return fields


def _fill(model: nn.Module, tensors: dict, names) -> set[str]:
    """Every parameter of `model` from the file; returns the GGUF names of linears left in fp32."""
    fallback = set()
    for module_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            weight = tensors.get(names.get_name(f"{module_name}.weight", try_suffixes=(".weight",)) or "")
            if weight is None:
                continue  # a tied head, set by the caller
            bias_name = names.get_name(f"{module_name}.bias", try_suffixes=(".bias",))
            bias = _dense(tensors[bias_name]) if bias_name in tensors else None
            layer = _linear(weight, bias)
            if not isinstance(layer, QLinear):
                fallback.add(weight.name)
            _set(model, module_name, layer)
        elif not list(module.children()) and list(module.parameters(recurse=False)):
            for param_name, _ in list(module.named_parameters(recurse=False)):
                full = f"{module_name}.{param_name}"
                name = names.get_name(full, try_suffixes=(".weight", ".bias"))
                if name not in tensors:
                    raise GGUFModelError(f"no tensor for {full} in the file")
                setattr(module, param_name, nn.Parameter(_dense(tensors[name]), requires_grad=False))
    return fallback


def _linear(tensor, bias: torch.Tensor | None) -> nn.Module:
    raw = np.asarray(tensor.data)
    in_features = int(tensor.shape[0])
    if supported(tensor.tensor_type, in_features):
        return QLinear.from_gguf(tensor.tensor_type, raw, bias)
    weight = _dense(tensor)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _dense(tensor) -> torch.Tensor:
    """A GGUF tensor as fp32, [out, in] for matrices (numpy's order is already the torch order)."""
    from gguf.quants import dequantize

    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one fused layer (one quantization of x) and
    the SiLU and product in C (attention.c's ssd_silu_mul: what layer.c computes, bit for bit)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = QLinear.fuse([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, split=False)
        inter = gate_up.shape[-1] // 2
        act = torch.empty((*gate_up.shape[:-1], inter), dtype=torch.float32)
        load().ssd_silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, act.data_ptr())
        return self.down_proj(act)


def _fuse(model: nn.Module) -> None:
    """q/k/v as one QLinear (`qkv_proj`, which the lean forward calls) beside the separate layers
    (transformers' own attention calls them one by one; same buffers), and gate/up as one. Each
    RMSNorm moves into the layers that read its output (QLinear.normalize), its own place an
    identity, so both forwards normalize once per layer, in C."""
    for layer in model.model.layers:
        attn = layer.self_attn
        projections = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(p, QLinear) for p in projections):
            attn.qkv_proj = QLinear.fuse(projections)
            for p in [*projections, attn.qkv_proj]:
                p.normalize(layer.input_layernorm)
            layer.input_layernorm = nn.Identity()
        if (all(isinstance(getattr(layer.mlp, n), QLinear) for n in ("gate_proj", "up_proj", "down_proj"))
                and model.config.hidden_act == "silu"):
            layer.mlp = GatedMLP(layer.mlp)
            layer.mlp.gate_up_proj.normalize(layer.post_attention_layernorm)
            layer.post_attention_layernorm = nn.Identity()
    if isinstance(model.lm_head, QLinear):
        model.lm_head.normalize(model.model.norm)
        model.model.norm = nn.Identity()


def uses_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, QLinear) for m in model.modules())
