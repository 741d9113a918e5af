"""The backend seam (issue 31): what the engines ask of a model, one function per operation.

A model is a torch `nn.Module` (sequences: ssd.models.kv.KVSequence), a
llama.cpp `ssd.models.llamacpp.LlamaCppModel` (sequences: LlamaCppSequence)
or a tensor-parallel target's leader (ssd.models.tp.TPLeader: sequences
mirrored on every rank, TPSequence). Each function here hands its call to the
model's (or sequence's) `Ops`, TorchOps, LlamaCppOps or the tensor-parallel
TPOps (which its objects name as `backend_ops`), picked by `ops_of`, the one
place that asks which backend an object is of; so an engine runs on any
without knowing which:

    source = sequence_source(model, rows, max_tokens, kv_tokens)   # once per engine
    seq = new_sequence(source)                                     # one per row
    logits = forward_rows([seq, ...], [ids, ...], last_only)       # one packed forward
    release(seq)                                                   # when the row leaves

plus `has_free_slot` (room for a sequence a later prompt's cache may copy:
ssd.engine.prefix), `kv_bytes_per_token`, `vocab_size` and `precision_of` for admission and
reports, and `model_of` (a sequence's model), `device_of` and `device_name` for the
start-up plan's probes. Logits are torch tensors either way (float32 on the CPU from
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
from typing import TYPE_CHECKING, Any, Protocol, Sequence

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


class Ops(Protocol):
    """One backend's answer to each operation of this module (see the functions of the same names)."""

    warm_up: bool  # whether a timed probe needs an untimed pass first (ssd.saguaro.startup)

    def sequence_source(self, model: Any, rows: int, max_tokens: int, kv_tokens: int) -> Any: ...
    def new_sequence(self, source: Any, branches: int) -> Any: ...
    def has_free_slot(self, source: Any) -> bool: ...
    def branch_decoder(self, sequence: Any) -> Any | None: ...
    def feed_rows(self, feeds: Sequence[kv.Feed]) -> list[torch.Tensor]: ...
    def forward_rows(self, rows: Sequence[Any], ids: Sequence[Sequence[int]],
                     last_only: bool | Sequence[bool], prompt: Sequence[bool] | None) -> list[torch.Tensor]: ...
    def model_of(self, sequence: Any) -> Any: ...
    def device_of(self, model: Any) -> torch.device: ...
    def device_name(self, model: Any) -> str: ...
    def release(self, sequence: Any) -> None: ...
    def kv_bytes_per_token(self, model: Any) -> int: ...
    def max_positions(self, model: Any) -> int | None: ...
    def vocab_size(self, model: Any) -> int: ...
    def precision_of(self, model: Any) -> str: ...


class TorchOps:
    """torch: a model is its own sequence source; its sequences are KVSequences, collected when dropped."""

    # The first forwards of a shape pay for kernel choices and allocations.
    warm_up = True

    def sequence_source(self, model: torch.nn.Module, rows: int, max_tokens: int, kv_tokens: int) -> torch.nn.Module:
        return model

    def new_sequence(self, source: torch.nn.Module, branches: int) -> KVSequence:
        return KVSequence(source)  # branches need no room: ssd.saguaro.branches' decoders make their own

    def has_free_slot(self, source: torch.nn.Module) -> bool:
        return True

    def branch_decoder(self, sequence: KVSequence) -> None:
        return None  # ssd.saguaro.branches picks one by name

    def feed_rows(self, feeds: Sequence[kv.Feed]) -> list[torch.Tensor]:
        return kv.feed_rows(feeds)  # looked up per call, so that a patched kv.feed_rows is the one run

    def forward_rows(self, rows: Sequence[KVSequence], ids: Sequence[Sequence[int]],
                     last_only: bool | Sequence[bool], prompt: Sequence[bool] | None) -> list[torch.Tensor]:
        return kv.forward_rows(rows, ids, last_only)  # a prompt chunk's cache is the same either way

    def model_of(self, sequence: KVSequence) -> torch.nn.Module:
        return sequence.model

    def device_of(self, model: torch.nn.Module) -> torch.device:
        return model.device

    def device_name(self, model: torch.nn.Module) -> str:
        return str(getattr(model, "device", "?"))  # a stand-in without a device still gets a plan key

    def release(self, sequence: KVSequence | None) -> None:
        return None  # its caches go back when collected

    def kv_bytes_per_token(self, model: torch.nn.Module) -> int:
        return kv.kv_bytes_per_token(model)

    def max_positions(self, model: torch.nn.Module) -> int | None:
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        return positions if isinstance(positions, int) and positions > 0 else None

    def vocab_size(self, model: torch.nn.Module) -> int:
        return model.config.vocab_size

    def precision_of(self, model: torch.nn.Module) -> str:
        return _torch_precision(model)


class LlamaCppOps:
    """llama.cpp: sequences are slots of a LlamaCppContext, handed back by `release`.

    Reaches ssd.models.llamacpp through sys.modules (`_llamacpp`): an object is
    only ever of this backend once that module has been imported.
    """

    # The weights already read by the prefill, its first timed passes time as its later ones.
    warm_up = False

    def sequence_source(self, model: LlamaCppModel, rows: int, max_tokens: int, kv_tokens: int) -> LlamaCppContext:
        return _llamacpp().LlamaCppContext(
            model, n_seq=rows, n_ctx_seq=max(1, min(model.n_ctx, kv_tokens)), n_batch=max(2, max_tokens),
        )

    def new_sequence(self, source: LlamaCppModel | LlamaCppContext, branches: int) -> LlamaCppSequence:
        mod = _llamacpp()
        # Only a sequence of its own context has room to add: a shared context's slots are fixed.
        if branches and isinstance(source, mod.LlamaCppModel):
            return mod.LlamaCppSequence(source, branches=branches)
        return mod.LlamaCppSequence(source)

    def has_free_slot(self, source: LlamaCppModel | LlamaCppContext) -> bool:
        # A model makes each sequence a context of its own; a context has a fixed number of slots.
        return source.free_slots > 0 if isinstance(source, _llamacpp().LlamaCppContext) else True

    def branch_decoder(self, sequence: LlamaCppSequence) -> Any:
        return _llamacpp().LlamaCppBranches()

    def feed_rows(self, feeds: Sequence[kv.Feed]) -> list[torch.Tensor]:
        # Branches go through LlamaCppBranches, which llama.cpp's own mask keeps apart.
        if any(f.commit != len(f.ids) or f.positions is not None or f.visible is not None for f in feeds):
            raise NotImplementedError("llama.cpp sequences take committed tokens only; branches go through branch_decoder")
        return _llamacpp().forward_rows([f.kv for f in feeds], [[int(t) for t in f.ids] for f in feeds],
                                        [f.last_only for f in feeds])

    def forward_rows(self, rows: Sequence[LlamaCppSequence], ids: Sequence[Sequence[int]],
                     last_only: bool | Sequence[bool], prompt: Sequence[bool] | None) -> list[torch.Tensor]:
        return _llamacpp().forward_rows(rows, ids, last_only, prompt)

    def model_of(self, sequence: LlamaCppSequence) -> LlamaCppModel:
        return sequence.context.model

    def device_of(self, model: LlamaCppModel) -> torch.device:
        return torch.device("cpu")

    def device_name(self, model: LlamaCppModel) -> str:
        return str(self.device_of(model))

    def release(self, sequence: LlamaCppSequence | None) -> None:
        if sequence is not None:
            sequence.close()

    def kv_bytes_per_token(self, model: LlamaCppModel) -> int:
        return model.kv_bytes_per_token()

    def max_positions(self, model: LlamaCppModel) -> int | None:
        return model.n_ctx

    def vocab_size(self, model: LlamaCppModel) -> int:
        return model.vocab_size

    def precision_of(self, model: LlamaCppModel) -> str:
        return model.precision + ("+repack" if model.repacked else "")


TORCH: Ops = TorchOps()
LLAMACPP: Ops = LlamaCppOps()


def _llamacpp() -> ModuleType | None:
    return sys.modules.get("ssd.models.llamacpp")


def is_llamacpp(obj: object) -> bool:
    """Whether `obj` is a llama.cpp model, context or sequence."""
    mod = _llamacpp()
    return mod is not None and isinstance(obj, (mod.LlamaCppModel, mod.LlamaCppContext, mod.LlamaCppSequence))


def ops_of(obj: object) -> Ops:
    """The backend of a model, sequence source or sequence (None, no rows: torch's, whose
    empty answers are the old ones). The one place that tells the backends apart."""
    if isinstance(obj, KVSequence):  # the hot path's rows: no look at llama.cpp's classes
        return TORCH
    own = getattr(type(obj), "backend_ops", None)  # a tensor-parallel target and its sequences (ssd.models.tp)
    if own is not None:
        return own
    return LLAMACPP if is_llamacpp(obj) else TORCH


def sequence_source(model: Model, rows: int, max_tokens: int, kv_tokens: int) -> Model | LlamaCppContext:
    """What an engine makes its sequences of `model` from (`new_sequence`).

    torch: the model itself. llama.cpp: one context with `rows` sequence
    slots, so the rows' forwards share one llama_decode; it takes up to
    `max_tokens` tokens per forward and `kv_tokens` per sequence (at most the
    model's `n_ctx`: its trained context unless the model was loaded with a smaller one). The context belongs to the engine's thread.
    """
    return ops_of(model).sequence_source(model, rows, max_tokens, kv_tokens)


def new_sequence(source: Model | LlamaCppContext, branches: int = 0) -> AnySequence:
    """A new, empty sequence of a model (its own) or of a `sequence_source` (a slot of its context).

    branches: the most branches `branch_decoder` will decode off this
    sequence at once (SSD's draft side). torch needs nothing for them;
    llama.cpp gives a sequence of a model that many spare slots in its
    context (each a KV stream of the context's length).
    """
    return ops_of(source).new_sequence(source, branches)


def has_free_slot(source: Model | LlamaCppContext) -> bool:
    """Whether `new_sequence(source)` has room: a llama.cpp context has a fixed number of slots."""
    return ops_of(source).has_free_slot(source)


def branch_decoder(sequence: AnySequence) -> Any | None:
    """The backend's own branch decoder for `sequence` (ssd.saguaro.branches.BranchDecoder),
    or None where the backend has none (torch: ssd.saguaro.branches picks one by name).

    llama.cpp: ssd.models.llamacpp.LlamaCppBranches, one sequence slot per branch.
    """
    return ops_of(sequence).branch_decoder(sequence)


def feed_rows(feeds: Sequence[kv.Feed]) -> list[torch.Tensor]:
    """`ssd.models.kv.feed_rows` on either backend. llama.cpp takes plain feeds only
    (committed tokens at consecutive positions: its branches are LlamaCppBranches'),
    packed into one llama_decode per context."""
    return ops_of(feeds[0].kv if feeds else None).feed_rows(feeds)


def model_of(sequence: AnySequence) -> Model:
    """The model a sequence runs (its KVSequence's, or its llama.cpp context's)."""
    return ops_of(sequence).model_of(sequence)


def device_of(model: Model) -> torch.device:
    """Where the model's logits live (llama.cpp: the CPU)."""
    return ops_of(model).device_of(model)


def device_name(model: Model) -> str:
    """Where a model runs, as the start-up plan's key names it (llama.cpp: "cpu")."""
    return ops_of(model).device_name(model)


def release(sequence: AnySequence | None) -> None:
    """Hand a finished row's sequence back (a llama.cpp slot); torch's caches go back when collected."""
    ops_of(sequence).release(sequence)


def forward_rows(
    rows: Sequence[AnySequence], ids: Sequence[Sequence[int]], last_only: bool | Sequence[bool] = False,
    prompt: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """`rows[i].forward(ids[i], last_only[i])` for every row, packed where the backend allows.

    The rows are distinct sequences of one model. `prompt[i]`: ids[i] is a prompt chunk whose
    every row's logits are wanted (llama.cpp runs it as it runs a last_only chunk, so its cache
    does not depend on that; torch's never does).
    """
    return ops_of(rows[0] if rows else None).forward_rows(rows, ids, last_only, prompt)


def kv_bytes_per_token(model: Model) -> int:
    """Bytes of keys and values one token takes in a sequence of `model`."""
    return ops_of(model).kv_bytes_per_token(model)


def max_positions(model: Model) -> int | None:
    """The most tokens one sequence of `model` holds (llama.cpp: its contexts' n_ctx;
    torch: the trained context), or None where the model does not say."""
    return ops_of(model).max_positions(model)


def vocab_size(model: Model) -> int:
    """Rows of the model's logits."""
    return ops_of(model).vocab_size(model)


def precision_of(model: Model) -> str:
    """The weights' precision as reports name it (torch: int8, bf16, fp32, fp64; llama.cpp:
    "gguf f32", "gguf q4_k_m", "gguf q4_k_m+repack" in llama.cpp's repacked layouts)."""
    return ops_of(model).precision_of(model)
