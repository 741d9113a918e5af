"""Round-trip latency of the torch.distributed link (ssd.transport.distributed)
against an echo peer in a second process: a header-only round message and
q rows of the real pair's vocabulary; and the q bytes an SSD round sends
(ssd.tools.bench.q_bytes). Run it with launch/bench_link.py."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import socket
import statistics
import threading
import time

import torch

from ssd.config import SamplingConfig, TinyModelConfig
from ssd.models import build_tiny_model
from ssd.sampling import Q_DTYPE
from ssd.tools.bench.q_bytes import count_q_bytes
from ssd.transport.channel import ChannelClosed, Message
from ssd.transport.distributed import DistributedChannel

log = logging.getLogger(__name__)

# rank 0's receive mode per link; the echo peer always uses its receiver thread.
_BENCH_LINKS = {"receiver thread": ("bench-thread", True), "caller thread": ("bench-caller", False)}


def _echo(host: str, port: int) -> None:
    """Rank 1: echo every bench link, each on its own thread, until rank 0 closes it."""
    torch.set_num_threads(1)
    channels = [DistributedChannel.connect(host, port, rank=1, prefix=prefix) for prefix, _ in _BENCH_LINKS.values()]
    threads = [threading.Thread(target=_echo_one, args=(channel,)) for channel in channels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _echo_one(channel: DistributedChannel) -> None:
    try:
        while True:
            channel.send(channel.recv())
    except ChannelClosed:
        channel.close()


def summarize_ms(seconds: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of round trips, in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    return {"median_ms": statistics.median(ms), "p10_ms": ms[len(ms) // 10], "p90_ms": ms[9 * len(ms) // 10],
            "rounds": len(ms)}


def bench_link(rounds: int = 300) -> None:
    """Round trips to an echo peer. The two rank-0 receive modes alternate
    round by round, so machine load affects both alike."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peer = multiprocessing.get_context("spawn").Process(target=_echo, args=("127.0.0.1", port))
    peer.start()
    links = {mode: DistributedChannel.connect("127.0.0.1", port, rank=0, prefix=prefix, receiver_thread=thread)
             for mode, (prefix, thread) in _BENCH_LINKS.items()}
    header = {"seq": 3, "k": 4, "token": 151643}
    cases = {
        "header only": Message("round", header),
        "q [4,151936] float32 (before)": Message("speculation", header, [torch.rand(4, 151936)]),
        f"q [4,151936] {str(Q_DTYPE).removeprefix('torch.')} (now)": Message(
            "speculation", header, [torch.rand(4, 151936).to(Q_DTYPE)]),
    }
    for name, message in cases.items():
        times: dict[str, list[float]] = {mode: [] for mode in links}
        for _ in range(rounds):
            for mode, channel in links.items():
                started = time.perf_counter()
                channel.send(message)
                channel.recv(timeout=10)
                times[mode].append(time.perf_counter() - started)
        for mode, seconds in times.items():
            ms = summarize_ms(seconds)
            log.info("%-22s rank 0 %-15s round trip ms: median %.3f  p10 %.3f  p90 %.3f  (%d)", name, mode,
                     ms["median_ms"], ms["p10_ms"], ms["p90_ms"], rounds)
    for channel in links.values():
        channel.close()
    peer.join(10)


REAL_VOCAB = 151936  # the Qwen pairs' (ssd.models.offline)
# What a round ships depends on the sampling settings, not on the model: tiny
# models with the real vocabulary (the draft the target plus 3 % weight noise,
# as the tests' pair) make the rounds in seconds on a CPU.
Q_BYTES_SETTINGS = {
    "T=1": SamplingConfig(temperature=1.0),
    "T=0.7 top-p 0.9": SamplingConfig(temperature=0.7, top_p=0.9),
    "T=0.8 top-k 20": SamplingConfig(temperature=0.8, top_k=20),
    "T=1 coupled": SamplingConfig(temperature=1.0, coupling="gumbel"),
    "T=0": SamplingConfig(temperature=0.0),
}


def bench_q_bytes(k: int = 4, prompts: int = 4, max_new_tokens: int = 30) -> None:
    """The q bytes a round sends at each setting, before and now, per round."""
    tiny = TinyModelConfig(vocab_size=REAL_VOCAB, seed=0)
    target = build_tiny_model(tiny)
    draft = build_tiny_model(dataclasses.replace(tiny, noise=0.03))
    starts = [[1 + i, 2 + i, 3 + i] for i in range(prompts)]
    log.info("SSD, K = %d, vocabulary %d, %d prompts of %d tokens; per round (a proposals reply):", k, REAL_VOCAB,
             prompts, max_new_tokens)
    log.info("%-16s %7s %9s %12s %11s %13s %7s", "setting", "rounds", "rows now", "bytes now", "rows before",
             "bytes before", "ratio")
    for name, sampling in Q_BYTES_SETTINGS.items():
        r = count_q_bytes(target, draft, sampling, starts, max_new_tokens, k).per_round()
        ratio = r["q_bytes"] / r["before_bytes"] if r["before_bytes"] else float("nan")
        log.info("%-16s %7d %9.2f %12.0f %11.2f %13.0f %7.2g", name, r["rounds"], r["q_rows"], r["q_bytes"],
                 r["before_rows"], r["before_bytes"], ratio)
