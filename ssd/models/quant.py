"""int8 weights with int8 activations scaled per row: a CPU fast path that keeps rows independent.

Why per row. fbgemm's dynamic int8 linear (what `torch.ao.quantization.
quantize_dynamic` installs) quantizes its whole input with one scale, chosen
from that input's range. A row's result then depends on which other rows
share the call: the target's logits at a position differ between a 1-token
step and a (K+1)-token verification (so speculative output would drift from
autoregressive output), and a draft branch depends on the other branches of
its tree step (so tree and chain drafts disagree and acceptance moves with
the branch budget).

How. Each row x_i is divided by its own max |x_i| before the call, and one
anchor row [1, -1, 0, ...] pins the call's range to exactly [-1, 1]: every
row is then quantized on the same fixed grid relative to its own maximum
(symmetric per-row scales, as in LLM.int8() and SmoothQuant's per-token
variant). The integer matmul is exact and the dequantization is elementwise,
so a row's output is bit for bit the same whatever else is in the call
(tests/test_quant.py). Weights are int8 per output channel. Everything else
(embeddings, norms, attention, the residual stream) stays fp32.

Measured on one core (docs/results.md): a 1.5B step costs about as much as
with torch.ao's per-tensor scales, 2.2x less than bf16 on a host with native
bf16 and 2.6x less on one without it; its maintained kernel is fbgemm, which
torch ships for x86. torchao's int8 paths were slower on CPU here (see the
closing figures in docs/results.md), and the int4 weight-only CPU kernel
(`_weight_int4pack_mm_for_cpu`) is no faster at one row and 3x slower at five.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

INT8 = "int8"


def int8_supported() -> bool:
    """Whether this torch build has the fbgemm kernels (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """A frozen nn.Linear with int8 per-channel weights and per-row int8 activations (CPU)."""

    # 7-bit activations, as torch.ao uses on x86: u8 x s8 products summed in
    # pairs can saturate int16 on CPUs without VNNI; one bit less cannot.
    reduce_range = True

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().to(torch.float32)
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        with warnings.catch_warnings():
            # torch 2.13 announces the removal of quantized tensor types; the
            # fbgemm kernels they feed are still the fastest int8 path measured.
            warnings.filterwarnings("ignore", message=".*quantize_per.*", category=UserWarning)
            qweight = torch.quantize_per_channel(
                weight, scale.double(), torch.zeros(scale.shape, dtype=torch.long), 0, torch.qint8
            )
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 1.0, -1.0
        self.register_buffer("_anchor", anchor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        peak = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = torch.cat([rows / peak, self._anchor])
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, self.reduce_range)[:-1] * peak
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row activations"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of an fp32 model by an Int8Linear, in place."""
    if not int8_supported():
        raise RuntimeError("int8 quantization needs torch's fbgemm kernels (an x86 CPU build)")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("int8 quantization needs an fp32 model (its activations stay fp32)")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child))
    return model


def precision_of(model: nn.Module) -> str:
    """The name of a model's weight precision as reports show it: int8, bf16, fp32 or fp64."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return INT8
    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(dtype, str(dtype))
