"""Channel over a dedicated two-rank torch.distributed group (target rank 0 <-> draft).

The link never touches the default process group: it uses its own TCPStore
(rank 0 serves it, one server per port for the life of the process), wraps it
in a PrefixStore (a reconnect under a new prefix never sees the keys of an
earlier link) and creates the backend object directly, so it coexists with a
tensor-parallel world in the same process.

Wire format, per message, all point-to-point on one tag (gloo matches sends
and receives on a pair and tag in FIFO order):
  1. int64 [2] preamble: [header_nbytes, n_tensors]
  2. uint8 [header_nbytes]: msgpack of {op, header, tensors: [[dtype, shape], ...]}
  3. one send per tensor with bytes, as a uint8 view of its contiguous data
A preamble [-1, wants_ack] is the sender's last message (a clean close).
Nothing is pickled.

What torch 2.13 gloo does (measured on CPU; the tests pin what the channel relies on):
- ``Work.wait(timeout)`` honours the timeout, but a timed-out receive closes the
  pair ("Application timeout caused pair closure"): the link is dead for both
  sides. ``wait()`` without a timeout uses the group timeout, so an idle
  receive longer than that kills the link too.
- A send, however small, does not complete until the peer has posted the
  matching receive: two sides that both send before receiving wait on each
  other until the timeout.
- ``ProcessGroupGloo.abort()`` and ``shutdown()`` are no-ops: they neither
  unblock a pending wait nor stop later sends.
- A peer process that exits surfaces at once as "Connection closed by peer".

Hence, for gloo, a receiver thread keeps a receive posted at all times (with
an effectively infinite wait) and queues whole messages: sends never wait on
the peer's application code, ``recv(timeout)`` is a queue wait that leaves the
link intact, and a message is queued only once every part has arrived. Close
is a handshake (each side sends one close marker) because that is the only
way to release the receiver thread's pending wait.

The link is gloo only, also between GPUs: what travels (token ids, q rows)
is small and lives in host memory by the time it is sent, and NCCL
point-to-point would block the GPU, deadlock with a receive posted on another
thread, and abort the process when a wait times out, so a lost draft would
cost the target. A caller-thread receive mode (receiver_thread=False: recv
on the caller's thread, the protocol must alternate, a recv timeout breaks
the link) is kept for the link benchmark and tested.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ssd.hardware import to_device
from ssd.transport.channel import Channel, ChannelClosed, ChannelTimeout, Message, queued_ops

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a link's (or a world's) rendezvous."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

_TAG = 0
_CLOSE = -1  # preamble header_nbytes of a close marker
# A pending wait must never time out on its own (that closes the pair), so
# "forever" is a very long explicit timeout rather than the group default.
_FOREVER = timedelta(days=365)
_PEER = {0: 1, 1: 0}


# --- header encoding ---------------------------------------------------------

def encode_header(message: Message) -> bytes:
    """msgpack of op, header and each tensor's dtype and shape."""
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in message.tensors]
    return msgpack.packb({"op": message.op, "header": message.header, "tensors": specs}, use_bin_type=True)


def decode_header(data: bytes) -> tuple[str, dict[str, Any], list[tuple[torch.dtype, list[int]]]]:
    # strict_map_key=False: headers may use int keys (e.g. per-sequence maps).
    body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return body["op"], body["header"], [(_dtype(name), shape) for name, shape in body["tensors"]]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype on the wire: {name!r}")
    return dtype


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor sharing its storage: every
    dtype travels as bytes, so the backend's dtype support does not matter."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _is_timeout(exc: BaseException) -> bool:
    """gloo says "Timed out waiting 500ms ...", the store "wait timeout after 1000ms"."""
    text = str(exc).lower()
    return isinstance(exc, (dist.DistStoreError, TimeoutError)) or "timed out" in text or "wait timeout" in text


# --- raw wire: parts over a process group ------------------------------------

class _Wire:
    """Messages as sequences of point-to-point parts on one backend group."""

    def __init__(self, pg: Any, rank: int, device: torch.device) -> None:
        self.pg = pg
        self.peer = _PEER[rank]
        self.device = device

    def send_message(self, header: bytes, tensors: list[torch.Tensor], timeout: timedelta) -> None:
        preamble = torch.tensor([len(header), len(tensors)], dtype=torch.int64)
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        parts = [preamble, raw] + [_bytes_view(t) for t in tensors if t.numel() > 0]
        self._send_all(parts, timeout)

    def send_close(self, wants_ack: bool, timeout: timedelta) -> None:
        self._send_all([torch.tensor([_CLOSE, int(wants_ack)], dtype=torch.int64)], timeout)

    def _send_all(self, parts: list[torch.Tensor], timeout: timedelta) -> None:
        # Post every part before waiting: each send completes only when the
        # peer posts its receive, so waiting one by one costs a round trip each.
        # A CUDA tensor bound for a host (gloo) link goes through pinned memory
        # with one wait; host parts bound for an NCCL link are queued copies.
        parts = [to_device(p, self.device) for p in parts]
        works = [self.pg.send([p], self.peer, _TAG) for p in parts]
        for work in works:
            work.wait(timeout)

    def recv_preamble(self, timeout: timedelta) -> tuple[int, int]:
        """[header_nbytes, n_tensors] of the next message (header_nbytes -1: close)."""
        preamble = torch.empty(2, dtype=torch.int64, device=self.device)
        self._recv(preamble, timeout)
        header_nbytes, n_tensors = preamble.tolist()
        return header_nbytes, n_tensors

    def recv_body(self, header_nbytes: int, n_tensors: int, timeout: timedelta) -> Message:
        """The rest of a message; each part waits up to `timeout`."""
        raw = torch.empty(header_nbytes, dtype=torch.uint8, device=self.device)
        self._recv(raw, timeout)
        op, header, specs = decode_header(raw.cpu().numpy().tobytes())
        if len(specs) != n_tensors:
            raise RuntimeError(f"protocol error: preamble says {n_tensors} tensors, header {len(specs)}")
        return Message(op, header, [self._recv_tensor(dtype, shape, timeout) for dtype, shape in specs])

    def _recv_tensor(self, dtype: torch.dtype, shape: list[int], timeout: timedelta) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if out.numel() > 0:  # zero-byte tensors are not sent at all
            self._recv(_bytes_view(out), timeout)
        return out

    def _recv(self, buf: torch.Tensor, timeout: timedelta) -> None:
        self.pg.recv([buf], self.peer, _TAG).wait(timeout)


# --- the channel ------------------------------------------------------------

@dataclass
class _End:
    """Queued after the last message: why nothing more will come."""

    reason: str
    cause: BaseException | None = None


class DistributedChannel(Channel):
    """One end of the target <-> draft link over a two-rank process group."""

    def __init__(
        self, wire: _Wire, store: dist.Store | None, timeout_s: float, receiver_thread: bool,
    ) -> None:
        self._wire = wire
        self._store = store  # kept alive: on rank 0 it is the rendezvous server
        self._timeout = timedelta(seconds=timeout_s)
        self._send_lock = threading.Lock()  # parts of two messages never interleave
        self._close_sent = False
        self._closed = False  # close() was called here
        self._end: _End | None = None  # set once the link can carry nothing more
        self._inbox: queue.Queue[Message | _End] = queue.Queue()
        self._thread: threading.Thread | None = None
        if receiver_thread:
            self._thread = threading.Thread(target=self._receive_loop, name="ssd-link-recv", daemon=True)
            self._thread.start()

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        rank: int,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        prefix: str = "ssd-link",
        store: dist.Store | None = None,
        receiver_thread: bool = True,
        local_host: str | None = None,
    ) -> DistributedChannel:
        """Rendezvous with the peer and build the two-rank group.

        rank 0 (target) serves the TCPStore on `port`; the server lives as long
        as the process, shared by every link on that port, so a reconnecting
        or restarted draft always finds it. Each link on a port therefore needs
        its own `prefix` (rank 0 refuses a reused one). rank 1 opens a fresh
        store client per link. `store`, if given, is used instead (the caller
        owns it and keeps prefixes apart). Blocks until the peer arrives, or raises
        ChannelTimeout after about `timeout_s`. `timeout_s` also bounds each
        send and each part of a message after its first. `receiver_thread`
        (default) keeps a receive posted at all times (see the module docstring).
        `local_host`: the address this end's gloo pair listens on, one the peer
        can reach (a link between two hosts); None: gloo's default, the address
        this host's name resolves to (often loopback).
        """
        if rank not in _PEER:
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        timeout = timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = _store(host, port, rank, prefix, timeout)
            pg, device = _make_group(dist.PrefixStore(prefix, store), rank, backend, timeout, local_host)
        except RuntimeError as exc:  # DistStoreError, DistNetworkError, gloo errors
            if _is_timeout(exc):
                raise ChannelTimeout(f"no peer at {host}:{port} ({prefix}) within {timeout_s} s") from exc
            raise ChannelClosed(f"cannot connect to {host}:{port} ({prefix}): {exc}") from exc
        log.debug("link %s rank %d connected over %s at %s:%d", prefix, rank, backend, host, port)
        return cls(_Wire(pg, rank, device), store, timeout_s, receiver_thread)

    # -- Channel interface --

    def send(self, message: Message) -> None:
        header = encode_header(message)  # before anything goes out: a bad header leaves the link clean
        with self._send_lock:
            if self._closed or self._close_sent:
                raise ChannelClosed("channel closed locally")
            if self._end is not None:
                raise ChannelClosed(self._end.reason)
            try:
                self._wire.send_message(header, list(message.tensors), self._timeout)
            except RuntimeError as exc:
                raise ChannelClosed(self._fail(f"send failed: {exc}", exc)) from exc

    def recv(self, timeout: float | None = None) -> Message:
        if self._closed:
            raise ChannelClosed("channel closed locally")
        if self._thread is None:
            return self._recv_here(timeout)
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"no message within {timeout} s") from None
        if isinstance(item, _End):
            self._inbox.put(item)  # every later recv sees the end too
            raise ChannelClosed(item.reason) from item.cause
        return item

    def pending(self) -> list[str]:
        """The receiver thread's queued messages; none without that thread
        (nccl), which receives only on the caller's thread."""
        return queued_ops(self._inbox) if self._thread is not None else []

    def close(self) -> None:
        """Clean close: tell the peer (its recv raises ChannelClosed once it has
        drained what we sent), wait for its marker, then drop the group.

        abort() and shutdown() do nothing for gloo in torch 2.13, so the close
        marker is what releases the receiver threads."""
        if self._closed:
            return
        self._send_close(wants_ack=self._thread is not None)
        if self._thread is not None:
            self._thread.join(timeout=min(self._timeout.total_seconds(), 5.0))
            if self._thread.is_alive():  # peer alive but silent: the daemon thread stays blocked
                log.warning("link receiver still blocked after close; leaving it behind")
        self._closed = True
        self._wire.pg = None  # the last reference: destroys the group and its connections
        self._store = None

    # -- internals --

    def _fail(self, reason: str, cause: BaseException | None) -> str:
        """Mark the link dead (a partial message may be on the wire); the first reason wins."""
        if self._end is None:
            self._end = _End(reason, cause)
            log.warning("link broken: %s", reason)
        return self._end.reason

    def _send_close(self, wants_ack: bool) -> None:
        with self._send_lock:
            if self._close_sent or self._end is not None:
                return
            self._close_sent = True
            try:
                self._wire.send_close(wants_ack, self._timeout)
            except RuntimeError as exc:  # the peer is already gone: nothing to tell
                log.debug("close marker not delivered: %s", exc)

    def _on_peer_close(self, wants_ack: bool) -> _End:
        if wants_ack:
            self._send_close(wants_ack=False)  # releases the peer's receiver thread
        if self._end is None:
            self._end = _End("peer closed the channel")
        return self._end

    def _receive_loop(self) -> None:
        """Keep a receive posted forever; queue whole messages only."""
        while True:
            try:
                header_nbytes, n_tensors = self._wire.recv_preamble(_FOREVER)
                if header_nbytes == _CLOSE:
                    self._inbox.put(self._on_peer_close(bool(n_tensors)))
                    return
                message = self._wire.recv_body(header_nbytes, n_tensors, self._timeout)
            except Exception as exc:  # noqa: BLE001 - any failure ends the link; recv reports it
                self._inbox.put(_End(self._fail(f"receive failed: {exc}", exc), exc))
                return
            self._inbox.put(message)

    def _recv_here(self, timeout: float | None) -> Message:
        """Receive on the caller's thread (nccl). A timeout closes the pair, so it breaks the link."""
        if self._end is not None:
            raise ChannelClosed(self._end.reason)
        try:
            # timedelta(0) would mean "the group default" to wait(): never pass it.
            wait = _FOREVER if timeout is None else timedelta(seconds=max(timeout, 1e-3))
            header_nbytes, n_tensors = self._wire.recv_preamble(wait)
        except RuntimeError as exc:
            if _is_timeout(exc):
                self._fail(f"recv timed out after {timeout} s, which closes the pair", exc)
                raise ChannelTimeout(f"no message within {timeout} s (link now closed)") from exc
            raise ChannelClosed(self._fail(f"receive failed: {exc}", exc)) from exc
        if header_nbytes == _CLOSE:
            raise ChannelClosed(self._on_peer_close(bool(n_tensors)).reason)
        try:
            return self._wire.recv_body(header_nbytes, n_tensors, self._timeout)
        except Exception as exc:
            raise ChannelClosed(self._fail(f"receive failed mid-message: {exc}", exc)) from exc


# rank 0's store servers, one per (host, port), kept for the process's life:
# freeing a port on close and binding it again on reconnect would race with a
# peer that reconnects at once (its client could reach the dying server).
_SERVERS: dict[tuple[str, int], tuple[dist.TCPStore, set[str]]] = {}
_SERVERS_LOCK = threading.Lock()


def serve_store(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Open rank 0's store server on (host, port) now, before rank 0 connects: a peer that
    comes first then finds it listening, rather than backing off between tries (a draft
    process joined 60 s after its start: 4.5 s with the server opened late, 0.06 s early),
    and the port is ours from here on."""
    with _SERVERS_LOCK:
        _serve_store(host, port, timedelta(seconds=timeout_s))


def _serve_store(host: str, port: int, timeout: timedelta) -> tuple[dist.TCPStore, set[str]]:
    if (host, port) not in _SERVERS:
        _SERVERS[host, port] = (dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False), set())
    return _SERVERS[host, port]


def _store(host: str, port: int, rank: int, prefix: str, timeout: timedelta) -> dist.Store:
    if rank == 1:
        return dist.TCPStore(host, port, None, False, timeout)
    with _SERVERS_LOCK:
        store, prefixes = _serve_store(host, port, timeout)
        if prefix in prefixes:  # its keys are still in the store: the rendezvous would read stale addresses
            raise ValueError(f"prefix {prefix!r} was already used on {host}:{port}; reconnect with a new prefix")
        prefixes.add(prefix)
        return store


def _make_group(
    store: dist.Store, rank: int, backend: str, timeout: timedelta, local_host: str | None = None,
) -> tuple[Any, torch.device]:
    """The backend object itself, not a ProcessGroup wrapper: no default group needed."""
    if backend == "gloo" and local_host is None:
        return dist.ProcessGroupGloo(store, rank, 2, timeout), torch.device("cpu")
    if backend == "gloo":
        # As torch.distributed builds a gloo group on a named host (its
        # GLOO_SOCKET_IFNAME path): one device bound to that address.
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(store, rank, 2, options), torch.device("cpu")
    raise ValueError(f"the link runs over gloo only, got backend {backend!r} (see the module docstring)")
