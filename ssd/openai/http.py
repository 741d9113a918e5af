"""The OpenAI-compatible API's HTTP server: uvicorn in a thread of its own, with its own
event loop, serving an OpenAIFrontend's app (ssd.openai.app) on a socket bound here."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from ssd.openai.app import OpenAIFrontend

log = logging.getLogger(__name__)


class HttpServer:
    """uvicorn serving an OpenAIFrontend in a thread of its own, on a socket bound here
    (so a busy port fails `start` at once and port 0 reports the port it got)."""

    def __init__(self, front: OpenAIFrontend, options: Any) -> None:
        self.front = front
        self.options = options
        self.port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        opts = self.options
        try:
            sock = listening_socket(opts.host, opts.http_port)
        except OSError as exc:
            raise OSError(f"cannot serve HTTP on {opts.host}:{opts.http_port}: {exc}") from exc
        self.port = sock.getsockname()[1]
        tls = {"ssl_certfile": str(opts.tls_cert), "ssl_keyfile": str(opts.tls_key)} if opts.tls else {}
        config = uvicorn.Config(self.front.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name="ssd-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        scheme = "https" if opts.tls else "http"
        log.info("OpenAI-compatible API at %s://%s:%d/v1", scheme, opts.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.front.close()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, made with proto IPPROTO_TCP: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on connections whose socket says TCP, and those that
    socket.create_server's sockets accept say 0. With Nagle on, each response after a kept-alive
    connection's first (its body written after its headers), and each streamed chunk after the
    first, waited about 40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server: a restart rebinds
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock
