"""The backend seam (issue 31): what the engines ask of a model, one function per operation.

A model is a torch `nn.Module` (sequences: ssd.models.kv.KVSequence) or a
llama.cpp `ssd.models.llamacpp.LlamaCppModel` (sequences: LlamaCppSequence).
Each function here dispatches on the kind of model (or sequence) it is
given, so an engine runs on either without knowing which:

    source = sequence_source(model, rows, max_tokens, kv_tokens)   # once per engine
    seq = new_sequence(source)                                     # one per row
    logits = forward_rows([seq, ...], [ids, ...], last_only)       # one packed forward
    release(seq)                                                   # when the row leaves

plus `has_free_slot` (room for a sequence a later prompt's cache may copy:
ssd.engine.prefix), `kv_bytes_per_token`, `vocab_size` and `precision_of` for admission and
reports, and `model_of` (a sequence's model) and `device_of` for the start-up
plan's probes. Logits are torch tensors either way (float32 on the CPU from
llama.cpp), so sampling and verification are the same code.

The torch path is today's code, called as before: the source is the model
itself, `new_sequence` is `KVSequence(model)`, `release` does nothing.
llama_cpp is never imported here: a LlamaCppModel exists only once
ssd.models.llamacpp has been imported, so that module's presence in
sys.modules decides whether anything can be one.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import torch

import ssd.models.kv as kv
from ssd.models.kv import KVSequence
from ssd.models.quant import precision_of as _torch_precision

if TYPE_CHECKING:
    from ssd.models.llamacpp import LlamaCppContext, LlamaCppModel, LlamaCppSequence

    Model = torch.nn.Module | LlamaCppModel
    AnySequence = KVSequence | LlamaCppSequence
else:
    Model = AnySequence = Any


def _llamacpp() -> ModuleType | None:
    return sys.modules.get("ssd.models.llamacpp")


def is_llamacpp(obj: object) -> bool:
    """Whether `obj` is a llama.cpp model, context or sequence."""
    mod = _llamacpp()
    return mod is not None and isinstance(obj, (mod.LlamaCppModel, mod.LlamaCppContext, mod.LlamaCppSequence))


def sequence_source(model: Model, rows: int, max_tokens: int, kv_tokens: int) -> Model | LlamaCppContext:
    """What an engine makes its sequences of `model` from (`new_sequence`).

    torch: the model itself. llama.cpp: one context with `rows` sequence
    slots, so the rows' forwards share one llama_decode; it takes up to
    `max_tokens` tokens per forward and `kv_tokens` per sequence (at most the
    model's `n_ctx`: its trained context unless the model was loaded with a smaller one). The context belongs to the engine's thread.
    """
    if not is_llamacpp(model):
        return model
    return _llamacpp().LlamaCppContext(
        model, n_seq=rows, n_ctx_seq=max(1, min(model.n_ctx, kv_tokens)), n_batch=max(2, max_tokens),
    )


def new_sequence(source: Model | LlamaCppContext, branches: int = 0) -> AnySequence:
    """A new, empty sequence of a model (its own) or of a `sequence_source` (a slot of its context).

    branches: the most branches `branch_decoder` will decode off this
    sequence at once (SSD's draft side). torch needs nothing for them;
    llama.cpp gives a sequence of a model that many spare slots in its
    context (each a KV stream of the context's length).
    """
    if is_llamacpp(source):
        if branches and isinstance(source, _llamacpp().LlamaCppModel):
            return _llamacpp().LlamaCppSequence(source, branches=branches)
        return _llamacpp().LlamaCppSequence(source)
    return KVSequence(source)


def has_free_slot(source: Model | LlamaCppContext) -> bool:
    """Whether `new_sequence(source)` has room: a llama.cpp context has a fixed number of slots."""
    if is_llamacpp(source) and isinstance(source, _llamacpp().LlamaCppContext):
        return source.free_slots > 0
    return True


def branch_decoder(sequence: AnySequence) -> Any | None:
    """The backend's own branch decoder for `sequence` (ssd.saguaro.branches.BranchDecoder),
    or None where the backend has none (torch: ssd.saguaro.branches picks one by name).

    llama.cpp: ssd.models.llamacpp.LlamaCppBranches, one sequence slot per branch.
    """
    if is_llamacpp(sequence):
        return _llamacpp().LlamaCppBranches()
    return None


def feed_rows(feeds: Sequence[kv.Feed]) -> list[torch.Tensor]:
    """`ssd.models.kv.feed_rows` on either backend. llama.cpp takes plain feeds only
    (committed tokens at consecutive positions: its branches are LlamaCppBranches'),
    packed into one llama_decode per context."""
    if feeds and is_llamacpp(feeds[0].kv):
        if any(f.commit != len(f.ids) or f.positions is not None or f.visible is not None for f in feeds):
            raise NotImplementedError("llama.cpp sequences take committed tokens only; branches go through branch_decoder")
        return _llamacpp().forward_rows([f.kv for f in feeds], [[int(t) for t in f.ids] for f in feeds],
                                        [f.last_only for f in feeds])
    return kv.feed_rows(feeds)


def model_of(sequence: AnySequence) -> Model:
    """The model a sequence runs (its KVSequence's, or its llama.cpp context's)."""
    if is_llamacpp(sequence):
        return sequence.context.model
    return sequence.model


def device_of(model: Model) -> torch.device:
    """Where the model's logits live (llama.cpp: the CPU)."""
    if is_llamacpp(model):
        return torch.device("cpu")
    return model.device


def release(sequence: AnySequence | None) -> None:
    """Hand a finished row's sequence back (a llama.cpp slot); torch's caches go back when collected."""
    if sequence is not None and is_llamacpp(sequence):
        sequence.close()


def forward_rows(
    rows: Sequence[AnySequence], ids: Sequence[Sequence[int]], last_only: bool | Sequence[bool] = False,
    prompt: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """`rows[i].forward(ids[i], last_only[i])` for every row, packed where the backend allows.

    The rows are distinct sequences of one model. `prompt[i]`: ids[i] is a prompt chunk whose
    every row's logits are wanted (llama.cpp runs it as it runs a last_only chunk, so its cache
    does not depend on that; torch's never does).
    """
    if rows and not isinstance(rows[0], KVSequence) and is_llamacpp(rows[0]):
        return _llamacpp().forward_rows(rows, ids, last_only, prompt)
    return kv.forward_rows(rows, ids, last_only)


def kv_bytes_per_token(model: Model) -> int:
    """Bytes of keys and values one token takes in a sequence of `model`."""
    if is_llamacpp(model):
        return model.kv_bytes_per_token()
    return kv.kv_bytes_per_token(model)


def max_positions(model: Model) -> int | None:
    """The most tokens one sequence of `model` holds (llama.cpp: its contexts' n_ctx;
    torch: the trained context), or None where the model does not say."""
    if is_llamacpp(model):
        return model.n_ctx
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


def vocab_size(model: Model) -> int:
    """Rows of the model's logits."""
    if is_llamacpp(model):
        return model.vocab_size
    return model.config.vocab_size


def precision_of(model: Model) -> str:
    """The weights' precision as reports name it (torch: int8, bf16, fp32, fp64; llama.cpp:
    "gguf f32", "gguf q4_k_m", "gguf q4_k_m+repack" in llama.cpp's repacked layouts)."""
    if is_llamacpp(model):
        return model.precision + ("+repack" if model.repacked else "")
    return _torch_precision(model)
