"""One sequence's KV cache on a llama.cpp model (issue 31: SSD on llama.cpp's CPU kernels).

The subset of `ssd.models.kv.KVSequence` an AR/SD engine needs, over
llama-cpp-python's low-level C API: `forward(ids, last_only)` -> float32
logits [len(ids) or 1, V] on the CPU, `rollback(length)`, `length`, `tokens`,
`catch_up`, `trim_to_prefix_of`, `reset`; and `forward_rows` packing several
sequences of one context into one `llama_decode`.

Three objects:

- `LlamaCppModel`: a GGUF file loaded once (`llama_model_load_from_file`),
  read-only, shared by any number of contexts.
- `LlamaCppContext`: one `llama_context` with `n_seq` sequence slots
  (llama.cpp seq_ids), each with its own KV stream (`kv_unified=False`,
  `n_ctx = n_seq * n_ctx_seq`). One owner thread, like a KVSequence: a
  llama_context is not thread-safe.
- `LlamaCppSequence`: one slot of a context. Built from a model it makes its
  own one-slot context; built from a context it takes a free slot there.

Why slots in one context rather than one context per sequence: one
`llama_decode` can only advance sequences of one context, so continuous
batching (forward_rows: many rows, one forward, shared matmuls) needs the
rows' sequences in one context; and the draft's tree build maps onto
sequences sharing a prefix (`llama_memory_seq_cp`), which also works only
inside one context. A lone sequence (the default) still gets its own
context, so the one-owner-thread rule of ssd.models holds with no extra care
(SSD's speculator thread drafts with its own sequence).

Options for batch invariance (a token's logits must not depend on how
many positions share its forward) come from `LlamaCppModel.invariant_options`:
F32/F16 weights keep flash attention off, an F32 KV cache and `pad_single`
(logits within ~2e-6 of the fp32 torch model); quantized weights get the
fastest options a probe finds bit-invariant past 256 positions (the real q4_k_m
pair: flash attention, a KV cache of BF16 keys over F16 values, at most 7 tokens a call
in plain layouts, 3 in repacked ones;
prompt chunks run alone, as whole ubatches, from fixed positions:
`LlamaCppContext.decode`). Quantized weights load in llama.cpp's repacked layouts
(`use_extra_bufts`, its default) where a probe in a child process finds that they
run (`repack_probe`). The draft's shared pool needs no invariance.
docs/llamacpp.md has the measurements.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np
import torch

import llama_cpp as L

from ssd.hardware import heartbeat
from ssd.models.branching import check_start

log = logging.getLogger(__name__)

# The KV cache's element types, as ggml_type: (keys, values); "K/V" names a pair of two types.
KV_TYPES = {"f32": (0, 0), "f16": (1, 1), "bf16": (30, 30), "bf16/f16": (30, 1)}
BRANCH_ROOM = 32  # KV cells a draft branch may add beyond the row's prefix (K + 1 tokens, K < 32)
REPACK_PROBE_TIMEOUT_S = 300  # the probe of the 1.5B q4_k_m target takes ~5 s
PREFILL_UBATCH = 512  # the most tokens of a prompt chunk one ubatch computes (llama.cpp's default n_ubatch)
# A shorter prompt chunk runs in place even where prompts run on the plain twin: moving the row's
# cache there and back cost more than the layouts saved (real q4_k_m target, AMD EPYC, 2 threads,
# after 850 tokens: 20 tokens 519 ms in place vs 674 ms moved, 40: 839 vs 891, 64: 1223 vs 1041).
PLAIN_PREFILL_MIN = 48
_init_lock = threading.Lock()
# A share of one llama_decode call: (job index, seq, start position, ids, which rows
# give logits: "all", "last" or "none").
_Piece = tuple[int, int, int, list[int], str]
WANTED = ("last", "all", "prompt")  # what a decode job wants: see LlamaCppContext.decode
_initialised = False


@L.llama_log_callback
def _quiet(level, text, user_data):  # noqa: ARG001 - llama.cpp's log callback signature
    return None


def _backend() -> None:
    """llama_backend_init once per process; llama.cpp's logging silenced (errors surface as return codes)."""
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(_quiet, ctypes.c_void_p(0))
            L.llama_backend_init()
            _initialised = True


class LlamaCppError(RuntimeError):
    """llama.cpp refused to load a model, make a context, or decode a batch."""


class LlamaCppModel:
    """A GGUF model loaded once: read-only, shared by every context made from it."""

    def __init__(self, path: str | Path, use_extra_bufts: bool | None = None, n_ctx: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, plain_prefill: bool | None = None,
                 kv_type: str | None = None) -> None:
        """use_extra_bufts: llama.cpp's repacked weight layouts (its default), which read
        each quantized weight once for several rows; None: where they run on this host
        (`repack_probe`, cached, in a child process: on an AVX512/AMX Xeon they died
        with SIGILL). `repacked` says which one loaded.

        plain_prefill: with repacked layouts, prompt chunks run on the same file in plain
        layouts (`plain_twin`) and their keys and values move to the repacked context;
        None: where the probe timed plain layouts faster at a prompt (AMD EPYC, AVX512:
        repacked decodes 1.27x faster, prefills 1.2-1.5x slower).

        n_ctx: the most tokens one sequence of this model may hold (default: the trained
        context). Every context made from the model sizes its slots by it, so a real model's
        contexts (the engine's, and SSD's draft slots and branches) are sized for the job
        rather than 32k tokens per slot.

        kv_type: the KV cache's type ("f16", "bf16", "f32", or "bf16/f16": BF16 keys, F16
        values); None: `kv_type`'s default (the probe's, exact). "f16" past 256 positions
        is as fast as "bf16/f16" and not batch-invariant.

        eos_token_ids: where generation ends (`generation_config.eos_token_id`, read by
        ssd.models.tokenizer.eos_token_ids); None: the GGUF's own EOS and EOT tokens,
        if its metadata names an EOS (llama.cpp otherwise assumes one)."""
        _backend()
        self.path = Path(path)
        self._model = self._load(use_extra_bufts or False)
        self.repacked = bool(use_extra_bufts)
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        self.n_ctx_train = L.llama_model_n_ctx_train(self._model)
        if n_ctx is not None and n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.n_ctx = min(self.n_ctx_train, n_ctx) if n_ctx else self.n_ctx_train
        desc = ctypes.create_string_buffer(256)
        L.llama_model_desc(self._model, desc, len(desc))
        self.description = desc.value.decode(errors="replace")  # "qwen2 ?B all F32": architecture, size, weight type
        self._invariant: dict | None = None
        if kv_type is not None and kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self._kv_type = kv_type
        eos = self._gguf_eos() if eos_token_ids is None else [int(t) for t in eos_token_ids]
        self.generation_config = SimpleNamespace(eos_token_id=eos)
        self.plain_twin: LlamaCppModel | None = None
        # Only quantized weights have repacked layouts; F32/F16 files skip the probe.
        probe = repack_probe(self.path) if use_extra_bufts is None and self.quantized else None
        if probe and probe["runs"]:
            L.llama_model_free(self._model)
            self._model = self._load(True)
            self.repacked = True
            if plain_prefill is None:
                plain_prefill = probe["plain_prefill_s"] < probe["repacked_prefill_s"]
        if self.repacked and plain_prefill:
            self.plain_twin = LlamaCppModel(self.path, use_extra_bufts=False, n_ctx=n_ctx,
                                            eos_token_ids=self.generation_config.eos_token_id, kv_type=kv_type)

    def _load(self, use_extra_bufts: bool):
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = use_extra_bufts
        model = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise LlamaCppError(f"llama.cpp could not load {self.path}")
        return model

    def _gguf_eos(self) -> list[int]:
        """EOS and EOT ids as the GGUF names them; none if its metadata names no EOS."""
        buf = ctypes.create_string_buffer(32)
        if L.llama_model_meta_val_str(self._model, b"tokenizer.ggml.eos_token_id", buf, len(buf)) < 0:
            return []
        vocab = L.llama_model_get_vocab(self._model)
        return sorted({t for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0})

    @property
    def quantized(self) -> bool:
        """Weights below F16 (q4_k, q8_0, ...): the draft-agnostic choices (KV cache in F16) follow llama.cpp's."""
        return self.precision not in ("gguf f32", "gguf f16")

    def invariant_options(self) -> dict:
        """The context options (flash_attn, pad_single) under which a token's logits do not
        depend on how many positions or rows share its forward, found once per model.

        F32/F16 weights keep what the tests prove exact against torch: no flash
        attention (it rounds keys and values to F16) and single-row padding (a
        one-row forward takes another matmul path there). Quantized weights are
        probed, fastest first: on the real q4_k_m pair flash attention without
        padding is bit-invariant, and the padding row costs ~1.6x a decode step
        (docs/llamacpp.md).
        """
        if self._invariant is None:
            if not self.quantized:
                self._invariant = {"flash_attn": False, "pad_single": True}
            else:
                self._invariant = _cached_probe(self)
        return dict(self._invariant)

    @property
    def precision(self) -> str:
        """The weights' type as reports name it: "gguf f32", "gguf f16", "gguf q8_0", "gguf q4_k_m"."""
        kind = self.description.split(maxsplit=2)[-1].lower().removeprefix("all ")  # "Q4_K - Medium", "all F32"
        for size, suffix in ((" - small", "_s"), (" - medium", "_m"), (" - large", "_l")):
            kind = kind.replace(size, suffix)
        return "gguf " + kind.replace(" ", "_")

    def kv_bytes_per_token(self, kv_type: str | None = None) -> int:
        """Bytes of keys and values one token takes in a context's cache of `kv_type`
        (default: the model's, see `kv_type`)."""
        kv_type = self.kv_type if kv_type is None else kv_type
        m = self._model
        head_dim = L.llama_model_n_embd(m) // L.llama_model_n_head(m)
        return L.llama_model_n_layer(m) * 2 * L.llama_model_n_head_kv(m) * head_dim * (4 if kv_type == "f32" else 2)

    @property
    def kv_type(self) -> str:
        """The KV cache's type: F32 for F32/F16 weights (the logits then match torch's to
        ~2e-6); for quantized weights the probe's (`invariant_options`): BF16 keys over F16
        values where ggml's flash attention would take its split-KV path for a lone query
        row over an F16 cache (see INVARIANCE_CANDIDATES)."""
        if self._kv_type is not None:
            return self._kv_type
        return "f32" if not self.quantized else self.invariant_options().get("kv", "f16")

    def close(self) -> None:
        if self.plain_twin is not None:
            self.plain_twin.close()
        if self._model:
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: llama_cpp may be gone
            pass


class LlamaCppContext:
    """A llama_context with `n_seq` sequence slots; one owner thread."""

    def __init__(
        self, model: LlamaCppModel, n_seq: int = 1, n_ctx_seq: int | None = None, n_threads: int | None = None,
        flash_attn: bool | None = None, kv_type: str | None = None, n_batch: int = 512,
        pad_single: bool | None = None, n_ubatch: int | None = None, shared_room: int = 0,
    ) -> None:
        """pad_single: never run a forward with a single output row (see `_decode_call`); a
        lone token gets a padding token after it, one cell past n_ctx_seq at most. flash_attn and
        pad_single default to the model's `invariant_options`; kv_type to the model's.
        n_threads None: torch's intra-op threads of the calling thread, followed at every
        decode (the cluster sets them to the actor's cores; the bench and the start-up
        plan change them between runs); a number fixes them.

        shared_room > 0: one KV pool for all slots (kv_unified) of n_ctx_seq + shared_room
        cells, where `copy` shares a prefix's cells instead of copying them: SSD's draft
        branches (slot 0 the row, the others its branches). Only the target needs a
        row's logits independent of other rows' cells, and it never uses this.
        """
        invariant = model.invariant_options() if None in (flash_attn, pad_single, n_ubatch) else {}
        flash_attn = invariant["flash_attn"] if flash_attn is None else flash_attn
        pad_single = invariant["pad_single"] if pad_single is None else pad_single
        if n_ubatch is None:  # a shared pool is the draft's: no invariance needed, whole forwards are faster
            n_ubatch = n_batch if shared_room > 0 else invariant.get("n_ubatch", n_batch)
        self.model = model
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq or model.n_ctx
        self.pad_single = pad_single
        slots = n_seq
        self.shared = shared_room > 0
        self._follow_torch = n_threads is None
        n_threads = torch.get_num_threads() if n_threads is None else n_threads
        self.n_threads = n_threads
        kv_type = model.kv_type if kv_type is None else kv_type
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self._n_stream = slots  # KV streams (one per slot; prompts move apart only where they are not shared)
        # A moved cache must fit the twin's context: the same cache types and attention.
        self._prompt_options = {"flash_attn": flash_attn, "kv_type": kv_type, "n_batch": n_batch}
        self._prompt_context: LlamaCppContext | None = None  # on model.plain_twin: see _prompt_chunk_apart
        params = L.llama_context_default_params()
        room = self.n_ctx_seq + (1 if pad_single else 0)  # a padding token's cell after a full sequence
        params.n_ctx = room + shared_room if self.shared else room * slots
        params.n_seq_max = slots
        # Not shared: one KV stream per sequence, so a row's attention never sees another's entries.
        params.kv_unified = self.shared
        params.n_batch = n_batch
        # The model's invariant_options say how many tokens a ubatch may hold before
        # ggml picks another matmul kernel: `decode` packs at most that many a call,
        # and gives llama.cpp longer ubatches only for prompt chunks, in calls of their own.
        self.n_ubatch = max(1, min(n_batch, n_ubatch))
        params.n_ubatch = min(n_batch, max(self.n_ubatch, PREFILL_UBATCH))
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k, params.type_v = KV_TYPES[kv_type]
        params.no_perf = True
        self.n_batch = n_batch
        self._ctx = L.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise LlamaCppError("llama.cpp could not make a context")
        self._memory = L.llama_get_memory(self._ctx)
        self._free = list(range(n_seq - 1, -1, -1))
        self._batch = L.llama_batch_init(n_batch, 0, 1)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def set_threads(self, n_threads: int) -> None:
        L.llama_set_n_threads(self._ctx, n_threads, n_threads)
        self.n_threads = n_threads

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take_slot(self) -> int:
        if not self._free:
            raise LlamaCppError(f"all {self.n_seq} sequence slots are taken")
        return self._free.pop()

    def give_slot(self, seq: int) -> None:
        if self._ctx:
            L.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free.append(seq)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Make sequence `dst` hold the first `length` entries of sequence `src` (dst's own are dropped).

        A shared pool (shared_room): dst's cells are src's. Otherwise slots are
        separate KV streams (kv_unified=False), and src's cells are read out and
        written into dst's stream now (`llama_memory_seq_cp` between streams
        only queues the copy until the next llama_decode, which a prompt chunk
        on the plain twin would read before: `_prompt_chunk_apart`); then dst's
        positions >= length are dropped. The copy holds src's very bits.
        """
        L.llama_memory_seq_rm(self._memory, dst, -1, -1)
        if self.shared:  # one pool: dst joins src's cells at positions < length, nothing is copied
            L.llama_memory_seq_cp(self._memory, src, dst, 0, length)
            return
        self._set_seq_state(dst, restream(self._seq_state(src), src, dst, dst, self._n_stream))
        self.remove(dst, length)

    def remove(self, seq: int, start: int) -> None:
        """Drop sequence `seq`'s entries at positions >= start."""
        if not L.llama_memory_seq_rm(self._memory, seq, start, -1):
            raise LlamaCppError(f"llama.cpp could not remove positions >= {start} of sequence {seq}")

    def decode(self, jobs: Sequence[tuple[int, int, Sequence[int], str]]) -> list[torch.Tensor]:
        """Logits per job (seq, start position, ids, wanted), in as few llama_decode calls as exactness allows.

        `wanted`: "last" (the last row's logits), "all" (every row's) or "prompt" (every
        row's, of a prompt chunk: a request that asks for its prompt's log-probabilities).
        A prompt chunk (a "last" or "prompt" job longer than `n_ubatch`) runs in a call of
        its own, as whole ubatches (on the plain twin where prompts run there), whatever it
        wants: its keys and values then depend on its tokens
        and start only, never on what else the step ran, because the engine starts
        chunks at fixed positions (ssd.engine.scheduler). That is 4-10x faster per token
        than the invariant ubatches. Every other job is packed, at most `n_ubatch`
        tokens a call, where a token's logits do not depend on the call's size.

        On failure every job's sequence is cut back to its start, so the
        cache holds what it held before the call.
        """
        total = sum(len(ids) for _, _, ids, _ in jobs)
        if total + (self.pad_single and total == 1) > self.n_batch:
            raise ValueError(f"{total} tokens in one forward: more than n_batch={self.n_batch}")
        for _, start, ids, _ in jobs:
            if start + len(ids) > self.n_ctx_seq:
                raise ValueError(f"sequence of {start + len(ids)} tokens: more than n_ctx_seq={self.n_ctx_seq}")
        pieces: list[list[torch.Tensor]] = [[] for _ in jobs]
        try:
            for call in self._calls(jobs):
                # A shared pool (SSD's draft) shares prefix cells between slots: its chunks stay here.
                apart = (self.model.plain_twin is not None and not self.shared
                         and len(call[0][3]) > max(self.n_ubatch, PLAIN_PREFILL_MIN - 1))
                for (index, *_), logits in zip(call, self._prompt_chunk_apart(call[0]) if apart
                                               else self._decode_call(call)):
                    pieces[index].append(logits)
        except LlamaCppError:
            for seq, start, _, _ in jobs:
                L.llama_memory_seq_rm(self._memory, seq, start, -1)
            raise
        return [torch.cat(p) if len(p) > 1 else p[0] for p in pieces]

    def _calls(self, jobs: Sequence[tuple[int, int, Sequence[int], bool]]) -> list[list[_Piece]]:
        """The llama_decode calls `decode` makes: each prompt chunk alone, the rest packed `n_ubatch` tokens a call."""
        calls: list[list[_Piece]] = []
        packed: list[_Piece] = []
        room = self.n_ubatch
        for index, (seq, start, ids, wanted) in enumerate(jobs):
            ids = [int(t) for t in ids]
            if wanted not in WANTED:
                raise ValueError(f"wanted must be one of {WANTED}, got {wanted!r}")
            every = wanted != "last"
            if len(ids) > self.n_ubatch and wanted != "all":  # a prompt chunk: its cache never depends on `wanted`
                calls.append([(index, seq, start, ids, "all" if every else "last")])
                continue
            at = 0
            while at < len(ids):
                end = at + min(room, len(ids) - at)
                outputs = "all" if every else "last" if end == len(ids) else "none"
                packed.append((index, seq, start + at, ids[at:end], outputs))
                room -= end - at
                at = end
                if room == 0:
                    calls.append(packed)
                    packed, room = [], self.n_ubatch
        return calls + [packed] if packed else calls

    def _decode_call(self, pieces: list[_Piece]) -> list[torch.Tensor]:
        """One llama_decode over `pieces`; the logits of each piece's output rows.

        With pad_single, a forward never has a single output row: ggml's
        matmuls take another kernel for one row than for several (measured:
        a token's logits differ by ~1e-6 relative between a one-token and a
        two-token forward, while every forward of >= 2 rows agrees to the
        bit). A piece with one output row among several tokens then also outputs
        its next-to-last row; a forward of one token in all gets a padding token
        after it in its own sequence, whose cell is removed again after the call.
        (Not on a slot of its own: llama.cpp splits a batch into ubatches of
        consecutive sequence ids, so the token and a pad on another slot would
        run as two one-row ubatches.)
        """
        total = sum(len(ids) for *_, ids, _ in pieces)
        pad = self.pad_single and total == 1
        batch, outputs, i, n_out = self._batch, [], 0, 0
        for _, seq, start, ids, wanted in pieces:
            rows = []
            for j, token in enumerate(ids):
                batch.token[i] = token
                batch.pos[i] = start + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                out = wanted == "all" or (wanted == "last" and j == len(ids) - 1)
                batch.logits[i] = out or (self.pad_single and wanted == "last" and j == len(ids) - 2)
                n_out += batch.logits[i]
                if out:
                    rows.append(i)
                i += 1
            outputs.append(rows)
        if self.pad_single and n_out < 2:
            if pad:  # one token in all: a padding token after it, in its sequence
                batch.token[i] = 0
                batch.pos[i] = batch.pos[0] + 1
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = batch.seq_id[0][0]
                batch.logits[i] = True
                i += 1
            else:  # one output row among several tokens: output another row too
                batch.logits[next(r for r in range(i) if not batch.logits[r])] = True
        batch.n_tokens = i
        if self._follow_torch and torch.get_num_threads() != self.n_threads:
            self.set_threads(torch.get_num_threads())
        rc = L.llama_decode(self._ctx, batch)
        if pad:
            L.llama_memory_seq_rm(self._memory, batch.seq_id[0][0], batch.pos[1], -1)
        if rc != 0:
            raise LlamaCppError(f"llama_decode returned {rc}")
        V = self.vocab_size
        result = []
        for rows in outputs:
            out = np.empty((len(rows), V), dtype=np.float32)
            for r, index in enumerate(rows):
                ptr = L.llama_get_logits_ith(self._ctx, index)
                out[r] = np.ctypeslib.as_array(ptr, shape=(V,))
            result.append(torch.from_numpy(out))
        return result

    def _prompt_chunk_apart(self, piece: _Piece) -> list[torch.Tensor]:
        """A prompt chunk run on the model's plain layouts (`LlamaCppModel.plain_twin`), where
        prompts go faster on some hosts: the row's cache so far moves to a one-slot context
        there, the chunk runs, and the row's cache comes back with the chunk's keys and values.
        Every mode prefills this way, so a prompt's cache still depends on the prompt alone."""
        _, seq, start, ids, outputs = piece
        if self._prompt_context is None:
            self._prompt_context = LlamaCppContext(
                self.model.plain_twin, n_ctx_seq=self.n_ctx_seq, n_threads=None if self._follow_torch else
                self.n_threads, pad_single=False, n_ubatch=PREFILL_UBATCH, **self._prompt_options)
        helper = self._prompt_context
        before = self._seq_state(seq) if start else None
        try:
            if before is not None:
                helper._set_seq_state(0, restream(before, seq, 0, 0, 1))
            logits = helper._decode_call([(0, 0, start, ids, outputs)])
            after = restream(helper._seq_state(0), 0, seq, seq, self._n_stream)
        finally:
            helper.remove(0, 0)
        try:
            self._set_seq_state(seq, after)
        except LlamaCppError:  # llama.cpp drops the row's cells when a restore fails: put them back
            if before is not None:
                self._set_seq_state(seq, before)
            raise
        return logits

    def _seq_state(self, seq: int) -> bytes:
        size = L.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        if L.llama_state_seq_get_data(self._ctx, buffer, size, seq) != size:
            raise LlamaCppError(f"llama.cpp could not read sequence {seq}'s cache")
        return bytes(buffer)

    def _set_seq_state(self, seq: int, state: bytes) -> None:
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if L.llama_state_seq_set_data(self._ctx, buffer, len(state), seq) != len(state):
            raise LlamaCppError(f"llama.cpp could not restore sequence {seq}'s cache")

    def close(self) -> None:
        if self._prompt_context is not None:
            self._prompt_context.close()
        if self._ctx:
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


_U32 = 4


def restream(state: bytes, stream: int, seq: int, new_stream: int, n_stream: int) -> bytes:
    """One sequence's cache (`llama_state_seq_get_data`) re-laid for a context of `n_stream`
    KV streams where it goes to stream `new_stream` of sequence `seq`.

    llama.cpp (0.3.36) writes a sequence's state as [magic, seq, n_stream] and then, per
    stream, its cell count and (if not 0) its cells; only the sequence's own stream has
    any. It refuses a state whose n_stream differs from the context's, though the cells
    themselves do not depend on it, so moving a row between a one-slot context and an
    n-slot one needs this. A layout that is not the expected one raises LlamaCppError.
    """
    words = len(state) // _U32
    magic, _, old_n = np.frombuffer(state[: 3 * _U32], dtype=np.uint32)
    tail = old_n - stream - 1
    lead = np.frombuffer(state[3 * _U32 : (3 + stream) * _U32], dtype=np.uint32)
    trail = np.frombuffer(state[len(state) - tail * _U32 :], dtype=np.uint32) if tail else lead[:0]
    if not (0 <= stream < old_n and words >= 3 + old_n) or lead.any() or trail.any():
        raise LlamaCppError("a sequence's cache is not laid out as llama.cpp 0.3.36 writes it")
    cells = state[(3 + stream) * _U32 : len(state) - tail * _U32]
    header = np.array([magic, seq, n_stream], dtype=np.uint32).tobytes()
    zeros = bytes(_U32)
    return header + zeros * new_stream + cells + zeros * (n_stream - new_stream - 1)


class LlamaCppSequence:
    """One sequence's KV cache on a llama.cpp model: KVSequence's AR/SD subset.

    Built from a LlamaCppModel: a context of its own (one slot). Built from a
    LlamaCppContext: a slot there, so `forward_rows` can pack it with the
    context's other sequences.
    """

    def __init__(
        self, source: LlamaCppModel | LlamaCppContext, n_threads: int | None = None, branches: int = 0,
        **context_options,
    ) -> None:
        """branches: built from a model, the context also gets this many free slots for
        LlamaCppBranches (SSD's draft side decodes its branches there), in one shared KV
        pool with BRANCH_ROOM cells per branch beyond the row's own."""
        if isinstance(source, LlamaCppModel):
            if branches:
                context_options.setdefault("shared_room", branches * BRANCH_ROOM)
            self.context = LlamaCppContext(source, n_seq=1 + branches, n_threads=n_threads, **context_options)
            self._owns_context = True
        else:
            if context_options or branches:
                raise ValueError("context options and branch slots belong to the shared context")
            self.context = source
            self._owns_context = False
        self.seq = self.context.take_slot()
        self.tokens: list[int] = []

    keeps_prefix = True  # may wait, idle, for a later prompt (ssd.engine.prefix; KVSequence.keeps_prefix)

    @property
    def length(self) -> int:
        """Committed tokens in the cache."""
        return len(self.tokens)

    @property
    def cached(self) -> int:
        return self.length

    @property
    def vocab_size(self) -> int:
        return self.context.vocab_size

    def reset(self) -> None:
        self.rollback(0)

    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append `ids` to the cache; float32 logits [len(ids), V] (or [1, V] if last_only).

        Row i is the next-token distribution after ids[i]. Any length, as a KVSequence takes:
        past the context's n_batch (one llama_decode's most), in pieces of it.
        """
        step = self.context.n_batch
        pieces = [forward_rows([self], [ids[i:i + step]], last_only)[0] for i in range(0, max(len(ids), 1), step)]
        return pieces[-1] if last_only or len(pieces) == 1 else torch.cat(pieces)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} of {self.length} tokens")
        if length < self.length:
            self.context.remove(self.seq, length)
            del self.tokens[length:]

    def catch_up(self, sequence: Sequence[int]) -> torch.Tensor:
        """Feed the tail of `sequence` the cache lacks; logits after its last token."""
        n = self.length
        if list(sequence[:n]) != self.tokens or n >= len(sequence):
            raise ValueError("KV cache is not a strict prefix of the sequence")
        return self.forward(sequence[n:], last_only=True)[-1]

    def trim_to_prefix_of(self, sequence: Sequence[int]) -> None:
        n = min(self.length, len(sequence) - 1)
        shared = next((i for i in range(n) if self.tokens[i] != sequence[i]), n)
        self.rollback(shared)

    def fork(self, length: int) -> "LlamaCppSequence":
        """A new sequence in another slot of this context holding this one's first `length`
        entries (the context copies the slot's KV stream: `LlamaCppContext.copy`)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot fork {length} of {self.length} tokens of this sequence")
        if self._owns_context:
            raise ValueError("a sequence with a context of its own has no slot to fork into")
        twin = LlamaCppSequence(self.context)
        self.context.copy(self.seq, twin.seq, length)
        twin.tokens = self.tokens[:length]
        return twin

    def close(self) -> None:
        if self.context is not None:
            self.context.give_slot(self.seq)
            if self._owns_context:
                self.context.close()
            self.context = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# Fastest first. ggml's CPU flash attention takes a split-KV path ("flash decoding": the
# cells cut among threads, partial sums merged) for a ubatch of one query row over a cache
# whose keys and values are both F16 (or both F32) of >= 512 cells, which llama.cpp's KV view
# reaches past 256 positions: there a lone decode step parts from the same token in a
# verification or beside other rows (by 0.3 in a logit on the real q4_k_m target). Any other
# cache takes the row-by-row path always. BF16 keys over F16 values decode as fast as F16's
# split path (its F16 values are summed as F16 values always are there); BF16 values are
# turned to F32 key by key, 5-20% slower a step at 1200-2400 positions (docs/llamacpp.md).
INVARIANCE_CANDIDATES = (
    {"flash_attn": True, "pad_single": False, "kv": "f16"},
    {"flash_attn": True, "pad_single": False, "kv": "bf16/f16"},
    {"flash_attn": True, "pad_single": False, "kv": "bf16"},
    {"flash_attn": False, "pad_single": False, "kv": "f16"}, {"flash_attn": True, "pad_single": True, "kv": "f16"},
    {"flash_attn": False, "pad_single": True, "kv": "f16"},
)
PROBE_TOKENS = 16  # the longest forward the probe tries; longer ones run as ubatches of what it finds
PROBE_LEAD = 260  # positions before the probe's forwards: past 256, where the KV view reaches 512 cells


def plan_signature() -> str:
    """What llama.cpp timings depend on beyond the config: its build, and the candidates that
    "auto" options are probed from (a new candidate can change the KV cache "auto" picks),
    for the start-up plan's cache key."""
    digest = hashlib.sha256(repr(INVARIANCE_CANDIDATES).encode()).hexdigest()[:8]
    return f"llama.cpp={L.__version__}/candidates={digest}"


def _first_invariant(model: LlamaCppModel) -> dict:
    """The first candidate options under which forwards of 2 or more tokens are bit-identical
    to decoding one token at a time, with `n_ubatch`: the most tokens one ubatch may hold
    while that stays true (ggml switches matmul kernels at some batch size: on the real
    q4_k_m pair at 8 tokens), so llama.cpp splits longer forwards into ubatches of that size.
    Each candidate logs a line when it ends, and a heartbeat while it runs: seconds a candidate."""
    name, count = model.path.name, len(INVARIANCE_CANDIDATES)
    log.info("%s: finding the fastest context options whose logits are batch-invariant (once per file, "
             "weight layout, llama.cpp build and host; %d candidates, fastest first)", name, count)
    for i, options in enumerate(INVARIANCE_CANDIDATES, 1):
        what = f"{name}: invariance candidate {i} of {count} {options}"
        started = time.perf_counter()
        with heartbeat(log, what):
            n_ubatch = invariant_tokens(model, **options)
        log.info("%s: invariant up to %d tokens a ubatch (%.1f s)", what, n_ubatch, time.perf_counter() - started)
        if n_ubatch >= 2:
            log.info("%s: batch-invariant with %s up to %d tokens a ubatch", name, options, n_ubatch)
            return {**options, "n_ubatch": n_ubatch}
    log.warning("%s: no option set tried keeps logits batch-invariant; greedy speculative output may "
                "part from AR at near-ties", name)
    return dict(INVARIANCE_CANDIDATES[-1])


def _cached_probe(model: LlamaCppModel) -> dict:
    """`_first_invariant`, kept on disk per GGUF file, weight layout, llama.cpp build and
    host (the probe takes seconds a load: ~4-6 s for the 1.5B target on one core)."""
    return _cached("invariance", model.path, ("repacked", model.repacked, "lead", PROBE_LEAD,
                                              "candidates", INVARIANCE_CANDIDATES),
                   lambda: _invariance(model))


def _probe_threads() -> int:
    """The invariance probe's threads: two at least, since with one ggml's split-KV path has one
    chunk and agrees with the rest (a lone decode parts from a batch only on two or more)."""
    return max(2, torch.get_num_threads())


def _invariance(model: LlamaCppModel) -> dict:
    """`_first_invariant` in this process, or in a child where this thread has fewer cores than
    the probe's threads (a cluster actor pinned to its one core). llama.cpp's OpenMP threads
    spin at each barrier as long as the cores the process started on allow, so two threads
    pinned onto one core after the start wait a time slice a barrier: the 0.5B draft's probe
    took 45.6 s so against 3.9 s (AMD EPYC, 2 cores). A child starts on this thread's cores,
    so its OpenMP sees one core and sleeps at barriers instead."""
    cores = len(os.sched_getaffinity(0))
    if cores >= _probe_threads():
        return _first_invariant(model)
    log.info("%s: the invariance probe runs in a child process (%d core here for its %d threads)",
             model.path.name, cores, _probe_threads())
    try:
        with heartbeat(log, f"{model.path.name}: the invariance probe's child"):  # its start and load are silent
            return _first_invariant_apart(model)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("%s: the invariance probe's child failed (%s); probing here", model.path.name, exc)
        return _first_invariant(model)


# `_first_invariant` on a GGUF file loaded as the parent loaded it; the answer as JSON on the last
# line of stdout, the progress lines on the parent's stderr.
_INVARIANCE_CHILD = """
import json, logging, sys
from ssd.models.llamacpp import LlamaCppModel, _first_invariant
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
path, repacked, twin, n_ctx = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
print(json.dumps(_first_invariant(LlamaCppModel(path, use_extra_bufts=repacked, n_ctx=n_ctx, plain_prefill=twin))))
"""
INVARIANCE_CHILD_TIMEOUT_S = 900  # the probe takes seconds; minutes only on a host far busier than ours


def _first_invariant_apart(model: LlamaCppModel) -> dict:
    """`_first_invariant` in a child process on this thread's cores (`_invariance`)."""
    args = [sys.executable, "-c", _INVARIANCE_CHILD, str(model.path), str(int(model.repacked)),
            str(int(model.plain_twin is not None)), str(model.n_ctx)]
    # This process's ssd; OpenMP threads that sleep at a barrier rather than spin: the probe's
    # answer does not depend on its speed, and a busy host then cannot stall it a time slice a barrier.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(args, stdout=subprocess.PIPE, text=True, env=env, check=True,
                          timeout=INVARIANCE_CHILD_TIMEOUT_S)
    return json.loads(done.stdout.splitlines()[-1])


def _cached(kind: str, gguf: Path, extra: tuple, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON result, kept in the cache per `kind`, GGUF file, llama.cpp build and host."""
    from ssd import hardware
    from ssd.models.offline import cache_dir, cached_json

    stat = gguf.stat()
    key = hashlib.sha256(repr((str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, L.__version__,
                               hardware.describe(), *extra)).encode()).hexdigest()[:20]
    return cached_json(cache_dir() / "llamacpp" / f"{kind}-{key}.json", compute)


# Loads a GGUF in repacked layouts and decodes 8 tokens, then 1 (the multi-row and one-row
# kernels), then times a 64-token prompt in both layouts (best of 3, interleaved); prints both.
# Only llama_cpp is imported: the child starts in ~0.3 s.
_REPACK_CHILD = """
import sys, time
import llama_cpp as L
L.llama_backend_init()

def context(use_extra_bufts):
    params = L.llama_model_default_params()
    params.n_gpu_layers, params.use_extra_bufts = 0, use_extra_bufts
    model = L.llama_model_load_from_file(sys.argv[1].encode(), params)
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 128, 64, 64
    cparams.n_threads = cparams.n_threads_batch = int(sys.argv[2])
    context.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)) if model else 1
    return L.llama_init_from_model(model, cparams) if model else None

def decode(ctx, ids):
    tokens = (L.llama_token * len(ids))(*ids)
    if L.llama_decode(ctx, L.llama_batch_get_one(tokens, len(ids))) != 0:
        sys.exit(4)

def prefill_s(ctx):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    start = time.perf_counter()
    decode(ctx, [(7 * i + 3) % context.vocab for i in range(64)])
    return time.perf_counter() - start

repacked = context(True)
if not repacked:
    sys.exit(3)
decode(repacked, [i % context.vocab for i in range(1, 9)])  # ids within any vocabulary
decode(repacked, [9 % context.vocab])
plain = context(False)
times = [(prefill_s(plain), prefill_s(repacked)) for _ in range(3)]  # interleaved: both see the same load
print(min(t[0] for t in times), min(t[1] for t in times))
"""


def repack_probe(gguf: Path) -> dict:
    """Whether llama.cpp's repacked weight layouts load and decode `gguf` on this host
    ("runs"), and a 64-token prompt's time in plain and repacked layouts: tried once in a
    child process (a kernel this CPU lacks kills the child with SIGILL, not us) on the
    threads torch has here, cached per file, llama.cpp build and host."""
    def probe() -> dict:
        failed = {"runs": False, "plain_prefill_s": None, "repacked_prefill_s": None}
        what = f"{gguf.name}: llama.cpp's repacked weight layouts, tried in a child process"
        log.info("%s, and a prompt timed in both layouts (once per file, build and host)", what)
        try:
            with heartbeat(log, what):
                done = subprocess.run([sys.executable, "-c", _REPACK_CHILD, str(gguf), str(torch.get_num_threads())],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      timeout=REPACK_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s: the repacked-layout probe ran past %d s; loading plain layouts",
                        gguf.name, REPACK_PROBE_TIMEOUT_S)
            return failed
        if done.returncode != 0:
            log.warning("%s: llama.cpp's repacked weight layouts fail on this host (exit %d); loading plain "
                        "layouts", gguf.name, done.returncode)
            return failed
        plain_s, repacked_s = (float(x) for x in done.stdout.split()[-2:])
        log.info("%s: they run; a 64-token prompt took %.0f ms plain, %.0f ms repacked", what, plain_s * 1e3,
                 repacked_s * 1e3)
        return {"runs": True, "plain_prefill_s": plain_s, "repacked_prefill_s": repacked_s}

    child = hashlib.sha256(_REPACK_CHILD.encode()).hexdigest()[:12]  # a mended probe asks again
    return _cached("repack", gguf, ("threads", torch.get_num_threads(), "child", child), probe)


def invariant_tokens(model: LlamaCppModel, flash_attn: bool, pad_single: bool, kv: str | None = None,
                     n: int = PROBE_TOKENS, lead: int = PROBE_LEAD) -> int:
    """The most tokens m <= n such that every forward of up to m tokens, one row or two rows
    packed, gives logits bit-identical to decoding its tokens one at a time (0: not even one),
    after `lead` positions (none where the model's context is under 512: its view never
    reaches 512 cells). `kv`: the cache's type (default F32 for F32/F16 weights, else F16)."""
    kv = kv or ("f16" if model.quantized else "f32")
    lead = lead if model.n_ctx >= 512 else 0
    ids = [(7 * i + 3) % model.vocab_size for i in range(n)]
    context = LlamaCppContext(model, n_seq=3, n_ctx_seq=lead + 2 * n, flash_attn=flash_attn, pad_single=pad_single,
                              kv_type=kv, n_ubatch=n, n_threads=_probe_threads())
    alone, row, other = (LlamaCppSequence(context) for _ in range(3))
    if lead:
        alone.forward([(5 * i + 1) % model.vocab_size for i in range(lead)], last_only=True)
        for sequence in (row, other):
            context.copy(alone.seq, sequence.seq, lead)
            sequence.tokens = list(alone.tokens)

    def fed(*forwards: torch.Tensor) -> list[torch.Tensor]:  # the rows go back to the lead
        for sequence in (row, other):
            sequence.rollback(lead)
        return list(forwards)

    decoded: list[torch.Tensor] = []  # `alone`'s logits, a token a forward (its own KV stream)

    def one_by_one(m: int) -> torch.Tensor:
        # Decoded only as far as a comparison reaches: a candidate that fails does so within
        # a few tokens (on the real pair: at 1 and 4 of 16), and each decode reads all weights.
        while len(decoded) < m:
            decoded.append(alone.forward([ids[len(decoded)]]))
        return torch.cat(decoded[:m])

    if not pad_single and not torch.equal(one_by_one(1), fed(row.forward(ids[:2]))[0][:1]):
        return 0  # a one-row forward parts from a two-row one
    for m in range(2, n + 1):
        together, = fed(row.forward(ids[:m]))
        half = m // 2
        _, packed = fed(*forward_rows([row, other], [ids[:half], ids[: m - half]]))
        if not (torch.equal(together, one_by_one(m)) and torch.equal(packed, one_by_one(m - half))):
            return m - 1
    return n


def forward_rows(
    rows: Sequence[LlamaCppSequence], ids: Sequence[Sequence[int]], last_only: bool | Sequence[bool] = False,
    prompt: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """`rows[i].forward(ids[i], last_only[i])` for every row; one llama_decode per context.

    Rows of one context go into one batch (each its own seq_id and
    positions); rows of different contexts run context by context.
    `prompt[i]`: ids[i] is a prompt chunk (every row's logits wanted, its cache computed
    as a last_only chunk's would be: LlamaCppContext.decode).
    """
    flags = [last_only] * len(rows) if isinstance(last_only, bool) else list(last_only)
    prompt = list(prompt) if prompt is not None else [False] * len(rows)
    if len(rows) != len(ids) or len(rows) != len(flags):
        raise ValueError(f"{len(rows)} rows, {len(ids)} id lists and {len(flags)} last_only flags")
    if len({id(r) for r in rows}) != len(rows):
        raise ValueError("a sequence appears twice in one forward")
    results: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        if not ids[i]:
            raise ValueError("forward needs at least one token")
        groups.setdefault(id(row.context), []).append(i)
    for members in groups.values():
        context = rows[members[0]].context
        jobs = [(rows[i].seq, rows[i].length, [int(t) for t in ids[i]],
                 "last" if flags[i] else "prompt" if prompt[i] else "all") for i in members]
        for i, logits in zip(members, context.decode(jobs)):
            rows[i].tokens.extend(int(t) for t in ids[i])
            results[i] = logits
    return results  # type: ignore[return-value]


class LlamaCppBranches:
    """SSD's branch decoder (ssd.saguaro.branches.BranchDecoder) on a LlamaCppSequence.

    Each branch is a sequence slot of the sequence's own context: `start`
    copies the root's cache into it (LlamaCppContext.copy) and cuts it to
    the branch's prefix; every call then feeds one token per branch in ONE
    llama_decode, each at its own seq_id and position (llama.cpp's mask keeps
    a branch to its own stream, so no visibility matrix is built). `finish`
    hands the slots back; the root sequence is never written, so it holds
    exactly what it held before `start`.

    The context needs a free slot per branch (ssd.models.backend.new_sequence
    with `branches`). One owner thread, like the sequence.
    """

    def __init__(self) -> None:
        self._kv: LlamaCppSequence | None = None
        self._slots: list[int] = []
        self._positions: list[int] = []

    @property
    def active(self) -> bool:
        return self._kv is not None

    @property
    def num_branches(self) -> int:
        return len(self._slots)

    def start(self, kv: LlamaCppSequence, prefix_lens: Sequence[int], first_tokens: Sequence[int]) -> torch.Tensor:
        """Feed each branch's first token after its prefix of `kv`'s cache; logits [B, V]."""
        check_start(self._kv is not None, kv.length, prefix_lens, first_tokens)
        context = kv.context
        if len(context._free) < len(prefix_lens):
            raise LlamaCppError(
                f"{len(prefix_lens)} branches need as many free sequence slots; the draft's context has "
                f"{len(context._free)} (make the sequence with branches=...)"
            )
        self._kv = kv
        try:
            for p in prefix_lens:
                slot = context.take_slot()
                self._slots.append(slot)
                context.copy(kv.seq, slot, int(p))
            self._positions = [int(p) for p in prefix_lens]
            return self.step(first_tokens)
        except BaseException:
            self.finish()
            raise

    def step(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one token per branch; logits [B, V] after it."""
        if self._kv is None:
            raise RuntimeError("no active branches: call start() first")
        if len(tokens) != len(self._slots):
            raise ValueError(f"need one token per branch ({len(self._slots)}), got {len(tokens)}")
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        jobs = [(slot, pos, [t], "all") for slot, pos, t in zip(self._slots, self._positions, ids)]
        try:
            logits = self._kv.context.decode(jobs)
        except BaseException:
            self.finish()
            raise
        self._positions = [p + 1 for p in self._positions]
        return torch.cat(logits)

    def finish(self) -> None:
        """Hand the branch slots back; the root sequence is as before `start`."""
        if self._kv is None:
            return
        context, self._kv = self._kv.context, None
        if context is not None:
            for slot in self._slots:
                context.give_slot(slot)
        self._slots, self._positions = [], []

