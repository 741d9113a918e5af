"""The two kinds of Ray actor: a target rank (verifier) and the speculator.

Ray carries only setup and control calls (load, connect, one call per
batched step or few); every SSD round travels over the
torch.distributed link between target rank 0 and the speculator. Target rank
0 runs the same engines as one process (ssd.factory.make_engine, one
per mode); the speculator runs the one draft-side host (ssd.saguaro.host).
A tensor-parallel target hands its engines (and the start-up plan's probes)
its leader (ssd.models.tp.TPLeader), whose sequences the other ranks mirror.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch

from ssd.config import Config, SpeculationConfig, from_dict
from ssd.transport.distributed import free_port

if TYPE_CHECKING:
    from ssd.engine.batch import Engine
    from ssd.engine.request import GenerationRequest

log = logging.getLogger(__name__)

MODES = ("ar", "ssd")  # the modes the cluster serves
_WARNED: list[list[int]] = []  # the absent cores already logged in this process
LOOPBACK = "127.0.0.1"

# Every call that runs the target's model goes to one thread of the actor (Ray's
# "compute" concurrency group, one thread: ssd.cluster.actors), the one owner
# thread a llama.cpp context asks for. OpenMP (torch's and llama.cpp's ggml)
# also keeps a team of worker threads per calling thread, each spinning a while
# after a parallel region: steps that landed on whichever of Ray's four threads
# was free ran four teams (measured on the real pair at two threads: 8 threads
# busy through a decode, 2 with one compute thread).
COMPUTE = "compute"
compute = ray.method(concurrency_group=COMPUTE)


def node_address() -> str:
    """This Ray node's IP address, the one other nodes reach it at."""
    return ray.util.get_node_ip_address()


def pin_to_cores(cores: list[int] | None) -> None:
    """Run this process on `cores` only, one torch thread per core (CPU mode).

    Linux affinity is per thread, and Ray runs actor methods on threads of its
    own: every thread that exists now is pinned, and the compute threads call
    this again when they start, so no forward drifts onto the other role's core.
    """
    if not cores:
        return
    host = os.cpu_count() or 1
    if any(core >= host for core in cores):
        absent, cores = [c for c in cores if c >= host], [c for c in cores if c < host]
        if absent not in _WARNED:
            _WARNED.append(absent)
            log.warning("cores %s do not exist on this host (%d cores; simulated nodes share one machine): "
                        "pinned to %s", absent, host, cores or "no core in particular")
        if not cores:
            return
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # the thread ended meanwhile
            pass
    torch.set_num_threads(len(cores))


def plan_busy(model, until: list) -> int:
    """Keep this role's cores (pinned by the caller) computing (ssd.saguaro.startup.keep_busy) until
    the task in `until` (the other role's start-up probe, its ref in a list so that it is not awaited) is done."""
    from ssd.saguaro.startup import keep_busy

    return keep_busy(model, lambda: bool(ray.wait(until, timeout=0)[0]))


def whereabouts(device: str) -> dict[str, Any]:
    """What this actor process sees: for logs and the orchestration tests."""
    return {
        "pid": os.getpid(), "device": device,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "placed_gpu": os.environ.get("SSD_PLACED_GPU"),
        "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": torch.get_num_threads(),
        "niceness": os.nice(0),
        "node_id": _node_id(),
    }


def _node_id() -> str | None:
    """The Ray node this actor runs on (hex), or None outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class TargetWorker:
    """One target rank. Rank 0 also runs the engines and owns the draft link."""

    def __init__(
        self, config: dict[str, Any], rank: int, world: int, cores: list[int] | None, tp_port: int,
        device: str = "cpu", spare_cores: list[int] | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s target[{rank}] %(name)s: %(message)s")
        pin_to_cores(cores)
        from ssd.models import load_model, load_tokenizer
        from ssd.models.tp import TPLeader, init_tp_world, load_tp_model, tp_backend

        self.config: Config = from_dict(Config, config)
        self.cores = cores
        # The draft's cores on this node (CPU mode): they join this rank's while the draft has nothing to do.
        self.spare_cores = spare_cores or []
        self._widened = False
        self._pinned: tuple[tuple | None, int] = (None, torch.get_num_threads())  # ((cores, thread), threads)
        self.device = device  # "cuda": the one GPU this process sees
        self.rank, self.world = rank, world
        self.tp_timeout = timedelta(seconds=self.config.cluster.tp_timeout_s)
        if world > 1:
            init_tp_world(rank, world, "127.0.0.1", tp_port, backend=tp_backend(device))
            self.model = load_tp_model(self.config.target, device)
        else:
            self.model = load_model(self.config.target, device)
        if rank == 0:
            self.tokenizer = load_tokenizer(self.config.target)
            # Under TP the engines and the plan's probes run on the leader: the followers mirror its sequences.
            self.leader = TPLeader(self.model, timeout=self.tp_timeout) if world > 1 else None
            self.target = self.leader or self.model
            self._engines: dict[str, Engine] = {}
            self._emitted: dict[str, list[int]] = {}  # row -> tokens admitted since the last step
            self._row_keys: dict[int, str] = {}  # id(request) -> row
            self._cancelled_rows: set[str] = set()
            self._served = False  # a request came: the speculation defaults are fixed from here on
            self._step_delay_s = 0.0  # fault injection (inject_step_delay): a slow host, for drills and tests

    def ready(self) -> int:
        return os.getpid()

    @compute
    def first_forward(self) -> None:
        """Rank 0: one token's forward on every rank (the followers mirror it), then forgotten:
        the cluster reports SERVING only once the target has computed, not merely loaded (a pair
        that loads but fails inside attention fails its start instead of every request)."""
        from ssd.models.backend import forward_rows, new_sequence, release

        self._pin(self.cores)
        sequence = new_sequence(self.target)
        try:
            forward_rows([sequence], [[0]], last_only=True)
        finally:
            release(sequence)

    def whereabouts(self) -> dict[str, Any]:
        # torch's thread count is per calling thread: the compute thread's is the one that counts
        return whereabouts(self.device) | {"rank": self.rank, "world": self.world, "cores": self.cores,
                                           "threads": self._pinned[1]}

    @compute
    def run_follower(self) -> int:
        """Ranks > 0: mirror rank 0's forwards until it stops them."""
        from ssd.models.tp import run_tp_follower

        pin_to_cores(self.cores)
        return run_tp_follower(self.model, timeout=self.tp_timeout)

    def link_address(self, across_hosts: bool) -> tuple[str, int]:
        """Where the draft meets this rank for a new link: loopback when it runs on
        this node, else this node's address (the rendezvous listens on every interface)."""
        host = node_address() if across_hosts else LOOPBACK
        return host, free_port(host)

    def tp_failed(self) -> str | None:
        """Rank 0: why the tensor-parallel group is broken (a forward failed here), else None."""
        leader = getattr(self, "leader", None)
        return None if leader is None else leader.failed

    def connect_draft(self, port: int, prefix: str, timeout_s: float, host: str = LOOPBACK,
                      draft_precision: str | None = None) -> float:
        """Become rank 0 of a new two-rank link at `host`:`port` (see link_address);
        SSD uses it from the next request on. Returns the link's round trip (seconds).
        `draft_precision`: what the speculator loaded (DraftWorker.precision), for the stats line."""
        from ssd.saguaro.protocol import round_trip_s
        from ssd.transport.distributed import DistributedChannel

        channel = DistributedChannel.connect(
            host, port, rank=0, backend=self.config.cluster.link_backend, timeout_s=timeout_s, prefix=prefix,
            local_host=None if host == LOOPBACK else host,
        )
        try:
            seconds = round_trip_s(channel)
        except Exception:
            channel.close()
            raise
        self._engine("ssd").attach(channel, draft_precision)
        return seconds

    def link_up(self) -> bool:
        return "ssd" in self._engines and self._engines["ssd"].link_up

    # The one request path: the driver (ssd.serve.worker, or Cluster.generate for
    # a batch of one) drives the mode's engine here through
    # ssd.cluster.batch.RemoteBatchEngine, one call per step or few (cluster.step_call_s);
    # each row's tokens and its end travel back with the call.

    @compute
    def batch_can_admit(self, mode: str, request: GenerationRequest) -> bool:
        return self._engine(mode).can_admit(request)

    @compute
    def batch_admit(self, mode: str, key: str, request: GenerationRequest) -> None:
        self._served = True
        self._emitted[key] = []
        request = dataclasses.replace(
            request, on_tokens=self._emitted[key].extend, cancelled=lambda: key in self._cancelled_rows
        )
        try:
            self._engine(mode).admit(request)
        except BaseException:
            del self._emitted[key]
            raise
        self._row_keys[id(request)] = key

    @compute
    def batch_step(
        self, mode: str, cancelled: list[str], call_s: float = 0.0,
    ) -> tuple[dict[str, list[int]], list[tuple], list[int]]:
        """Steps until `call_s` has passed, a row has left or no row is left (at least one):
        ({row: tokens it admitted}, [(row, result or None, error text or None)] for rows that
        left, [rows of each step]). Rows cancelled during the call leave at the next one."""
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        self._cancelled_rows.update(cancelled)
        engine, started, steps = self._engine(mode), time.perf_counter(), []
        while True:
            self._pin(self._step_cores())  # the draft's cores join or leave
            steps.append(engine.rows)
            left = engine.step()
            if left or not engine.rows or time.perf_counter() - started >= call_s:
                break
        emitted = {key: list(tokens) for key, tokens in self._emitted.items() if tokens}
        for key in emitted:
            self._emitted[key].clear()  # in place: the row's on_tokens extends this very list
        ended = []
        for finished in left:
            key = self._row_keys.pop(id(finished.request))
            self._emitted.pop(key, None)
            self._cancelled_rows.discard(key)
            error = None if finished.error is None else f"{type(finished.error).__name__}: {finished.error}"
            ended.append((key, finished.result, error))
        return emitted, ended, steps

    @compute
    def batch_warm(self, mode: str) -> bool:
        """The engine's idle work, one piece (ssd.engine.batch.Engine.warm); whether more is left."""
        self._pin(self._step_cores())
        return self._engine(mode).warm()

    def inject_step_delay(self, seconds: float) -> None:
        """Fault injection: every batched step call from now on first sleeps `seconds` (a slow or
        hung host); for drills and tests of ssd.cluster.replicas' step deadline."""
        self._step_delay_s = seconds

    def _pin(self, cores: list[int] | None) -> None:
        """pin_to_cores, from the compute thread, where the cores or the thread changed."""
        key = (cores, threading.get_native_id())
        if key != self._pinned[0]:
            pin_to_cores(cores)
            self._pinned = (key, torch.get_num_threads())

    def _step_cores(self) -> list[int] | None:
        """This step's cores: the rank's own, and the draft's too while SSD gives the
        draft nothing to do (no rows, or speculation.k_policy says K 0 at this batch
        size): plain target steps then use both, and hand the draft's back as soon
        as speculation resumes."""
        ssd = self._engines.get("ssd")
        widen = bool(self.spare_cores) and not (ssd is not None and ssd.speculating())
        if widen != self._widened:
            self._widened = widen
            log.info("the draft's cores %s %s", self.spare_cores,
                     "join this target's: speculation is off" if widen else "go back to the draft: speculation resumes")
        return [*self.cores, *self.spare_cores] if widen else self.cores

    @compute
    def plan_continuations(self) -> dict[str, Any]:
        """SSD's start-up plan: the target's continuations of the sample prompts (ssd.saguaro.startup.continuations)."""
        from ssd.saguaro.startup import continuations, sample_prompt_ids

        self._pin(self.cores)
        return continuations(self.target, sample_prompt_ids(self.tokenizer))

    @compute
    def plan_probe(self, continued: dict[str, Any]) -> dict[str, Any]:
        """SSD's start-up plan, the target's timed half (ssd.saguaro.startup.target_probe), after
        its continuations (`continued`, which it hands back with it)."""
        from ssd.saguaro.startup import target_probe

        self._pin(self.cores)
        return target_probe(self.target) | {"sequences": continued["sequences"]}

    @compute
    def plan_busy(self, until: list) -> int:
        self._pin(self.cores)
        return plan_busy(self.target, until)

    @compute
    def plan_wide_probe(self) -> float | None:
        """SSD's start-up plan: the decode step on this rank's cores and the draft's, which it
        borrows while speculation is off (ssd.saguaro.startup.wide_step_probe); None where none
        are lent. Run while the draft is idle, as it is then."""
        from ssd.saguaro.startup import wide_step_probe

        if not self.spare_cores:
            return None
        self._pin([*self.cores, *self.spare_cores])
        try:
            return wide_step_probe(self.target)
        finally:
            self._pin(self.cores)

    @compute
    def set_speculation(self, speculation: dict[str, Any]) -> None:
        """New speculation defaults (the start-up plan's), before the first request."""
        if self._served:
            raise RuntimeError("the speculation defaults are set before the first request")
        self.config = dataclasses.replace(self.config, speculation=from_dict(SpeculationConfig, speculation))
        engine = self._engines.get(self.config.speculation.mode)  # SSD's, made when the draft linked
        if engine is not None:
            engine.speculation = self.config.speculation

    def describe(self) -> dict[str, Any]:
        from ssd.models.backend import max_positions
        from ssd.models.tokenizer import eos_token_ids

        return {
            "max_positions": max_positions(self.model) or 4096,
            "eos_token_ids": sorted(eos_token_ids(self.tokenizer, self.model)),
        }

    def encode(self, text: str, chat: bool = False) -> list[int]:
        from ssd.models.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, text, chat)

    def shutdown(self) -> None:
        """Stop the speculator's loop and the TP followers."""
        ssd = self._engines.get("ssd")
        if ssd is not None:
            ssd.stop_draft()
        if self.leader is not None:
            self.leader.stop()

    def _engine(self, mode: str) -> Engine:
        """The mode's one engine (made on first use); SSD's owns the draft link."""
        if mode not in self._engines:
            from ssd.factory import LoadedPair, make_engine

            if mode not in MODES:
                raise ValueError(f"the cluster serves modes {MODES}, not {mode!r}")
            # The draft is another actor; a tensor-parallel target is its leader.
            pair = LoadedPair(self.target, None, self.tokenizer)
            self._engines[mode] = make_engine(
                mode, pair, self.config.speculation, self.config.batching,
                draft_timeout_s=self.config.cluster.draft_timeout_s,
            )  # the draft's precision comes with its link (connect_draft)
        return self._engines[mode]


class DraftWorker:
    """The speculator: the draft model on its own device, serving one link at a time."""

    def __init__(self, config: dict[str, Any], cores: list[int] | None, device: str = "cpu") -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s draft %(name)s: %(message)s")
        pin_to_cores(cores)
        from ssd.factory import draft_with_vocab
        from ssd.models import load_model

        self.config: Config = from_dict(Config, config)
        self.cores = cores
        self.device = device
        self.model = draft_with_vocab(load_model(self.config.draft, device), self.config)
        self._serving: threading.Thread | None = None

    def ready(self) -> int:
        return os.getpid()

    def whereabouts(self) -> dict[str, Any]:
        return whereabouts(self.device) | {"cores": self.cores}

    def precision(self) -> str:
        """What the draft loaded, as stats lines name it ("gguf q4_k_m+repack", "int8", ...)."""
        from ssd.models.backend import precision_of

        return precision_of(self.model)

    def plan_probe(self, continued: list) -> dict[str, Any]:
        """SSD's start-up plan, the draft's half: its timed probes (ssd.saguaro.startup.draft_probe),
        then where the target's continuations (the task in `continued`) rank among its own."""
        from ssd.saguaro.startup import agreement, draft_probe

        pin_to_cores(self.cores)
        part = draft_probe(self.model)
        return part | {"agreement": agreement(self.model, **ray.get(continued[0])).to_json()}

    def plan_busy(self, until: list) -> int:
        pin_to_cores(self.cores)
        return plan_busy(self.model, until)

    def serve(self, port: int, prefix: str, timeout_s: float, host: str = LOOPBACK) -> None:
        """Join the link to the target at `host`:`port` as rank 1 and answer rounds until shutdown (blocks)."""
        pin_to_cores(self.cores)
        from ssd.saguaro.host import serve_link

        local = None if host == LOOPBACK else node_address()  # across hosts: gloo listens where the target can reach
        serve_link(self.model, port, prefix, timeout_s, backend=self.config.cluster.link_backend, host=host,
                   local_host=local)
