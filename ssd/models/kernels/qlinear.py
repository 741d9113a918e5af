"""Linear layers on a GGUF file's own k-quant weights, through the C kernel (qmatmul.c).

`QLinear` stands where an nn.Linear stood: its weights are the GGUF tensor's
blocks, repacked once without loss (`repack`), so the model's quality is the
file's. Its input is quantized per row to 8 bits (one scale per 256 values,
llama.cpp's Q8_K), and every product is an integer sum, so a row's output is
bit-identical whatever other rows share the call (the engines' batch
invariance). Several layers that read the same input (q/k/v, gate/up) are one
QLinear with several parts: the input is quantized once and each part is one
kernel call.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K as GGUF_Q4_K
from torch import nn

from ssd.models.kernels.build import load

QK = 256
FORMATS = {GGMLQuantizationType.Q4_K: 0, GGMLQuantizationType.Q6_K: 1, GGMLQuantizationType.Q5_0: 2,
           GGMLQuantizationType.Q8_0: 3}
GGUF_BLOCK_BYTES = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210,
                    GGMLQuantizationType.Q5_0: 22, GGMLQuantizationType.Q8_0: 34}
GGUF_BLOCK_WEIGHTS = {GGMLQuantizationType.Q4_K: QK, GGMLQuantizationType.Q6_K: QK,
                      GGMLQuantizationType.Q5_0: 32, GGMLQuantizationType.Q8_0: 32}


def supported(kind: GGMLQuantizationType, in_features: int) -> bool:
    return kind in FORMATS and in_features % GGUF_BLOCK_WEIGHTS[kind] == 0


def padded(in_features: int) -> int:
    """Inputs as the kernel reads them: whole blocks of 256 (Q5_0 / Q8_0 rows are padded with zeros)."""
    return -(-in_features // QK) * QK


def repack(kind: GGMLQuantizationType, raw: np.ndarray) -> np.ndarray:
    """The kernel's blocks ([out, blocks * block bytes] uint8; layout in qmatmul.c) from a GGUF
    tensor's raw blocks ([out, bytes per row] uint8, as gguf.GGUFReader gives them). Lossless:
    the same integers and fp16 scales, moved."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"no kernel for GGUF type {kind.name}")
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, GGUF_BLOCK_BYTES[kind])
    if kind in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0):
        return _repack_bytes(kind, blocks.reshape(out, -1, GGUF_BLOCK_BYTES[kind]))
    if kind == GGMLQuantizationType.Q4_K:
        sc, mins = GGUF_Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:144].reshape(-1, 4, 32)  # byte 32j + l: weights 64j + l (low), 64j + 32 + l (high)
        quants = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK)
        head = [blocks[:, 0:4], sc.reshape(-1, 8).astype(np.uint8), mins.reshape(-1, 8).astype(np.uint8)]
        packed = head + _vector_layout(quants, high_bits=False)
    else:
        ql, qh = blocks[:, 0:128].reshape(-1, 2, 2, 32), blocks[:, 128:192].reshape(-1, 2, 1, 32)
        # Half n, weight 32 s + l (s = 0..3): low nibble of ql[64n + 32 (s % 2) + l] (s < 2) or its high
        # nibble (s >= 2); bits 4-5 from qh[32n + l] >> 2 s.
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [blocks, half, s, 32]
        high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
        quants = (low | (high << 4)).reshape(-1, QK)
        packed = [blocks[:, 208:210], blocks[:, 192:208]] + _vector_layout(quants, high_bits=True)
    return np.concatenate(packed, axis=1).reshape(out, -1)


def _repack_bytes(kind: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """Q5_0 / Q8_0 blocks [out, n, bytes] -> blocks of 256 weights (layout in qmatmul.c): fp16 d[8],
    then the unsigned quants (Q5_0's q as stored, as nibbles and a plane of bit 4; Q8_0's q + 128 as
    bytes) in the vector layout; zero-scale blocks pad a row to whole blocks of 256."""
    out, n = blocks.shape[:2]
    whole = -(-n // 8) * 8
    d = np.zeros((out, whole, 2), dtype=np.uint8)
    d[:, :n] = blocks[:, :, 0:2]
    if kind == GGMLQuantizationType.Q8_0:
        q = (blocks[:, :, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:  # weight l < 16: low nibble of qs[l]; l >= 16: high nibble of qs[l - 16]; bit 4 is bit l of qh
        qh = blocks[:, :, 2:6].copy().view("<u4")[..., 0]
        qs = blocks[:, :, 6:22]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = low | (high << 4)
    quants = np.zeros((out, whole, 32), dtype=np.uint8)
    quants[:, :n] = q
    if kind == GGMLQuantizationType.Q8_0:
        quants[:, n:] = 128  # zero-scale padding either way; 128 is Q8_0's zero
        vectors = quants.reshape(-1, 16, 4, 4).transpose(0, 2, 1, 3).reshape(-1, QK)
        return np.concatenate([d.reshape(-1, 16), vectors], axis=1).reshape(out, -1)
    packed = _vector_layout(quants.reshape(-1, QK), high_bits=False)[0]
    vectors = quants.reshape(-1, 16, 4, 4).transpose(0, 2, 1, 3).reshape(-1, 4, 64)
    high = np.packbits((vectors >> 4) & 1, axis=2, bitorder="little").reshape(-1, 32)  # bit i: byte i's bit 4
    return np.concatenate([d.reshape(-1, 16), packed, high], axis=1).reshape(out, -1)


def _vector_layout(quants: np.ndarray, high_bits: bool) -> list[np.ndarray]:
    """Quants [blocks, 256] in natural order -> the kernel's nibble bytes (and Q6_K's high bits):
    weight 16 g + k goes to vector k // 4, byte 4 g + k % 4."""
    vectors = quants.reshape(-1, 16, 4, 4).transpose(0, 2, 1, 3).reshape(-1, 4, 64)  # [blocks, j, 4 g + b]
    nibbles = [(vectors[:, 0] & 0x0F) | ((vectors[:, 1] & 0x0F) << 4),
               (vectors[:, 2] & 0x0F) | ((vectors[:, 3] & 0x0F) << 4)]
    parts = [np.concatenate(nibbles, axis=1).astype(np.uint8)]
    if high_bits:
        top = (vectors >> 4) & 3
        parts.append((top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)).astype(np.uint8))
    return parts


class QLinear(nn.Module):
    """One or more linear layers that read the same input, on repacked GGUF k-quant weights (CPU).

    parts: (format, packed weights [out, bytes] uint8 tensor) per layer, each
    layer's outputs after the previous one's. `forward` returns one tensor, or,
    for a layer made by `fuse`, one per fused layer (as FusedInt8Linear does).
    Holds nothing per call, so threads may share it.
    """

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if in_features % 32:
            raise ValueError(f"in_features {in_features} is not a multiple of 32")
        lib = load()
        self.in_features, self.padded = in_features, padded(in_features)
        self.formats = [fmt for fmt, _ in parts]
        self.sizes = [weights.shape[0] for _, weights in parts]
        self.out_features = sum(self.sizes)
        for index, (fmt, weights) in enumerate(parts):
            expect = self.padded // QK * lib.ssd_block_bytes(fmt)
            if weights.dtype != torch.uint8 or weights.dim() != 2 or weights.shape[1] != expect:
                raise ValueError(f"part {index}: weights must be uint8 [out, {expect}], got {weights.dtype} "
                                 f"{list(weights.shape)}")
            self.register_buffer(f"weights{index}", weights.contiguous())
        self._names = [f"weights{index}" for index in range(len(parts))]
        self.register_buffer("bias", bias)
        self.register_buffer("norm_weight", None)  # set by `normalize`: RMSNorm of the input, in C
        self.norm_eps = 0.0
        self.split_sizes: list[int] | None = None  # set by `fuse`: forward returns one output per layer

    @classmethod
    def from_gguf(cls, kind: GGMLQuantizationType, raw: np.ndarray, bias: torch.Tensor | None = None) -> "QLinear":
        in_features = raw.shape[1] // GGUF_BLOCK_BYTES[kind] * GGUF_BLOCK_WEIGHTS[kind]
        return cls([(FORMATS[kind], torch.from_numpy(repack(kind, raw)))], in_features, bias)

    @classmethod
    def fuse(cls, layers: list["QLinear"]) -> "QLinear":
        """One layer computing every layer's outputs side by side, bit for bit."""
        parts = [part for layer in layers for part in layer.parts()]
        biases = [layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers]
        bias = None if all(layer.bias is None for layer in layers) else torch.cat(biases)
        fused = cls(parts, layers[0].in_features, bias)
        fused.split_sizes = [layer.out_features for layer in layers]
        return fused

    def normalize(self, norm: nn.Module) -> "QLinear":
        """This layer takes its input before `norm` (an RMSNorm: weight, variance_epsilon) and
        normalizes it in C with the quantization (one pass, no normalized copy in torch)."""
        self.norm_weight = norm.weight.detach().to(torch.float32).contiguous()
        self.norm_eps = float(norm.variance_epsilon)
        return self

    def rows(self, ids: torch.Tensor) -> "QLinear":
        """A layer computing only output rows `ids` (copies of their blocks), with this layer's
        input norm: each of its outputs bit for bit the same row of this layer's."""
        if len(self.formats) != 1:
            raise ValueError("rows: a single-part layer only (an LM head)")
        weights = self._buffers[self._names[0]][ids].clone()
        bias = None if self.bias is None else self.bias[ids].clone()
        layer = QLinear([(self.formats[0], weights)], self.in_features, bias)
        layer.norm_weight, layer.norm_eps = self.norm_weight, self.norm_eps
        return layer

    def parts(self) -> list[tuple[int, torch.Tensor]]:
        return [(fmt, self._buffers[name]) for fmt, name in zip(self.formats, self._names)]

    def forward(self, x: torch.Tensor, split: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The outputs: one tensor, or for a fused layer one per part (split=False: side by side)."""
        # Few torch calls: this runs ~110 times a forward of the 1.5B model, at ~15 us of Python each.
        lib, threads = load(), torch.get_num_threads()  # torch's OpenMP threads run the product too
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        n, k = rows.shape[0], self.padded  # inputs past in_features are zeros (against zero-scale blocks)
        # One scratch buffer: int8 activations [n, k], then their scales [n, k / 256] and group sums
        # [n, k / 16] as floats (k is a multiple of 256, so both stay 4-byte aligned).
        scratch = torch.empty(n * k + 4 * n * (k // QK + k // 16), dtype=torch.uint8)
        q = scratch.data_ptr()
        scale, bsum = q + n * k, q + n * k + 4 * n * (k // QK)
        norm = None if self.norm_weight is None else self.norm_weight.data_ptr()
        if lib.ssd_prepare_rows(rows.data_ptr(), n, self.in_features, k, norm, self.norm_eps, q, scale, bsum):
            raise MemoryError("qmatmul.c: out of memory for a row")
        out = torch.empty((n, self.out_features), dtype=torch.float32)
        start, base = 0, out.data_ptr()
        for fmt, name, size in zip(self.formats, self._names, self.sizes):  # each part writes its columns
            lib.ssd_matmul(self._buffers[name].data_ptr(), fmt, size, k, q, scale, bsum, n, base + 4 * start,
                           self.out_features, threads)
            start += size
        if self.bias is not None:
            out += self.bias
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out.split(self.split_sizes, dim=-1) if self.split_sizes and split else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF k-quants {self.formats}"

