"""Tensor-parallel target: one process per device, rank 0 leads, the rest mirror.

transformers shards the model (`DistributedConfig(tp_plan="auto")`); every
forward then runs all-reduces inside, so all target ranks must call the model
in exactly the same order. Rank 0 owns sampling and verification, so it drives:
`TPLeaderSequence` is a KVSequence that broadcasts each cache operation as a
tiny int64 command before running it, and `run_tp_follower` replays those
commands on the other ranks until told to stop. The followers mirror one
sequence, so the engines hold the batch at one row on a tensor-parallel
target (ssd.engine.kv_manager hands the leader's sequence to that row).

A forward that raises on any rank (a CUDA OOM on a long prompt, say) breaks
the group for good: the other ranks wait in the model's all-reduces or for
the next command, under a timeout as long as the longest idle time (see
IDLE_TIMEOUT). So a failed forward is never retried here: it raises
TPForwardError on its rank (the follower's run_tp_follower returns with it;
the leader refuses every later command), and the cluster restarts the group
as it does a lost rank (ssd.cluster.runtime).

The world built here holds only the target ranks: a draft rank in the same
world (with TP on a sub-mesh) hung in `from_pretrained` when we tried it; the
draft link is a separate two-rank group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ssd.config import AUTO, ConfigError, ModelConfig
from ssd.models.fast import note_lean_path
from ssd.models.kv import KVSequence
from ssd.models.loading import TINY, TORCH_DTYPES, build_tiny_model, load_model, resolve_precision, resolve_source

log = logging.getLogger(__name__)

Group = dist.ProcessGroup | None  # None: the default (target-only) world

# Command op codes. A command is a header [op, arg, n] then, if n > 0, n ids.
OP_STOP, OP_FORWARD, OP_ROLLBACK, OP_RESET = range(4)
_HEADER = 3

# An idle follower sits in a broadcast waiting for the next command, and gloo
# kills a collective that waits past the group timeout (measured: a 3 s timeout
# ended an idle follower after 3 s). So the timeout bounds the idle time between
# requests and must be long; a dead peer is still noticed at once, as the
# pending collective fails with "connection closed/reset by peer".
IDLE_TIMEOUT = timedelta(days=30)


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
    timeout: timedelta = IDLE_TIMEOUT,
) -> None:
    """Join the default process group made of the target ranks only.

    `timeout` bounds every collective, including a follower's wait between
    commands, i.e. the longest the leader may stay idle (see IDLE_TIMEOUT).
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


def _send_command(op: int, arg: int = 0, ids: Sequence[int] = (), group: Group = None) -> None:
    dist.broadcast(torch.tensor([op, arg, len(ids)], dtype=torch.int64), group=group, group_src=0)
    if ids:
        dist.broadcast(torch.tensor(list(ids), dtype=torch.int64), group=group, group_src=0)


def _recv_command(group: Group = None) -> tuple[int, int, list[int]]:
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=0)
    op, arg, n = header.tolist()
    ids = torch.empty(n, dtype=torch.int64)
    if n:
        dist.broadcast(ids, group=group, group_src=0)
    return op, arg, ids.tolist()


class TPLeaderSequence(KVSequence):
    """A KVSequence on TP rank 0 whose cache operations every follower repeats.

    `catch_up` and `trim_to_prefix_of` are built on `forward` and `rollback`,
    so overriding those three covers the whole interface. Arguments are checked
    before broadcasting: a command that fails on the leader must not reach the
    followers, or the ranks would drift apart.
    """

    def __init__(self, model: torch.nn.Module, group: Group = None) -> None:
        if dist.get_rank(group) != 0:
            raise RuntimeError("TPLeaderSequence belongs on TP rank 0; other ranks run run_tp_follower")
        super().__init__(model)
        self.group = group
        self.stopped = False
        self.failed: str | None = None  # why the group is broken, once a forward failed here

    def forward(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        if not ids:
            raise ValueError("forward needs at least one token")
        self._command(OP_FORWARD, int(last_only), ids)
        try:
            return super().forward(ids, last_only)
        except Exception as exc:
            # The followers may be waiting in an all-reduce this rank never reaches.
            self.failed = f"the forward failed on target rank 0: {type(exc).__name__}: {exc}"
            log.error("%s; the tensor-parallel group must be restarted", self.failed)
            raise TPForwardError(self.failed) from exc

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} of {self.length} tokens")
        if length < self.length:  # a no-op needs no round trip
            self._command(OP_ROLLBACK, length)
            super().rollback(length)

    def reset(self) -> None:
        self._command(OP_RESET)
        super().reset()

    def stop(self) -> None:
        """Release the followers (`run_tp_follower` returns); idempotent."""
        if not self.stopped:
            _send_command(OP_STOP, group=self.group)
            self.stopped = True

    def __enter__(self) -> "TPLeaderSequence":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self, op: int, arg: int = 0, ids: Sequence[int] = ()) -> None:
        if self.stopped:
            raise RuntimeError("the TP followers were stopped")
        if self.failed is not None:
            raise TPForwardError(f"{self.failed}; the group awaits its restart")
        _send_command(op, arg, ids, self.group)


_mirrored = [0]  # commands this process's follower has run, all its groups together (diagnostics)


def commands_mirrored() -> int:
    """How many of the leader's commands this process has mirrored (logs, tests)."""
    return _mirrored[0]


def run_tp_follower(model: torch.nn.Module, group: Group = None) -> int:
    """Mirror the leader's commands on this rank's shard until OP_STOP.

    Returns the number of commands executed. If the leader dies, the pending
    broadcast fails (or times out) and the error propagates. A forward that
    fails here raises TPForwardError: the leader is left waiting in an
    all-reduce, and whoever watches this call restarts the group.
    """
    seq = KVSequence(model)
    done = 0
    while True:
        try:
            op, arg, ids = _recv_command(group)
        except RuntimeError:
            log.error("TP follower rank %d lost the leader after %d commands", dist.get_rank(group), done)
            raise
        if op == OP_STOP:
            log.info("TP follower rank %d stopping after %d commands", dist.get_rank(group), done)
            return done
        if op == OP_FORWARD:
            _follower_forward(seq, ids, bool(arg), dist.get_rank(group), done)
        elif op == OP_ROLLBACK:
            seq.rollback(arg)
        elif op == OP_RESET:
            seq.reset()
        else:
            raise RuntimeError(f"unknown TP command {op}")
        done += 1
        _mirrored[0] += 1


def _follower_forward(seq: KVSequence, ids: list[int], last_only: bool, rank: int, command: int) -> None:
    try:
        seq.forward(ids, last_only=last_only)
    except Exception as exc:
        why = f"the forward failed on target rank {rank} at command {command}: {type(exc).__name__}: {exc}"
        log.error("%s; the tensor-parallel group must be restarted", why)
        raise TPForwardError(why) from exc
