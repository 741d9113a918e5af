"""One Channel contract for every carrier (in-process queues, torch.distributed
gloo between two real processes), plus the failure modes only a real link has:
peer death, partial messages, close, reconnect, connect timeouts."""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ssd.transport import inprocess_pair
from ssd.transport.channel import Channel, ChannelClosed, ChannelTimeout, Message
from ssd.transport.distributed import DistributedChannel, encode_header, serve_store

HOST = "127.0.0.1"
LINK_TIMEOUT_S = 5.0  # connect and per-part bound: a broken test fails in seconds, never hangs
STOP, DIE_MID_MESSAGE = "__stop__", "__die_mid_message__"
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture(autouse=True)
def hard_timeout() -> Iterator[None]:
    """Kill the whole run (with tracebacks) if a test wedges, even inside C++."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# --- the peer: an echo server ------------------------------------------------

def echo(channel: Channel) -> None:
    """Return every message until STOP or the link ends."""
    with contextlib.suppress(ChannelClosed):
        while (msg := channel.recv()).op != STOP:
            if msg.op == DIE_MID_MESSAGE:
                die_mid_message(channel)
            channel.send(msg)


def die_mid_message(channel: DistributedChannel) -> None:
    """Announce a message with one tensor, send only its header, and exit."""
    header = encode_header(Message("partial", {}, [torch.zeros(3)]))
    raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    channel._wire._send_all([torch.tensor([len(header), 1]), raw], channel._timeout)
    os._exit(0)


def serve_links(port: int, prefixes: list[str]) -> None:
    """Rank 1 in a spawned process: one echo link per prefix, in turn, each
    with a fresh store client (as a restarted draft would have)."""
    torch.set_num_threads(1)
    for prefix in prefixes:
        channel = DistributedChannel.connect(HOST, port, rank=1, timeout_s=LINK_TIMEOUT_S, prefix=prefix)
        echo(channel)
        channel.close()


def serve_many(port: int) -> None:
    """Rank 1 in a spawned process: links "link-0", "link-1", ... over one
    shared store, each echoed on its own thread, until killed."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, None, False, timedelta(seconds=60))
    for i in itertools.count():
        channel = DistributedChannel.connect(HOST, port, rank=1, timeout_s=60, prefix=f"link-{i}", store=store)
        threading.Thread(target=echo_then_close, args=(channel,), daemon=True).start()


def echo_then_close(channel: DistributedChannel) -> None:
    echo(channel)
    channel.close()


SPAWN_S = 50.0  # a spawned peer imports torch (and CUDA, where there is one) before it can link


def _signal_then_run(started: Any, target: Callable[..., None], *args: Any) -> None:
    started.set()
    target(*args)


def start_peer(target: Callable[..., None], *args: Any) -> multiprocessing.Process:
    """Spawn `target(*args)` and return once its imports are done, so that the
    link's LINK_TIMEOUT_S bounds the link and not the child's start-up."""
    started = SPAWN.Event()
    proc = SPAWN.Process(target=_signal_then_run, args=(started, target, *args), daemon=True)
    proc.start()
    if not started.wait(SPAWN_S):
        proc.kill()
        raise AssertionError(f"the spawned peer did not start within {SPAWN_S} s")
    return proc


@contextlib.contextmanager
def peer_process(target: Callable[..., None], *args: Any) -> Iterator[multiprocessing.Process]:
    proc = start_peer(target, *args)
    try:
        yield proc
    finally:
        proc.join(timeout=10)
        if proc.is_alive():  # never leave a wedged peer behind
            proc.kill()
            proc.join()


def connect(port: int, prefix: str, **kw: Any) -> DistributedChannel:
    return DistributedChannel.connect(HOST, port, rank=0, timeout_s=LINK_TIMEOUT_S, prefix=prefix, **kw)


class Peer:
    """Rank 0's side of `serve_many`: every link() is a fresh link to it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._count = itertools.count()

    def link(self, **kw: Any) -> DistributedChannel:
        return connect(self.port, f"link-{next(self._count)}", **kw)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """One spawned echo peer for the module (spawning costs seconds)."""
    port = free_port()
    proc = start_peer(serve_many, port)
    yield Peer(port)
    proc.kill()  # it waits for a next link that never comes
    proc.join()


# --- carriers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gloo_link(peer: Peer) -> Iterator[Channel]:
    channel = peer.link()
    yield channel
    channel.send(Message(STOP))
    channel.close()


@pytest.fixture(scope="module")
def inprocess_link() -> Iterator[Channel]:
    ours, theirs = inprocess_pair()
    server = threading.Thread(target=echo, args=(theirs,), daemon=True)
    server.start()
    yield ours
    ours.send(Message(STOP))
    server.join(timeout=5)


@pytest.fixture(params=["inprocess", "gloo"])
def link(request: pytest.FixtureRequest) -> Channel:
    return request.getfixturevalue(f"{request.param}_link")


def round_trip(channel: Channel, message: Message) -> Message:
    channel.send(message)
    return channel.recv(timeout=10)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# --- the contract, for every carrier ----------------------------------------

NESTED = {
    "seq": 7, "big": 2**62, "neg": -3, "pi": 3.141592653589793, "hit": True, "miss": False,
    "none": None, "text": "héllo", "tokens": [1, 2, 3], "empty": [], "by_seq": {0: [1.5], 12: {"k": 4}},
    "deep": {"a": [{"b": [None, True, 0.25]}]},
}


def test_header_round_trip(link: Channel) -> None:
    back = round_trip(link, Message("round", NESTED))
    assert back.op == "round"
    assert back.header == NESTED
    assert back.tensors == []


def tensor_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 151, generator=gen),
        torch.randn(3, 5, generator=gen, dtype=torch.float64),
        torch.randint(-2**40, 2**40, (17,), generator=gen),
        torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16),
        torch.randint(0, 256, (9,), generator=gen).to(torch.uint8),
        torch.tensor(2.5),  # 0-d
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 3),  # 0-size
        torch.tensor([float("nan"), float("inf"), -0.0]),
        torch.tensor([True, False]),
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
    ]


def test_tensors_are_bit_identical(link: Channel) -> None:
    sent = tensor_cases()
    back = round_trip(link, Message("speculation", {"seq": 1}, sent))
    assert back.header == {"seq": 1}
    assert len(back.tensors) == len(sent)
    for a, b in zip(sent, back.tensors):
        assert same_bits(a, b), (a.dtype, a.shape)


def test_sender_may_mutate_after_send(link: Channel) -> None:
    q = torch.ones(2, 3)
    link.send(Message("speculation", {}, [q]))
    q.fill_(5.0)
    assert torch.equal(link.recv(timeout=10).tensors[0], torch.ones(2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_cross_a_gloo_link_through_host_memory(gloo_link: Channel) -> None:
    """A draft on a GPU sends its q rows over a host link: they arrive bit-identical, on the host."""
    sent = [torch.randn(3, 151, dtype=torch.float64, device="cuda"), torch.arange(12.0, device="cuda").reshape(3, 4).t()]
    back = round_trip(gloo_link, Message("speculation", {}, sent))
    assert all(b.device.type == "cpu" and same_bits(a.cpu(), b) for a, b in zip(sent, back.tensors))


def test_many_messages_keep_order(link: Channel) -> None:
    """All sent before any is received: both ends send while the other is sending."""
    n = 200
    for i in range(n):
        link.send(Message("round", {"i": i}, [torch.full((i % 5,), float(i))]))
    for i in range(n):
        back = link.recv(timeout=10)
        assert back.header == {"i": i}
        assert torch.equal(back.tensors[0], torch.full((i % 5,), float(i)))


def test_recv_timeout_then_still_usable(link: Channel) -> None:
    started = time.monotonic()
    with pytest.raises(ChannelTimeout):
        link.recv(timeout=0.3)
    assert time.monotonic() - started < 0.3 + 1.0
    assert round_trip(link, Message("round", {"after": "timeout"})).header == {"after": "timeout"}


def test_unencodable_header_leaves_link_clean(link: Channel) -> None:
    if isinstance(link, DistributedChannel):  # in-process does not encode at all
        with pytest.raises(TypeError):
            link.send(Message("round", {"bad": object()}))
    assert round_trip(link, Message("round", {"ok": 1})).header == {"ok": 1}


# --- only a real link ---------------------------------------------------------

def test_reconnect_with_new_prefix_then_peer_dies_mid_message() -> None:
    """The target's recovery path: close, rebuild the link on the same port
    under a new prefix (the peer reconnects at once, with a new store client);
    then a peer that exits halfway through a message surfaces as
    ChannelClosed, and the half message is never returned."""
    port = free_port()
    with peer_process(serve_links, port, ["ssd-link", "ssd-link-2"]) as proc:
        first = connect(port, "ssd-link")
        assert round_trip(first, Message("round", {"link": 1})).header == {"link": 1}
        first.close()  # the peer's echo ends with ChannelClosed, then it reconnects
        with pytest.raises(ChannelClosed):
            first.recv(timeout=1)
        with pytest.raises(ValueError, match="new prefix"):
            connect(port, "ssd-link")
        second = connect(port, "ssd-link-2")
        assert round_trip(second, Message("round", {"link": 2})).header == {"link": 2}
        second.send(Message(DIE_MID_MESSAGE))
        started = time.monotonic()
        with pytest.raises(ChannelClosed):
            second.recv(timeout=10)
        assert time.monotonic() - started < 5
        with pytest.raises(ChannelClosed):  # and the link stays dead
            second.send(Message("round"))
        second.close()
        proc.join(timeout=5)
        assert proc.exitcode == 0


def test_links_coexist_and_reconnect_over_one_store(peer: Peer) -> None:
    a, b = peer.link(), peer.link()
    assert round_trip(b, Message("round", {"link": "b"})).header == {"link": "b"}
    assert round_trip(a, Message("round", {"link": "a"})).header == {"link": "a"}
    a.close()
    with pytest.raises(ChannelClosed):
        a.send(Message("round"))
    assert round_trip(b, Message("round", {"link": "b"})).header == {"link": "b"}
    c = peer.link()  # the reconnect: a new prefix on the same store server
    assert round_trip(c, Message("round", {"link": "c"})).header == {"link": "c"}
    b.close()
    c.close()


def test_peer_close_is_seen_after_its_last_messages(peer: Peer) -> None:
    channel = peer.link()
    for i in range(3):
        channel.send(Message("round", {"i": i}))
    channel.send(Message(STOP))  # the peer closes after echoing 0, 1, 2
    assert [channel.recv(timeout=10).header["i"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ChannelClosed):
        channel.recv(timeout=10)
    with pytest.raises(ChannelClosed):
        channel.send(Message("round"))
    channel.close()


def test_caller_thread_receive_timeout_breaks_link(peer: Peer) -> None:
    """The caller-thread receive mode (receiver_thread=False):
    a timed-out gloo receive closes the pair, so the link is dead afterwards."""
    channel = peer.link(receiver_thread=False)
    assert round_trip(channel, Message("round", {"sync": True}, [torch.arange(3)])).header == {"sync": True}
    started = time.monotonic()
    with pytest.raises(ChannelTimeout):
        channel.recv(timeout=0.3)
    assert time.monotonic() - started < 1.3
    with pytest.raises(ChannelClosed):
        channel.recv(timeout=0.3)
    channel.close()


def test_a_store_served_early_holds_its_port_and_serves_both_ranks() -> None:
    """serve_store opens rank 0's server before rank 0 connects: the port is taken from
    then on, a peer that comes first joins it, and rank 0's connect reuses it."""
    port = free_port()
    serve_store(HOST, port, LINK_TIMEOUT_S)
    with socket.socket() as sock, pytest.raises(OSError):
        sock.bind((HOST, port))
    joined: list[Channel] = []
    peer = threading.Thread(target=lambda: joined.append(
        DistributedChannel.connect(HOST, port, rank=1, timeout_s=LINK_TIMEOUT_S, prefix="early")))
    peer.start()
    time.sleep(0.3)  # the peer waits in the store for rank 0's address
    ours = DistributedChannel.connect(HOST, port, rank=0, timeout_s=LINK_TIMEOUT_S, prefix="early")
    peer.join(LINK_TIMEOUT_S)
    theirs = joined[0]
    try:
        ours.send(Message("hello", {"n": 1}))
        assert theirs.recv(LINK_TIMEOUT_S).header == {"n": 1}
    finally:
        ours.close()
        theirs.close()


def test_connect_without_peer_times_out() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ChannelTimeout):
        DistributedChannel.connect(HOST, port, rank=0, timeout_s=1.0, prefix="alone")
    assert time.monotonic() - started < 4
