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
with torch.ao's per-tensor scales, 1.9x less than bf16 on a host with native
bf16 and 2.3-2.6x less with AVX2 kernels; perplexity on held-out code +1.5%
over fp32 (torch.ao's per-tensor scales: +97%). The kernel is fbgemm, which
torch ships for x86; torchao's int8 paths were 1.5-2x slower on CPU here,
and the int4 weight-only CPU kernel is no faster at one row and 3x slower
at five.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from ssd import hardware

INT8 = "int8"
GGUF = "gguf"  # a GGUF file's own k-quant weights on ssd's kernels (ssd.models.kernels)
_TINY = torch.finfo(torch.float32).tiny
# Most output channels per fbgemm packed block (Int8Linear.pack). Fewer rows pack
# faster and cost more per call: the 1.5B model's 151936-row LM head packs in
# 7.4 s whole, 3.7 s in 4 blocks, 1.7 s in 8, and a 6-row call costs 21.3 ms
# whole, 21.9 ms in 4 blocks, 22.4 ms in 8 (one AVX2 core). 4 blocks: most of
# the start-up gain for +2.5% on that one layer. Every other layer stays whole.
PACK_ROWS = 40000
_PACKING = threading.Lock()  # held while a layer packs its weights or hands out its unpacked ones


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch 2.13 announces the removal of quantized tensor types; the fbgemm
    kernels they feed are still the fastest int8 path measured here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantiz.*", category=UserWarning)
        yield


def int8_supported() -> bool:
    """Whether this torch build has the fbgemm kernels (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """A frozen nn.Linear with int8 per-channel weights and per-row int8 activations (CPU).

    The weights are packed for fbgemm on first use, or by `pack` (load_model
    packs every layer before it returns, so no request pays it). Packing costs
    more than the quantization itself (~10-40 ns per weight on one core), and a
    layer fused with others before it is packed (fuse_projections) is packed
    once, as the fused layer, instead of twice with an unpack in between.
    """

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach().to(torch.float32)
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        with _quiet():
            qweight = torch.quantize_per_channel(
                weight, scale.double(), torch.zeros(scale.shape, dtype=torch.long), 0, torch.qint8
            )
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
        self._setup(qweight.int_repr(), qweight.q_per_channel_scales(), bias)

    def _setup(self, ints: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # 8-bit activations where the CPU has VNNI; elsewhere 7, as torch.ao
        # uses on x86: u8 x s8 products summed in pairs can saturate int16
        # without VNNI, one bit less cannot. On the held-out code text the
        # eighth bit cut the perplexity gap to bf16 from +0.050 to +0.019.
        self.reduce_range = not hardware.int8_dot_product()
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = (ints.contiguous(), scales.contiguous())
        self._packed = None  # fbgemm's packed weights; replaces _int8 once built
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = ints.shape
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 1.0, -1.0
        self.register_buffer("_anchor", anchor, persistent=False)

    def pack(self) -> tuple[torch.ScriptObject, ...]:
        """The packed weights, built now if not yet (once, whichever thread asks first).

        In blocks of at most PACK_ROWS output channels: fbgemm's packing slows
        down per weight as a layer gets taller, and each output channel is
        computed on its own, so the blocks' outputs side by side are the
        whole layer's bit for bit.
        """
        with _PACKING:
            if self._packed is None:
                ints, scales = self._int8
                rows = -(-self.out_features // -(-self.out_features // PACK_ROWS))  # even blocks
                self._packed = tuple(
                    _prepack(ints[start : start + rows], scales[start : start + rows])
                    for start in range(0, self.out_features, rows)
                )
                self._int8 = None
            return self._packed

    @classmethod
    def from_int8(cls, ints: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        """The layer whose weights are `ints` (int8, [out, in]) times `scales` (fp64, one per output
        channel): what `int8_weight` returns, so a layer can be stored and rebuilt bit for bit."""
        layer = cls.__new__(cls)
        layer._setup(ints, scales, bias)
        return layer

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weights and their per-output-channel fp64 scales, as plain tensors
        (the packed fbgemm weight is an opaque object no file format holds)."""
        with _PACKING:
            if self._int8 is not None:
                return self._int8
        weights = [torch.ops.quantized.linear_unpack(block)[0] for block in self._packed]
        return torch.cat([w.int_repr() for w in weights]), torch.cat([w.q_per_channel_scales() for w in weights])

    @classmethod
    def concat(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """One layer computing every part's outputs side by side (bit for bit the same:
        weights are quantized per output channel, activations per row)."""
        ints, scales = zip(*(p.int8_weight() for p in parts))
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        bias = None if all(p.bias is None for p in parts) else torch.cat(biases)
        return cls.from_int8(torch.cat(ints), torch.cat(scales), bias)

    def split(self, sizes: list[int]) -> list["Int8Linear"]:
        """The inverse of `concat`: one layer per block of `sizes` output channels."""
        ints, scales = self.int8_weight()
        layers, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            bias = None if self.bias is None else self.bias[rows].clone()
            layers.append(Int8Linear.from_int8(ints[rows], scales[rows], bias))
            start += size
        return layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few, in-place ops: this wrapper runs ~170 times per draft forward.
        packed = self._packed if self._packed is not None else self.pack()
        scaled = torch.cat((x.reshape(-1, self.in_features), self._anchor))
        peak = torch.linalg.vector_norm(scaled, float("inf"), dim=1, keepdim=True).clamp_min_(_TINY)
        scaled = scaled.div_(peak)
        if len(packed) == 1:
            out = torch.ops.quantized.linear_dynamic(scaled, packed[0], self.reduce_range)[:-1]
        else:  # a tall layer (the LM head): its blocks side by side
            out = torch.cat([torch.ops.quantized.linear_dynamic(scaled, b, self.reduce_range) for b in packed], 1)[:-1]
        out = out.mul_(peak[:-1]) if self.bias is None else torch.addcmul(self.bias, out, peak[:-1])
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row activations"


def _prepack(ints: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    with _quiet():
        qweight = torch._make_per_channel_quantized_tensor(
            ints.contiguous(), scales.contiguous(), torch.zeros(scales.shape, dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(qweight, None)


def pack_int8(model: nn.Module) -> nn.Module:
    """Pack every Int8Linear's weights now, so that no forward packs and none writes to a module."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.pack()
    return model


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


class FusedInt8Linear(nn.Module):
    """Several Int8Linear layers that read the same input, computed as one matmul.

    `forward(x)` returns every part's output (bit for bit what the separate
    layers give: weights are quantized per output channel, activations per
    row). It keeps nothing between calls, so one instance may serve any
    number of threads at once.
    """

    def __init__(self, parts: list[Int8Linear]) -> None:
        super().__init__()
        self.linear = Int8Linear.concat(parts)
        self.sizes = [p.out_features for p in parts]
        self._split: list[Int8Linear] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def part(self, index: int) -> Int8Linear:
        """Part `index` as a layer of its own, for callers that ask for one part at a time.

        Built on first use (a weight conversion), then only read: models that
        only the lean forward runs never pay its memory. Two threads may both
        build it at once; they build the same weights, and either list serves.
        """
        split = self._split
        if split is None:
            split = self._split = self.linear.split(self.sizes)
        return split[index]


class FusedPart(nn.Module):
    """Stands where one of the fused layers stood: transformers' attention calls
    q_proj(h), k_proj(h) and v_proj(h) one by one, and each gets its own layer.

    (An earlier version computed all parts on the first call and kept them on
    the module for the next two; two threads running one model then read each
    other's projections. Per-call state on a shared module is what this
    replaces.)"""

    def __init__(self, group: FusedInt8Linear, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_group", group)  # registered once, on the owner
        self.index = index
        self.in_features, self.out_features = group.linear.in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.part(self.index)(x)


class FusedGateUpMLP(nn.Module):
    """A gated MLP, down(act(gate(x)) * up(x)), with gate and up as one int8 matmul."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = FusedInt8Linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse each decoder layer's q/k/v and gate/up Int8Linear layers (Llama layout), in place.

    Fewer, larger matmuls: the per-call cost of an int8 layer is paid 4 times
    per decoder layer instead of 7. The MLP becomes a FusedGateUpMLP (every
    forward uses it); attention gets `qkv_proj`, which the lean forward
    (ssd.models.fast) calls once, while q_proj/k_proj/v_proj stay callable
    one at a time for transformers' own attention. Layers that are missing or
    not Int8Linear are left alone. The fused modules keep no per-call state:
    a model may run forwards from several threads at once.
    """
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn = getattr(layer, "self_attn", None)
        parts = [getattr(attn, name, None) for name in _QKV]
        if all(isinstance(p, Int8Linear) for p in parts):
            attn.qkv_proj = FusedInt8Linear(parts)
            for index, name in enumerate(_QKV):
                setattr(attn, name, FusedPart(attn.qkv_proj, index))
        mlp = getattr(layer, "mlp", None)
        if all(isinstance(getattr(mlp, n, None), Int8Linear) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(
            mlp, "act_fn"
        ):
            layer.mlp = FusedGateUpMLP(mlp)
    return model


def project_qkv(attn: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention module's queries, keys and values for `h`: one matmul where fused."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is not None:
        return fused(h)
    return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)


def precision_of(model: nn.Module) -> str:
    """The name of a model's weight precision as reports show it: int8, gguf, bf16, fp32 or fp64."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return INT8
    # Only a process that loaded a GGUF-kernel model has imported its module (which needs the gguf
    # package, absent on a GPU image): no module, no such layers.
    kernels = sys.modules.get("ssd.models.kernels.qlinear")
    if kernels is not None and any(isinstance(m, kernels.QLinear) for m in model.modules()):
        return GGUF
    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(dtype, str(dtype))
