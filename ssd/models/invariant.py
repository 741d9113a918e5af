"""Attention that scores each query row exactly as a one-token decode step would.

Speculative decoding is exact when verifying K+1 tokens in one forward gives
the same logits, position by position, as K+1 one-token steps. A fused
attention kernel splits its work by the number of query rows, so a verified
position can round differently from the same position decoded alone; for a
float model that is noise of ~1e-7, but int8 activations turn such noise into
whole quantization steps now and then, and greedy output can part at a near
tie. With int8 linears already row-independent (ssd.models.quant), this
attention closes the gap: every decode-sized forward (at most ROW_LIMIT query
rows under a plain causal mask) runs one SDPA call per row over that row's
visible prefix, the very call a one-token step makes. Longer forwards
(prompt prefill) and custom masks (tree-masked branches) use plain SDPA.

The extra cost is one SDPA call per verified token per layer: tens of
microseconds, against a verification of hundreds of milliseconds on CPU.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ROW_ATTENTION = "ssd_rows"
ROW_LIMIT = 65  # K + 1 for the largest K the config allows


def _is_causal_tail(mask: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """Whether `mask` lets query row i see exactly the keys before kv_len - q_len + i + 1."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.shape[-2:] != (q_len, kv_len) or mask.shape[0] != 1:
        return False
    rows = torch.arange(q_len, device=mask.device)[:, None]
    cols = torch.arange(kv_len, device=mask.device)[None, :]
    return bool(torch.equal(mask[0, 0], cols <= rows + (kv_len - q_len)))


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, one query row at a time for decode-sized causal forwards."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len > ROW_LIMIT or not _is_causal_tail(attention_mask, q_len, kv_len):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for i in range(q_len):
        visible = kv_len - q_len + i + 1
        out, _ = sdpa_attention_forward(
            module, query[:, :, i : i + 1], key[:, :, :visible], value[:, :, :visible], None,
            *args, is_causal=False, **kwargs,
        )
        rows.append(out)
    return torch.cat(rows, dim=1), None


AttentionInterface.register(ROW_ATTENTION, row_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_ATTENTION, sdpa_mask)


def use_row_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a transformers model (loaded with SDPA attention) to `row_attention`, in place."""
    model.set_attn_implementation(ROW_ATTENTION)
    return model
