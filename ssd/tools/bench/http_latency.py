"""Latency of the HTTP front end on one kept-alive connection: our listening socket (Nagle
off on its connections) against one from `socket.create_server` (how the server bound it
before: Nagle on), both servers up at once over one loaded pair, requests interleaved.

What it times, each a median over `repeats`: GET /health, a request refused with a 400, a
1-token completion, and a streamed completion (its first chunk, and all of it).
"""

from __future__ import annotations

import socket
import statistics
import time
from contextlib import ExitStack
from typing import Any, Callable

import httpx

from ssd import hardware
from ssd.config import Config
from ssd.openai import http as http_module
from ssd.serve.backend import LocalBackend
from ssd.serve.options import ServeOptions
from ssd.openai.server import OpenAIServer

VARIANTS = ("nodelay", "create_server")


def _server(backend: LocalBackend, variant: str) -> OpenAIServer:
    """A server over `backend`; "create_server" binds its HTTP socket as the server did before."""
    ours = http_module.listening_socket
    if variant == "create_server":
        http_module.listening_socket = lambda host, port: socket.create_server((host, port))
    try:
        server = OpenAIServer(ServeOptions(port=0, http_port=0), lambda: backend)
        server.start()
    finally:
        http_module.listening_socket = ours
    if not server.wait_ready(60):
        raise RuntimeError("the server did not come up")
    return server


def _stream(client: httpx.Client, body: dict[str, Any]) -> list[float]:
    """The gaps (s) between a streamed completion's chunks, from the request on."""
    times = [time.perf_counter()]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        reply.raise_for_status()
        times += [time.perf_counter() for line in reply.iter_lines() if line.startswith("data: ")]
    return [b - a for a, b in zip(times, times[1:])]


def bench_http(config: Config, repeats: int, stream_tokens: int, prompt: str) -> dict[str, Any]:
    backend = LocalBackend(config)
    uptime = hardware.uptime()  # before the bench's own load
    body: dict[str, Any] = {"prompt": prompt, "temperature": 0.0, "speculation": {"mode": "ar"}}
    probes: dict[str, tuple[int, Callable[[httpx.Client], httpx.Response]]] = {  # (the status it must get, it)
        "health": (200, lambda c: c.get("/health")),
        "refused (400)": (400, lambda c: c.post("/v1/completions", json={**body, "top_p": 5.0})),
        "1-token completion": (200, lambda c: c.post("/v1/completions", json={**body, "max_tokens": 1})),
    }
    times: dict[str, dict[str, list[float]]] = {v: {name: [] for name in [*probes, "stream: first chunk",
                                                                          "stream: all of it"]}
                                                for v in VARIANTS}
    with ExitStack() as stack:
        stack.callback(backend.close)
        clients = {}
        for variant in VARIANTS:
            server = _server(backend, variant)
            stack.callback(server.stop, 0.5)
            clients[variant] = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}",
                                                                timeout=60))
        body["model"] = clients[VARIANTS[0]].get("/v1/models").json()["data"][0]["id"]
        for _ in range(repeats):
            for variant, client in clients.items():  # interleaved, on each server's one connection
                for name, (status, probe) in probes.items():
                    started = time.perf_counter()
                    reply = probe(client)
                    times[variant][name].append(time.perf_counter() - started)
                    if reply.status_code != status:
                        raise RuntimeError(f"{name}: HTTP {reply.status_code}, not {status}: {reply.text}")
                gaps = _stream(client, {**body, "max_tokens": stream_tokens})
                times[variant]["stream: first chunk"].append(gaps[0])
                times[variant]["stream: all of it"].append(sum(gaps))
    return {"machine": hardware.summary(), "uptime": uptime, "repeats": repeats, "stream_tokens": stream_tokens,
            "ms": {v: {name: {"median": 1000 * statistics.median(t), "max": 1000 * max(t)} for name, t in rows.items()}
                   for v, rows in times.items()}}


def format_table(result: dict[str, Any]) -> str:
    ms = result["ms"]
    lines = [result["machine"], result["uptime"],
             f"medians of {result['repeats']} interleaved rounds on one kept-alive connection per server "
             f"(max in brackets); stream: {result['stream_tokens']} tokens",
             "", "| request | Nagle off (ours) ms | socket.create_server (before) ms | x |", "|---|---|---|---|"]
    for name, ours in ms["nodelay"].items():
        before = ms["create_server"][name]
        lines.append(f"| {name} | {ours['median']:.2f} ({ours['max']:.1f}) | {before['median']:.2f} "
                     f"({before['max']:.1f}) | {before['median'] / max(ours['median'], 1e-9):.1f} |")
    return "\n".join(lines)
