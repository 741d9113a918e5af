"""Whole decoder layers in one C call each (layer.c), for models on the GGUF kernels.

`KernelLayers.for_model(model)` reads every layer's blocks, biases and norm
weights once into C structs; the lean forward (ssd.models.fast) then runs a
decode step or a verification (unmasked segments of at most ROW_LIMIT rows)
as one call per layer, with the Python layer kept for prefill and tree masks.
The C layer performs the Python layer's operations on these models in the
same order (the same C products, norm, RoPE, attention and SiLU), so both
give the same numbers.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ssd.models.kernels.build import load
from ssd.models.kernels.qlinear import QLinear

P = ctypes.c_void_p


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("qkv", P * 3), ("qkv_fmt", ctypes.c_int * 3), ("qkv_bias", P), ("input_norm", P),
        ("o", P), ("o_fmt", ctypes.c_int), ("gate_up", P * 2), ("gate_up_fmt", ctypes.c_int * 2),
        ("post_norm", P), ("down", P), ("down_fmt", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("hidden", ctypes.c_int64), ("hidden_padded", ctypes.c_int64), ("inter", ctypes.c_int64),
        ("inter_padded", ctypes.c_int64), ("attn_padded", ctypes.c_int64),
        ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int),
    ]


class Segments(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int), ("start", P), ("length", P), ("capacity", P), ("keys", P), ("values", P)]


def _single(layer) -> tuple[int, torch.Tensor] | None:
    """A one-part, unbiased, unnormalized QLinear's (format, blocks), else None."""
    if not isinstance(layer, QLinear) or len(layer.formats) != 1 or layer.bias is not None:
        return None
    if layer.norm_weight is not None:
        return None
    return layer.parts()[0]


class KernelLayers:
    """Every layer of a GGUF-kernel model as a C struct (see the module docstring)."""

    def __init__(self, structs: list[LayerWeights], keep: list[torch.Tensor]) -> None:
        self.structs = structs
        self._keep = keep  # the tensors the structs point into
        self._workspace = threading.local()  # per thread: forwards on other threads run at once

    def workspace(self, rows: int) -> torch.Tensor:
        """This thread's workspace, grown (never shrunk) to `rows` rows (every layer has the same shapes)."""
        need = load().ssd_decoder_layer_workspace(ctypes.byref(self.structs[0]), rows)
        held = getattr(self._workspace, "buffer", None)
        if held is None or held.numel() < need:
            held = self._workspace.buffer = torch.empty(need, dtype=torch.uint8)
        return held

    @classmethod
    def for_model(cls, model: torch.nn.Module, heads: int, kv_heads: int, dim: int) -> "KernelLayers | None":
        """The model's layers in C, or None where any layer is not the fused kernel layout."""
        structs, keep = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = getattr(attn, "qkv_proj", None)
            gate_up = getattr(mlp, "gate_up_proj", None)
            o, down = _single(attn.o_proj), _single(getattr(mlp, "down_proj", None))
            if (not isinstance(qkv, QLinear) or len(qkv.formats) != 3 or qkv.norm_weight is None
                    or not isinstance(gate_up, QLinear) or len(gate_up.formats) != 2 or gate_up.norm_weight is None
                    or o is None or down is None or hasattr(attn, "q_norm")
                    or qkv.sizes != [heads * dim, kv_heads * dim, kv_heads * dim]):
                return None
            bias = None if qkv.bias is None else qkv.bias.to(torch.float32).contiguous()
            s = LayerWeights()
            for i, (fmt, blocks) in enumerate(qkv.parts()):
                s.qkv[i], s.qkv_fmt[i] = blocks.data_ptr(), fmt
            for i, (fmt, blocks) in enumerate(gate_up.parts()):
                s.gate_up[i], s.gate_up_fmt[i] = blocks.data_ptr(), fmt
            s.qkv_bias = None if bias is None else bias.data_ptr()
            s.input_norm, s.post_norm = qkv.norm_weight.data_ptr(), gate_up.norm_weight.data_ptr()
            s.o, s.o_fmt = o[1].data_ptr(), o[0]
            s.down, s.down_fmt = down[1].data_ptr(), down[0]
            s.eps, s.scale = qkv.norm_eps, float(attn.scaling)
            s.hidden, s.hidden_padded = qkv.in_features, qkv.padded
            s.inter, s.inter_padded = mlp.down_proj.in_features, mlp.down_proj.padded
            s.attn_padded = attn.o_proj.padded
            s.heads, s.kv_heads, s.dim = heads, kv_heads, dim
            structs.append(s)
            keep += [t for t in (bias, qkv.norm_weight, gate_up.norm_weight) if t is not None]
        return cls(structs, keep)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments) -> None:
        """Every layer in place on x [N, hidden] (float32, contiguous); cos, sin [N, dim];
        segments: the forward's (ssd.models.fast.Segment), unmasked, in x's row order."""
        count, lib, threads = len(segments), load(), torch.get_num_threads()
        longs, pointers = ctypes.c_int64 * count, ctypes.c_void_p * count
        start = longs(*[s.start for s in segments])
        length = longs(*[s.length for s in segments])
        capacity = longs(*[s.cache.capacity for s in segments])
        keys, values = pointers(), pointers()
        seg = Segments(count, ctypes.cast(start, P), ctypes.cast(length, P), ctypes.cast(capacity, P),
                       ctypes.cast(keys, P), ctypes.cast(values, P))
        workspace = self.workspace(x.shape[0]).data_ptr()
        for index, struct in enumerate(self.structs):
            for i, s in enumerate(segments):  # this layer's caches
                keys[i], values[i] = s.cache.keys[index].data_ptr(), s.cache.values[index].data_ptr()
            if lib.ssd_decoder_layer(ctypes.byref(struct), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
                                     ctypes.byref(seg), workspace, threads):
                raise MemoryError("layer.c: out of memory for a layer's buffers")
