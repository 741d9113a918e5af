"""Tensor-parallel target: one process per device, rank 0 leads, the rest mirror.

transformers shards the model (`DistributedConfig(tp_plan="auto")`); every
forward then runs all-reduces inside, so all target ranks must call the model
in exactly the same order. Rank 0 owns sampling and verification, so it drives:
`TPLeader` is the target model the engines get (with backend operations of its
own: ssd.models.backend), and each of its sequences (`TPSequence`, one per row
of the continuous batch, cached prefix or probe) broadcasts every cache
operation as a small int64 command naming its slot before running it (a
rollback rides with the next command); a packed forward's command carries
every row's slot, length and last_only, then the ids.
`run_tp_follower` replays those commands on the other ranks, on one KVSequence
per slot, until told to stop, so every rank runs the same packed forward.

A forward that raises on any rank (a CUDA OOM on a long prompt, say) breaks
the group for good: the other ranks wait in the model's all-reduces or for
the next command. So a failed forward is never retried here: it raises
TPForwardError on its rank (the follower's run_tp_follower returns with it;
the leader refuses every later command), and the cluster restarts the group
as it does a lost rank (ssd.cluster.runtime). A rank that hangs is noticed by
the others within TP_TIMEOUT, every collective's limit once the ranks serve;
an idle follower, which waits for the next command in a broadcast, is kept
from that limit by the leader's keepalive (a no-op command a third of the
timeout after the last).

The world built here holds only the target ranks: a draft rank in the same
world (with TP on a sub-mesh) hung in `from_pretrained` when we tried it; the
draft link is a separate two-rank group.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from ssd.config import AUTO, ConfigError, ModelConfig
from ssd.models.fast import note_lean_path
from ssd.models.backend import TorchOps
from ssd.models.kv import Feed, KVSequence, forward_rows
from ssd.models.loading import TINY, TORCH_DTYPES, build_tiny_model, load_model, resolve_precision, resolve_source

log = logging.getLogger(__name__)

Group = dist.ProcessGroup | None  # None: the default (target-only) world

# Command op codes. A command is a header [op, a, b, n, r] then, if n > 0, n int64s: r
# (slot, length) rollbacks that the follower applies first, then the op's payload. FORWARD
# a rows, payload (slot, tokens, last_only) per row then every row's ids; RESET slot a;
# FORK slot a's first b tokens as slot payload[0]; RELEASE the payload's slots; NOOP: the
# keepalive. A rollback is no command of its own: it waits for the next one (after a
# verification every rolled-back row's would otherwise cost a broadcast).
OP_STOP, OP_FORWARD, OP_RESET, OP_FORK, OP_RELEASE, OP_NOOP = range(6)
OP_NAMES = ("stop", "forward", "reset", "fork", "release", "keepalive")
_HEADER = 5
_SEGMENT = 3
Rollbacks = dict[int, int]  # slot -> the length its follower copies roll back to

# Loading waits long between collectives (rank 0 may convert a checkpoint while the others
# wait in a barrier; a large shard takes minutes to read): the world starts with this limit.
LOAD_TIMEOUT = timedelta(hours=2)
# Once the ranks serve, a collective that waits longer than this fails (gloo ends it; measured:
# a 3 s limit ended a waiting follower after 3 s), so a hung rank is noticed within it. An
# idle follower waits for the next command in a broadcast: the leader's keepalive sends a
# no-op KEEPALIVES_PER_TIMEOUT times per limit. A dead peer is noticed at once anyway (the
# pending collective fails with "connection closed/reset by peer").
TP_TIMEOUT = timedelta(minutes=5)
KEEPALIVES_PER_TIMEOUT = 3


# What a tensor-parallel split divides over the ranks: attention heads (queries and KV heads),
# the MLP's columns and the vocabulary (the LM head and the embedding).
TP_DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def undivided(shape: dict[str, int], world: int) -> list[str]:
    """The dimensions of `shape` (TP_DIVIDED's) that `world` ranks cannot split, as "name = value"."""
    return [f"{name} = {shape[name]}" for name in TP_DIVIDED if shape[name] % world]


class TPForwardError(RuntimeError):
    """A forward failed on a tensor-parallel rank: the group must be started again."""


def tp_backend(device: str) -> str:
    """The TP world's backend for ranks computing on `device`.

    Control commands are host tensors and go over gloo; on GPUs the model's
    all-reduces are CUDA tensors and go over NCCL. torch dispatches each
    collective by its tensors' device.
    """
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def init_tp_world(
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 29500,
    backend: str = "gloo",
    timeout: timedelta = LOAD_TIMEOUT,
) -> None:
    """Join the default process group made of the target ranks only.

    `timeout` bounds every collective while the model loads; the ranks set
    TP_TIMEOUT (or the one they are given) when they start serving (`serve_timeout`).
    """
    # transformers reads these when it sets up its device mesh: LOCAL_RANK picks the
    # accelerator. On GPUs every rank sees the group's GPUs and the cluster set its
    # LOCAL_RANK (ssd.cluster.placing.actor_env); on a CPU there is none to pick: 0.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size, timeout=timeout
    )
    log.info("target rank %d/%d joined %s world at %s:%d", rank, world_size, backend, host, port)


def pin_threads(rank: int, threads: int) -> None:
    """Give this rank `threads` intra-op threads on cores of its own (best effort)."""
    torch.set_num_threads(threads)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= (rank + 1) * threads:
        os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads])


def local_gpu() -> int:
    """This rank's GPU among those it sees (the group's): LOCAL_RANK, 0 where unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def load_tp_model(cfg: ModelConfig, device: str = "cpu") -> torch.nn.Module:
    """The target, sharded over the default world when it has more than one rank.

    Every rank of the world must call this (loading is collective). On
    "cuda", the rank's own GPU among the group's (transformers places the shard on
    cuda:LOCAL_RANK).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return load_model(cfg, device)
    if cfg.backend == "llamacpp":
        raise ConfigError("tensor parallelism runs on torch: model.backend llamacpp takes one target device")
    if device == "cuda":
        torch.cuda.set_device(local_gpu())
    if cfg.quantization == AUTO:  # int8 layers cannot be sharded: auto means unquantized here
        cfg = dataclasses.replace(cfg, quantization=None)
    cfg = resolve_precision(cfg, device)
    if cfg.quantization:
        raise ConfigError("tensor parallelism does not support model.quantization")
    if cfg.name == TINY:
        return _load_tiny_sharded(cfg, world)
    # Rank 0 resolves first: an offline-registry name may be converted on first use.
    if dist.get_rank() == 0:
        source = resolve_source(cfg.name)
    dist.barrier()
    if dist.get_rank() != 0:
        source = resolve_source(cfg.name)
    return _from_pretrained_tp(source, TORCH_DTYPES[cfg.dtype], world)


def _from_pretrained_tp(source: str, dtype: torch.dtype, world: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # tp_size explicitly: left out, transformers derives it from $WORLD_SIZE.
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=dtype,
        attn_implementation="sdpa",
        distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"),
    )
    model.eval()
    model.requires_grad_(False)
    note_lean_path(model)
    return model


def _load_tiny_sharded(cfg: ModelConfig, world: int) -> torch.nn.Module:
    """Tiny models have no checkpoint: TP runs on exactly the weights `load_model(cfg)` builds."""
    tcfg = cfg.tiny
    if wrong := undivided({name: getattr(tcfg, name) for name in TP_DIVIDED}, world):
        raise ConfigError(f"the tiny model's {', '.join(wrong)} must divide by the tensor-parallel size {world}")
    return load_built_sharded(lambda: build_tiny_model(tcfg, TORCH_DTYPES[cfg.dtype]), TORCH_DTYPES[cfg.dtype], world)


def load_built_sharded(build: Callable[[], torch.nn.Module], dtype: torch.dtype, world: int) -> torch.nn.Module:
    """A model made in memory (`build()`, run on rank 0 only), sharded over the world:
    rank 0 saves it as a checkpoint, every rank loads that sharded, and the files go."""
    path = ""
    if dist.get_rank() == 0:
        path = tempfile.mkdtemp(prefix="ssd-tp-tiny-")
        build().save_pretrained(path)
    path = _broadcast_str(path)
    try:
        return _from_pretrained_tp(path, dtype, world)
    finally:
        dist.barrier()  # everyone has read the files
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def _broadcast_str(text: str, group: Group = None) -> str:
    """Rank 0's `text` on every rank (as bytes in tensors, no pickle)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=0)
    if dist.get_rank(group) != 0:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, group=group, group_src=0)
    return bytes(data.tolist()).decode()


def serve_timeout(timeout: timedelta, group: Group = None) -> None:
    """From now on each collective of this rank waits at most `timeout` (the ranks start serving:
    the loads, which may wait long between collectives, are over)."""
    _set_pg_timeout(timeout, group)
    log.info("TP rank %d: collectives time out after %.0f s", dist.get_rank(group), timeout.total_seconds())


def _send_command(op: int, a: int = 0, b: int = 0, payload: Sequence[int] = (), group: Group = None,
                  rollbacks: Rollbacks | None = None) -> None:
    data = [n for pair in (rollbacks or {}).items() for n in pair] + list(payload)
    dist.broadcast(torch.tensor([op, a, b, len(data), len(rollbacks or ())], dtype=torch.int64),
                   group=group, group_src=0)
    if data:
        dist.broadcast(torch.tensor(data, dtype=torch.int64), group=group, group_src=0)


def _recv_command(group: Group = None) -> tuple[int, int, int, list[int], Rollbacks]:
    """(op, a, b, payload, rollbacks to apply first)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=0)
    op, a, b, n, r = header.tolist()
    data = torch.empty(n, dtype=torch.int64)
    if n:
        dist.broadcast(data, group=group, group_src=0)
    data = data.tolist()
    return op, a, b, data[2 * r :], dict(zip(data[: 2 * r : 2], data[1 : 2 * r : 2]))


class TPLeader:
    """Target rank 0's handle on the tensor-parallel group: a model to the engines (with
    backend operations of its own, TP_OPS), whose sequences (TPSequence) every follower mirrors.

    Each operation runs under one lock: its command, then the leader's own part (a forward's
    all-reduces included), so the keepalive's no-op never falls between them. Arguments are
    checked before broadcasting: a command that fails on the leader must not reach the
    followers, or the ranks would drift apart; once one has failed after its broadcast (a
    forward raised, a peer hung past the timeout), every later command raises TPForwardError.
    """

    backend_ops: "TPOps"  # set below the class (ssd.models.backend.ops_of)

    def __init__(self, model: torch.nn.Module, group: Group = None, timeout: timedelta = TP_TIMEOUT,
                 keepalive: bool = True) -> None:
        if dist.get_rank(group) != 0:
            raise RuntimeError("TPLeader belongs on TP rank 0; other ranks run run_tp_follower")
        self.model, self.group, self.timeout = model, group, timeout
        self.world = dist.get_world_size(group)
        self.stopped = False
        self.failed: str | None = None  # why the group is broken, once an operation failed after its broadcast
        self._lock = threading.Lock()
        self._slots = itertools.count()
        self._live: dict[int, weakref.ref] = {}  # slot -> its sequence, until released
        self._rollbacks: Rollbacks = {}  # done here, sent with the next command
        self._last_command = time.monotonic()
        self._done = threading.Event()
        serve_timeout(timeout, group)
        if keepalive:
            threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True).start()

    # --- what engines read of a model -------------------------------------------------

    @property
    def config(self) -> object:
        return self.model.config

    @property
    def generation_config(self) -> object:
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- sequences ---------------------------------------------------------------------

    def sequence(self) -> "TPSequence":
        """A new empty sequence; the followers make theirs at its first command."""
        self._sweep()
        slot = next(self._slots)
        sequence = TPSequence(self, slot, KVSequence(self.model))
        self._live[slot] = weakref.ref(sequence)
        return sequence

    def forward_rows(self, rows: Sequence["TPSequence"], ids: Sequence[Sequence[int]],
                     last_only: bool | Sequence[bool] = False) -> list[torch.Tensor]:
        """ssd.models.kv.forward_rows on every rank: one command carrying each row's slot, length
        and last_only, then the ids; each rank packs the same forward over its sequences."""
        flags = [last_only] * len(rows) if isinstance(last_only, bool) else list(last_only)
        ids = [[int(t) for t in x] for x in ids]
        if not len(rows) == len(ids) == len(flags):
            raise ValueError(f"{len(rows)} rows, {len(ids)} id lists and {len(flags)} last_only flags")
        if any(row.leader is not self for row in rows) or not all(ids):
            raise ValueError("forward needs at least one token per row, each a sequence of this group")
        segments = [n for row, x, flag in zip(rows, ids, flags) for n in (row.slot, len(x), int(flag))]
        local = [row.local for row in rows]
        return self._run(OP_FORWARD, len(rows), 0, segments + [t for x in ids for t in x],
                         lambda: forward_rows(local, ids, flags))

    def fork(self, source: "TPSequence", length: int) -> "TPSequence":
        local = source.local.fork(length)  # refuses (ValueError) before anything is broadcast
        slot = next(self._slots)
        self._run(OP_FORK, source.slot, length, [slot])
        twin = TPSequence(self, slot, local)
        self._live[slot] = weakref.ref(twin)
        return twin

    def rollback(self, sequence: "TPSequence", length: int) -> None:
        """Roll `sequence` back here now and on the followers before the next command (which
        is the next that could read it): a later rollback of it before then replaces this one."""
        with self._lock:  # the next command, from whichever thread, takes all or none of them
            sequence.local.rollback(length)
            self._rollbacks[sequence.slot] = length

    def release(self, sequence: "TPSequence") -> None:
        """The followers drop their copy of `sequence` (nothing to do once the group is stopped or broken)."""
        if self._live.pop(sequence.slot, None) is not None and self.failed is None and not self.stopped:
            self._run(OP_RELEASE, payload=[sequence.slot])

    def _sweep(self) -> None:
        """Release the sequences collected without `release` (the followers' copies would stay)."""
        dead = [slot for slot, ref in list(self._live.items()) if ref() is None]
        for slot in dead:
            del self._live[slot]
        if dead:
            self._run(OP_RELEASE, payload=dead)

    # --- commands ----------------------------------------------------------------------

    def _run(self, op: int, a: int = 0, b: int = 0, payload: Sequence[int] = (),
             local: Callable[[], object] | None = None) -> object:
        """Broadcast a command, then run the leader's part of it (`local`), under the lock."""
        with self._lock:
            if self.stopped:
                raise RuntimeError("the TP followers were stopped")
            if self.failed is not None:
                raise TPForwardError(f"{self.failed}; the group awaits its restart")
            try:
                rollbacks, self._rollbacks = self._rollbacks, {}
                _send_command(op, a, b, payload, self.group, rollbacks)
                self._last_command = time.monotonic()
                return local() if local is not None else None
            except Exception as exc:
                # The followers ran (or wait in) what this rank did not finish: the ranks drifted apart.
                self.failed = f"the {OP_NAMES[op]} failed on target rank 0: {type(exc).__name__}: {exc}"
                log.error("%s; the tensor-parallel group must be restarted", self.failed)
                raise TPForwardError(self.failed) from exc

    def _keep_alive(self) -> None:
        """A no-op command whenever the group has been idle a third of the timeout: an idle
        follower waits for the next command in a broadcast, which the timeout would end."""
        interval = self.timeout.total_seconds() / KEEPALIVES_PER_TIMEOUT
        while not self._done.wait(max(0.0, self._last_command + interval - time.monotonic())):
            if time.monotonic() - self._last_command < interval:
                continue  # a command went out meanwhile
            with self._lock:
                if self.stopped or self.failed is not None:
                    return
                try:
                    _send_command(OP_NOOP, group=self.group)
                except Exception as exc:  # noqa: BLE001 - the next command reports it
                    self.failed = f"a keepalive failed on target rank 0: {type(exc).__name__}: {exc}"
                    log.error("%s; the tensor-parallel group must be restarted", self.failed)
                    return
                self._last_command = time.monotonic()

    def stop(self) -> None:
        """Release the followers (`run_tp_follower` returns) and end the keepalive; idempotent."""
        self._done.set()
        if not self.stopped and self.failed is None:
            self._sweep()  # the followers' copies of collected sequences go first
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            if self.failed is None:
                _send_command(OP_STOP, group=self.group)

    def __enter__(self) -> "TPLeader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TPSequence:
    """One sequence of a tensor-parallel target, mirrored on every rank: the leader's
    KVSequence (`local`) and, on each follower, the one of the same slot. It offers what
    the engines ask of a target's sequence; each change goes through its TPLeader."""

    backend_ops: "TPOps"  # set below (ssd.models.backend.ops_of)
    # Built on forward and rollback, which mirror: the KVSequence code, run on this object.
    catch_up = KVSequence.catch_up
    trim_to_prefix_of = KVSequence.trim_to_prefix_of

    def __init__(self, leader: TPLeader, slot: int, local: KVSequence) -> None:
        self.leader, self.slot, self.local = leader, slot, local

    @property
    def model(self) -> TPLeader:
        return self.leader

    @property
    def tokens(self) -> list[int]:
        return self.local.tokens

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def cached(self) -> int:
        return self.local.cached

    @property
    def lean(self) -> bool:
        return self.local.lean

    @property
    def sliding(self) -> bool:
        return self.local.sliding

    @property
    def keeps_prefix(self) -> bool:
        return self.local.keeps_prefix

    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        return self.leader.forward_rows([self], [ids], [last_only])[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} of {self.length} tokens")
        if length < self.length:
            self.leader.rollback(self, length)

    def reset(self) -> None:
        self.leader._run(OP_RESET, self.slot, local=self.local.reset)

    def fork(self, length: int) -> "TPSequence":
        return self.leader.fork(self, length)

    def release(self) -> None:
        self.leader.release(self)


class TPOps(TorchOps):
    """The backend operations (ssd.models.backend) of a tensor-parallel target: its TPLeader is
    the model and the sequence source, its sequences TPSequences."""

    def sequence_source(self, model: TPLeader, rows: int, max_tokens: int, kv_tokens: int) -> TPLeader:
        return model

    def new_sequence(self, source: TPLeader, branches: int) -> TPSequence:
        return source.sequence()

    def feed_rows(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        if any(f.commit != len(f.ids) or f.positions is not None or f.visible is not None for f in feeds):
            raise NotImplementedError("a tensor-parallel target takes committed tokens only (no branches)")
        return self.forward_rows([f.kv for f in feeds], [f.ids for f in feeds], [f.last_only for f in feeds], None)

    def forward_rows(self, rows: Sequence[TPSequence], ids: Sequence[Sequence[int]],
                     last_only: bool | Sequence[bool], prompt: Sequence[bool] | None) -> list[torch.Tensor]:
        return rows[0].leader.forward_rows(rows, ids, last_only) if rows else []

    def model_of(self, sequence: TPSequence) -> TPLeader:
        return sequence.leader

    def device_of(self, model: TPLeader) -> torch.device:
        return model.model.device

    def device_name(self, model: TPLeader) -> str:
        return f"{model.model.device} tp{model.world}"  # a plan's key: TP=2's costs are not TP=1's

    def release(self, sequence: TPSequence | None) -> None:
        if sequence is not None:
            sequence.release()

    def kv_bytes_per_token(self, model: TPLeader) -> int:
        """What one rank holds of a token (its share of the KV heads): each rank's memory is the limit."""
        return super().kv_bytes_per_token(model.model) // model.world

    def max_positions(self, model: TPLeader) -> int | None:
        return super().max_positions(model.model)

    def vocab_size(self, model: TPLeader) -> int:
        return super().vocab_size(model.model)

    def precision_of(self, model: TPLeader) -> str:
        return super().precision_of(model.model)


TP_OPS = TPOps()
TPLeader.backend_ops = TPSequence.backend_ops = TP_OPS


_mirrored = [0]  # commands this process's follower has run, all its groups together (diagnostics)
_held_at_stop = [0]  # sequences the last follower here still held when stopped (diagnostics)


def commands_mirrored() -> int:
    """How many of the leader's commands (keepalives aside) this process has mirrored (logs, tests)."""
    return _mirrored[0]


def held_at_stop() -> int:
    """How many sequences this process's last follower still held when stopped: those its
    leader had not released (logs, tests)."""
    return _held_at_stop[0]


def run_tp_follower(model: torch.nn.Module, group: Group = None, timeout: timedelta = TP_TIMEOUT) -> int:
    """Mirror the leader's commands on this rank's shard until OP_STOP: one KVSequence per
    leader sequence (slot), made at its first command and dropped at its release.

    Returns the number of commands executed (keepalives aside). If the leader dies or
    hangs, the pending broadcast fails (at once, or after `timeout`) and the error
    propagates. A forward that fails here raises TPForwardError: the leader is left
    waiting in an all-reduce, and whoever watches this call restarts the group.
    """
    serve_timeout(timeout, group)
    rank, mirror, done = dist.get_rank(group), _Mirror(model, dist.get_rank(group)), 0
    while True:
        try:
            op, a, b, payload, rollbacks = _recv_command(group)
        except RuntimeError:
            log.error("TP follower rank %d lost the leader after %d commands", rank, done)
            raise
        if op == OP_STOP:
            _held_at_stop[0] = len(mirror.sequences)
            log.info("TP follower rank %d stopping after %d commands, %d sequences held", rank, done,
                     len(mirror.sequences))
            return done
        if op == OP_NOOP:
            continue
        mirror.roll_back(rollbacks)
        mirror.run(op, a, b, payload, done)
        done += 1
        _mirrored[0] += 1


class _Mirror:
    """A follower's sequences, one per leader slot, and what each command does to them."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.model, self.rank = model, rank
        self.sequences: dict[int, KVSequence] = {}

    def sequence(self, slot: int) -> KVSequence:
        if slot not in self.sequences:
            self.sequences[slot] = KVSequence(self.model)  # made as the leader's own (TPLeader.sequence)
        return self.sequences[slot]

    def roll_back(self, rollbacks: Rollbacks) -> None:
        for slot, length in rollbacks.items():
            self.sequence(slot).rollback(length)

    def run(self, op: int, a: int, b: int, payload: list[int], command: int) -> None:
        if op == OP_FORWARD:
            self.forward(a, payload, command)
        elif op == OP_RESET:
            self.sequence(a).reset()
        elif op == OP_FORK:
            self.sequences[payload[0]] = self.sequence(a).fork(b)
        elif op == OP_RELEASE:
            for slot in payload:
                self.sequences.pop(slot, None)
        else:
            raise RuntimeError(f"unknown TP command {op}")

    def forward(self, rows: int, payload: list[int], command: int) -> None:
        segments = [payload[i : i + _SEGMENT] for i in range(0, rows * _SEGMENT, _SEGMENT)]
        ids, start = [], rows * _SEGMENT
        for _, n, _ in segments:
            ids.append(payload[start : start + n])
            start += n
        try:
            forward_rows([self.sequence(slot) for slot, _, _ in segments], ids, [bool(f) for _, _, f in segments])
        except Exception as exc:
            why = f"the forward failed on target rank {self.rank} at command {command}: {type(exc).__name__}: {exc}"
            log.error("%s; the tensor-parallel group must be restarted", why)
            raise TPForwardError(why) from exc
