"""A lean forward for Llama-layout decoders over a preallocated KV cache.

transformers' generic forward builds masks, cache objects and output records
on every call and re-concatenates each layer's whole KV cache per step
(DynamicCache.update), so its overhead grows with the context. On a CPU
where a draft step costs ~50-100 ms, that overhead is 10-15% of the step.
This forward runs the model's own modules (embeddings, norms, projections,
MLP, rotary embedding: the same numerics) and keeps keys and values in one
buffer per layer, allocated ahead and grown by doubling: a forward writes its
rows in place, and rolling back only moves a length.

Attention, per forward of M new rows written at cache index `start`:
- no mask, M <= ROW_LIMIT (decode, verification): one SDPA call per row over
  that row's prefix, the very call a one-token step makes, so a verified
  position is bit-identical to the same position decoded alone
  (ssd.models.invariant explains why that matters for int8);
- no mask, longer (prompt prefill): one SDPA call under a causal mask;
- an explicit [M, start + M] mask (tree-masked branches): one SDPA call.

Several sequences in one forward (continuous batching, `packed`): every
row's new tokens are concatenated into one [1, sum M, H] activation, so the
projections, MLP and norms run as one matmul over all rows, while attention
runs per row over that row's own cache with the rules above: a row's
attention is the very call it would make alone.

On CUDA (`one_call_attention`) every segment's attention is instead one
SDPA call under its mask, whatever its length: per-row calls there mean M
launches per layer on the math kernel (enable_gqa), and the bit-identity
they buy matters for int8 activations, which run on the CPU only. Grouped
query heads are folded into query rows (`_attend_one_call`), so the call is
plain multi-head attention that CUDA's fused kernels take.

Supported: Qwen2, Qwen3 (per-head q_norm / k_norm before RoPE), Llama and
Mistral layouts without sliding windows, on one device or sharded by
transformers' tensor parallelism. A sharded model is run through its own
modules: column-wise q/k/v/gate/up give this rank's heads and MLP columns,
and the row-wise o_proj and down_proj all-reduce inside their forward, where
transformers' tp_plan puts the collectives; the plan is checked at load and
any other one is refused. RoPE needs no check: the model's own rotary
module computes cos and sin from the call's positions, as transformers'
forward does, whatever its rope type (the host-syncing dynamic types are
refused for CUDA graphs only: ssd.models.graphs.graph_refusal). Anything
refused keeps transformers' forward, and `lean_refusal` names why
(`note_lean_path` logs it once per model).
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.models.invariant import ROW_LIMIT
from ssd.models.quant import GGUF, precision_of, project_qkv

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
INITIAL_CAPACITY = 256
# What the lean forward's sharded layers must be in a tensor-parallel plan:
# column-wise in, row-wise (all-reduce after) out; Qwen3's per-head norms are replicated.
TP_LAYER_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
TP_REPLICATED = {"self_attn.q_norm", "self_attn.k_norm"}


def tp_size(model: torch.nn.Module) -> int:
    """How many ranks transformers' tensor parallelism shards `model` over (1: not sharded)."""
    return int(getattr(model, "_tp_size", None) or 1)


def lean_refusal(model: torch.nn.Module) -> str | None:
    """Why `FastForward` cannot run `model` with transformers' numerics, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"architecture {model_type or type(model).__name__} (the lean forward takes {', '.join(SUPPORTED_TYPES)})"
    if _sliding(config):
        return f"{model_type} with sliding-window attention"
    inner = getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, n)]
    if missing:
        return f"{type(model).__name__}.model has no {', '.join(missing)}"
    if tp_size(model) > 1:
        return _tp_refusal(model, tp_size(model))
    if getattr(model, "_device_mesh", None) is not None:
        return "a device mesh without a tensor-parallel size"
    return None


def fast_supported(model: torch.nn.Module) -> bool:
    """Whether `FastForward` can run `model` with transformers' numerics (`lean_refusal` says why not)."""
    return lean_refusal(model) is None


def _sliding(config) -> bool:
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return True
    if config.model_type in ("qwen2", "qwen3"):
        return bool(getattr(config, "use_sliding_window", False))
    return getattr(config, "sliding_window", None) is not None


def _tp_refusal(model: torch.nn.Module, size: int) -> str | None:
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, name) % size:
            return f"tensor-parallel size {size} does not divide {name} = {getattr(config, name)}"
    plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict):
        return "a tensor-parallel model without a readable tp_plan"
    layers = {}
    for pattern, style in plan.items():
        rest = pattern.partition("layers.*.")[2]
        if rest:
            layers[rest] = style
    wrong = {k: v for k, v in layers.items()
             if TP_LAYER_PLAN.get(k) != v and not (k in TP_REPLICATED and "replicate" in v)}
    missing = [k for k in TP_LAYER_PLAN if k not in layers]
    if wrong or missing:
        return f"tensor-parallel plan {layers} (the lean forward takes {TP_LAYER_PLAN})"
    return _shard_refusal(model, size)


def _shard_refusal(model: torch.nn.Module, size: int) -> str | None:
    """Whether layer 0's projections hold the shards the lean forward assumes (heads / size each)."""
    config, attn = model.config, model.model.layers[0].self_attn
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = {"q_proj": config.num_attention_heads * head_dim // size,
                "k_proj": config.num_key_value_heads * head_dim // size,
                "v_proj": config.num_key_value_heads * head_dim // size}
    for name, rows in expected.items():
        weight = getattr(getattr(attn, name, None), "weight", None)
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if local is None or local.shape[0] != rows:
            got = None if local is None else local.shape[0]
            return f"tensor-parallel shard of {name} holds {got} output rows, not heads / {size} = {rows}"
    return None


_NOTED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def note_lean_path(model: torch.nn.Module) -> str | None:
    """Log once per model, at load, whether the lean forward takes it, and why not; the reason or None."""
    why = lean_refusal(model)
    try:
        if model in _NOTED:
            return why
        _NOTED.add(model)
    except TypeError:  # not weak-referenceable: log every time rather than never
        pass
    if why is None:
        log.info("%s runs the lean forward%s", type(model).__name__,
                 f" sharded over {tp_size(model)} ranks" if tp_size(model) > 1 else "")
    else:
        log.warning("%s keeps transformers' forward (no lean forward, no CUDA graphs): %s", type(model).__name__, why)
    return why


class StaticKV:
    """Keys and values of one sequence: per layer [kv heads, capacity, head dim]; one owner thread."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (kv_heads, INITIAL_CAPACITY, head_dim)
        self.keys = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, length: int, keep: int) -> None:
        """Room for `length` entries; the first `keep` survive a reallocation."""
        if length <= self.capacity:
            return
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros((old.shape[0], capacity, old.shape[2]))
                new[:, :keep] = old[:, :keep]
                store[i] = new


@dataclass
class Segment:
    """One sequence's share of a packed forward: `length` new rows written at
    `start` of its own cache; mask: bool [length, start + length] or None (causal)."""

    cache: StaticKV
    start: int
    length: int
    mask: torch.Tensor | None = None


class FastForward:
    """Runs a supported model's modules over a StaticKV (see the module docstring).

    Holds nothing per call: one instance may run forwards from several threads
    at once, each over a cache of its own.
    """

    def __init__(self, model: torch.nn.Module, one_call: bool | None = None) -> None:
        """one_call: attention as one SDPA call per segment (None: `one_call_attention` decides)."""
        why = lean_refusal(model)
        if why is not None:
            raise ValueError(f"the lean forward does not support {type(model).__name__}: {why}")
        config = model.config
        self.model = model
        self.inner = model.model
        # This rank's heads: column-wise q/k/v hold heads / tp of them each.
        self.heads = config.num_attention_heads // tp_size(model)
        self.kv_heads = config.num_key_value_heads // tp_size(model)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # The model's own rotary function, so Llama/Qwen2/Mistral variants agree with transformers.
        self._rotary = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
        if one_call is None:
            one_call = one_call_attention(self.inner.embed_tokens.weight.device)
        self._attend = _attend_one_call if one_call else _attend
        # Models on the GGUF kernels attend row by row and rotate q and k in C (ssd.models.kernels.attention).
        self._in_c = not one_call and kernel_attention(model, self.head_dim)
        self._layers = None  # whole layers in C for decode and verification (ssd.models.kernels.layer)
        if self._in_c:
            self._attend = _attend_kernels
            from ssd.models.kernels.layer import KernelLayers

            self._layers = KernelLayers.for_model(model, self.heads, self.kv_heads, self.head_dim)

    def new_cache(self) -> StaticKV:
        embed = self.inner.embed_tokens.weight
        return StaticKV(len(self.inner.layers), self.kv_heads, self.head_dim, self._activation_dtype(), embed.device)

    def _activation_dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    @torch.inference_mode()
    def __call__(
        self,
        cache: StaticKV,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        mask: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(keep) or M, V] after writing M rows at cache index `start`.

        ids, positions: [M]; mask: bool [M, start + M] (True: may attend) or
        None for causal order; keep: row indices to compute logits for.
        """
        return self.packed([Segment(cache, start, ids.shape[0], mask)], ids, positions, keep)

    @torch.inference_mode()
    def packed(
        self, segments: list[Segment], ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [len(keep) or N, V] for N = sum of the segments' lengths, in one forward.

        ids, positions: [N], the segments' tokens one after another; segment
        s writes its rows into its own cache at its own `start` and attends
        only to that cache; keep: indices into the N rows.
        """
        for s in segments:
            s.cache.reserve(s.start + s.length, keep=s.start)
        x = self.inner.embed_tokens(ids)[None]  # [1, N, H]
        cos, sin = self.inner.rotary_emb(x, positions[None])
        if self._layers is not None and all(s.mask is None and s.length <= ROW_LIMIT for s in segments):
            x = x[0].contiguous()
            self._layers.run(x, cos[0].contiguous(), sin[0].contiguous(), segments)
            x = self.inner.norm(x)
            return self.model.lm_head(x if keep is None else x[keep])
        for index, layer in enumerate(self.inner.layers):
            x = x + self._attention(layer, layer.input_layernorm(x), cos, sin, segments, index)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.inner.norm(x)[0]
        return self.model.lm_head(x if keep is None else x[keep])

    def qkv(self, attn: torch.nn.Module, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [1, heads, N, D] and keys, values [1, kv heads, N, D] of `h` [1, N, H], rotated.

        In transformers' order: project, split the heads, Qwen3's per-head
        RMSNorm (q_norm, k_norm) where the model has it, then RoPE.
        """
        n = h.shape[1]
        q, k, v = project_qkv(attn, h)
        if self._in_c and not hasattr(attn, "q_norm"):  # in place on the projection's output, then views
            from ssd.models.kernels.attention import rope

            rope(q, k, cos, sin, self.head_dim)
            split = [x.reshape(1, n, -1, self.head_dim).transpose(1, 2) for x in (q, k, v)]
            return split[0], split[1], split[2]
        q = q.reshape(1, n, self.heads, self.head_dim)
        k = k.reshape(1, n, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = v.reshape(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def _attention(self, layer, h, cos, sin, segments: list[Segment], index: int) -> torch.Tensor:
        attn = layer.self_attn
        n = h.shape[1]
        q, k, v = self.qkv(attn, h, cos, sin)
        outs, offset = [], 0
        for s in segments:
            rows = slice(offset, offset + s.length)
            end = s.start + s.length
            s.cache.keys[index][:, s.start : end] = k[0, :, rows]
            s.cache.values[index][:, s.start : end] = v[0, :, rows]
            keys, values = s.cache.keys[index][None], s.cache.values[index][None]
            outs.append(self._attend(q[:, :, rows], keys, values, s.start, end, s.mask, attn.scaling))  # [1, heads, M, D]
            offset += s.length
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return attn.o_proj(out.transpose(1, 2).reshape(1, n, self.heads * self.head_dim))


def _attend(q, keys, values, start: int, end: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    m = q.shape[2]
    if mask is None and m <= ROW_LIMIT:
        rows = [
            F.scaled_dot_product_attention(
                q[:, :, i : i + 1], keys[:, :, : start + i + 1], values[:, :, : start + i + 1],
                scale=scale, enable_gqa=True,
            )
            for i in range(m)
        ]
        return rows[0] if m == 1 else torch.cat(rows, dim=2)
    if mask is None:
        mask = _causal_tail(m, end, q.device)
    return F.scaled_dot_product_attention(
        q, keys[:, :, :end], values[:, :, :end], attn_mask=mask[None, None], scale=scale, enable_gqa=True
    )


def kernel_attention(model: torch.nn.Module, head_dim: int) -> bool:
    """Whether a CPU model on the GGUF kernels attends row by row in C (ssd.models.kernels.attention)."""
    if precision_of(model) != GGUF:
        return False
    from ssd.models.kernels.attention import supported

    return supported(head_dim, model.model.embed_tokens.weight.dtype)


def _attend_kernels(q, keys, values, start: int, end: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`_attend`'s rows from one C call: unmasked forwards of up to ROW_LIMIT rows; the rest through `_attend`."""
    if mask is not None or q.shape[2] > ROW_LIMIT:
        return _attend(q, keys, values, start, end, mask, scale)
    from ssd.models.kernels.attention import attend_rows

    return attend_rows(q, keys, values, start, scale)


def one_call_attention(device: torch.device) -> bool:
    """Whether attention on `device` runs as one SDPA call per segment (see the module docstring).

    CUDA: yes. Elsewhere the per-row calls stay: on the CPU they make a
    verified row bit-identical to the same row decoded alone (int8's exactness).
    """
    return torch.device(device).type == "cuda"


def _attend_one_call(q, keys, values, start: int, end: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`_attend`'s result from one SDPA call under the segment's mask (causal when None).

    The G = heads / kv heads query heads sharing a kv head become G x M
    query rows of that kv head ([1, kv heads, G*M, D]; the mask repeated G
    times): no enable_gqa, no copy of the cache's keys and values.
    """
    _, heads, m, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if mask is None and m > 1:
        mask = _causal_tail(m, end, q.device)
    grouped = q.reshape(1, kv_heads, groups * m, dim)
    attn_mask = None if mask is None else mask.repeat(groups, 1)[None, None]
    out = F.scaled_dot_product_attention(
        grouped, keys[:, :, :end], values[:, :, :end], attn_mask=attn_mask, scale=scale
    )
    return out.reshape(1, heads, m, dim)


def _causal_tail(m: int, end: int, device: torch.device) -> torch.Tensor:
    """[m, end] bool: row i sees keys before end - m + i + 1."""
    return torch.arange(end, device=device)[None, :] <= torch.arange(m, device=device)[:, None] + (end - m)
