"""Random-weight models at a named model's real shapes.

Where the weights cannot travel (a GPU box that reaches no hub and takes a
few MiB of files per run), a model with the released architecture and random
weights still has the real costs and exercises every code path at the real
sizes. configs/models/<name>.yaml holds the architecture fields of the
released config.json; a `RandomModelSpec` adds the seed (and optional
relative noise, for a draft close to its target), so a second process builds
bit-identical weights from the same spec.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def shape_config(name: str) -> dict[str, Any]:
    """The architecture fields of model `name` (configs/models/<name>.yaml)."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no shape config for {name!r} in {CONFIG_DIR} (known: {known})")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must be a mapping of Qwen2Config fields")
    return data


@dataclass(frozen=True)
class RandomModelSpec:
    """Everything that decides a random model's weights; plain data, so it travels in a message."""

    config: dict[str, Any] = field(hash=False)  # Qwen2Config fields
    seed: int = 0
    noise: float = 0.0  # relative Gaussian noise on every weight: a draft that often agrees with its target
    noise_seed: int = 1
    dtype: str = "fp32"

    def key(self) -> str:
        """A stable identity (for caches of built models)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def with_dtype(self, dtype: str) -> "RandomModelSpec":
        return dataclasses.replace(self, dtype=dtype)


def build_random_model(spec: RandomModelSpec, device: str | torch.device = "cpu", direct: bool = False) -> torch.nn.Module:
    """A Qwen2ForCausalLM with seeded random weights, built directly on `device`, in eval mode.

    Built on the device (not copied there): a 1.5B model initialises in
    milliseconds on a GPU and in tens of seconds on a CPU. Weights are drawn
    in fp32 and then cast, so specs that differ only in dtype agree up to
    rounding. The caller's RNG state is left as it was.

    `direct`: draw in the spec's dtype, module by module (`draw_direct`):
    no fp32 copy, so a 32B target peaks at its bf16 size (~65 GB) instead of
    twice its fp32 size; its weights are not those of the fp32 draw.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device(device)
    if direct:
        return draw_direct(spec, device)
    config = Qwen2Config(**spec.config, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=_rng_devices(device)), torch.device(device):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    if spec.noise:
        perturb_(model, spec.noise, spec.noise_seed)
    model = model.to(DTYPES[spec.dtype]).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def draw_direct(spec: RandomModelSpec, device: str | torch.device) -> torch.nn.Module:
    """`build_random_model(direct=True)`: the model made on the meta device (no memory), then
    each top-level piece (embedding, every decoder layer, final norm, LM head) placed on
    `device` in the spec's dtype and drawn there as transformers initialises Qwen2
    (linear and embedding weights N(0, initializer_range^2), biases 0, norms 1), one
    seeded generator per parameter so the draw does not depend on the order of pieces.
    Peak memory is the model in its dtype plus nothing; noise is added afterwards as in
    `build_random_model`.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device(device)
    config = Qwen2Config(**spec.config, attn_implementation="sdpa")
    dtype = DTYPES[spec.dtype]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    std = float(config.initializer_range)
    gen = torch.Generator(device=device)
    pieces = [model.model.embed_tokens, *model.model.layers, model.model.norm]
    if not config.tie_word_embeddings:
        pieces.append(model.lm_head)
    index = 0
    for piece in pieces:
        piece.to_empty(device=device)
        for name, param in piece.named_parameters():
            gen.manual_seed(spec.seed * 1_000_003 + index)
            index += 1
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # RMSNorm scales
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (the rotary frequencies) stayed on meta: make them anew on the device.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if spec.noise:
        perturb_(model, spec.noise, spec.noise_seed)
    model = model.eval()
    model.requires_grad_(False)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters (a tied LM head counted once): what one decode step reads."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


@torch.no_grad()
def perturb_(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Add N(0, (scale * std(w))^2) to every weight w, drawn on the weights' own device."""
    gens: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        std = param.std() if param.numel() > 1 else param.abs()
        param.add_(torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype) * scale * std)


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> float:
    """One number that differs between differently built models (compare two processes' copies)."""
    return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def rope_theta(model: torch.nn.Module) -> float | None:
    """The rotary base the model runs with (transformers 5 keeps it in rope_parameters)."""
    config = model.config
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))
