"""Quantizers for GGUF's Q4_K and Q6_K blocks, in numpy (gguf's Python package only dequantizes them).

For writing small test models as a q4_k_m GGUF (ssd.models.gguf_export,
ftype "q4_k_m"), so the kernels' exactness tests run on real block formats
without a model hub. Plain rounding, not llama.cpp's error-minimising search:
the blocks are valid and gguf's own dequantizer reads them back, which is all
the tests need; quality is not the point here.
"""

from __future__ import annotations

import numpy as np

QK = 256


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float (cols % 256 == 0) -> [rows, cols / 256 * 144] uint8 Q4_K blocks."""
    x = _blocks(weights).reshape(-1, 8, 32)
    low = np.minimum(x.min(axis=2), 0.0)  # w = d sc q - dmin m: a sub-block's minimum is -dmin m <= 0
    span = np.maximum(x.max(axis=2) - low, 1e-12)
    d = _half(span.max(axis=1) / 15 / 63)
    dmin = _half(-low.min(axis=1) / 63)  # the deepest sub-block minimum takes m = 63
    sc = np.clip(np.ceil(span / 15 / np.maximum(d[:, None], 1e-30)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.maximum(dmin[:, None], 1e-30)), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.round((x + (dmin[:, None] * m)[:, :, None]) / step), 0, 15).astype(np.uint8)
    pairs = q.reshape(-1, 4, 2, 32)  # byte 32j + l: weights 64j + l (low nibble), 64j + 32 + l (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), _pack_scales(sc, m)], axis=1)
    return np.concatenate([head, qs], axis=1).reshape(weights.shape[0], -1)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's 12 bytes of 6-bit scales and mins (the inverse of gguf's Q4_K.get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float (cols % 256 == 0) -> [rows, cols / 256 * 210] uint8 Q6_K blocks."""
    x = _blocks(weights).reshape(-1, 16, 16)
    scale = np.maximum(np.abs(x).max(axis=2), 1e-12) / 31
    d = _half(scale.max(axis=1) / 127)
    sc = np.clip(np.ceil(scale / np.maximum(d[:, None], 1e-30)), 1, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, s, l]
    # Half n, weight 32 s + l: low nibble in ql[64n + 32 (s % 2) + l] (s < 2: low, else high), bits 4-5
    # in qh[32n + l] at 2 s.
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, axis=1).reshape(weights.shape[0], -1)


def _blocks(weights: np.ndarray) -> np.ndarray:
    if weights.ndim != 2 or weights.shape[1] % QK:
        raise ValueError(f"k-quants need [rows, cols] with cols a multiple of {QK}, got {list(weights.shape)}")
    return np.asarray(weights, dtype=np.float32).reshape(-1, QK)


def _half(values: np.ndarray) -> np.ndarray:
    """Values rounded to fp16, as float32 (the stored d and dmin are fp16)."""
    return values.astype(np.float16).astype(np.float32)
