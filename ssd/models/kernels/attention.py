"""The lean forward's row-by-row attention in one C call (attention.c), for models on the GGUF kernels.

`ssd.models.fast` attends each new row over its own prefix, so that a
verified position is the very computation of that position decoded alone.
Through torch that is one SDPA call per row and layer; here every row and
head of a layer is one task of one call, each with one fixed order of sums,
so a row's output still depends on that row alone. Masked (tree) and long
(prefill) forwards keep SDPA. RoPE runs in C too (`rope`), in place on the
layer's q/k/v output, as transformers computes it.
"""

from __future__ import annotations

import torch

from ssd.models.kernels.build import load


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and bool(load().ssd_attention_supports(head_dim))


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """[1, heads, M, D]: row i of q [1, heads, M, D] over keys and values [1, kv heads, capacity, D] 0 .. start + i."""
    _, heads, m, dim = q.shape
    if q.stride(3) != 1:
        q = q.contiguous()
    out = torch.empty((1, m, heads, dim), dtype=torch.float32)
    status = load().ssd_attend_rows(q.data_ptr(), q.stride(2), q.stride(1), keys.data_ptr(), values.data_ptr(),
                                    keys.shape[2], heads, keys.shape[1], dim, start, m, scale, out.data_ptr(),
                                    heads * dim, torch.get_num_threads())
    if status != 0:
        raise MemoryError("attention.c: out of memory for its softmax weights")
    return out.transpose(1, 2)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """RoPE in place on q [1, N, heads * D] and k [1, N, kv heads * D] (rows may be strided views
    into one q/k/v output), as transformers' apply_rotary_pos_emb: cos, sin [1, N, D]."""
    lib = load()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    for x in (q, k):
        if x.stride(2) != 1:
            raise ValueError("rope: the head dimension must be contiguous")
        lib.ssd_rope(x.data_ptr(), x.shape[1], x.shape[2] // head_dim, head_dim, x.stride(1), cos.data_ptr(),
                     sin.data_ptr())

