"""Serve the configured pair over gRPC (ssd.v1.GenerationService, health, reflection).

    python launch/serve.py --config configs/tiny.yaml --port 50051
    python launch/serve.py --host 0.0.0.0 --token "$TOKEN" --tls-cert cert.pem --tls-key key.pem
    python launch/serve.py --metrics-port 9400   # Prometheus scrapes http://127.0.0.1:9400/metrics

Config flags (--mode, --max-new-tokens, --temperature, ...) set the defaults
for requests that leave those fields unset. The token may also come from
$SSD_SERVE_TOKEN (keeps it out of `ps`). SIGINT/SIGTERM: health turns
NOT_SERVING, running requests get --grace-s seconds to finish, then the
server stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from _common import add_config_args, config_from_args

from ssd.config import ConfigError
from ssd.serve.options import ServeOptions
from ssd.serve.server import GenerationServer, serve_config

log = logging.getLogger("ssd.serve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        options = options_from_args(args)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    if options.host not in ("127.0.0.1", "localhost", "::1") and not options.token:
        log.warning("listening on %s without a token: anyone who can reach it can generate", options.host)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = serve_config(config, options, with_draft=not args.no_draft)
    except OSError as exc:
        sys.exit(f"error: {exc}")
    if not _wait_loaded(server, stop):
        server.stop(0)
        return 1
    stop.wait()
    server.stop()
    return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    defaults = ServeOptions()
    parser.add_argument("--host", default=defaults.host, help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help="0: any free port")
    parser.add_argument("--token", default=os.environ.get("SSD_SERVE_TOKEN"),
                        help="require 'authorization: Bearer TOKEN' (default: $SSD_SERVE_TOKEN)")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain; enables TLS with --tls-key")
    parser.add_argument("--tls-key", type=Path, help="PEM private key")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue,
                        help="requests queued + running before RESOURCE_EXHAUSTED")
    parser.add_argument("--max-new-tokens-limit", type=int, default=defaults.max_new_tokens,
                        help="largest max_new_tokens a request may ask for")
    parser.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes)
    parser.add_argument("--grace-s", type=float, default=defaults.grace_s,
                        help="on SIGINT/SIGTERM: seconds running requests may finish")
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; default: off)")
    parser.add_argument("--no-draft", action="store_true", help="load the target only; serve mode ar")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        host=args.host, port=args.port, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
        max_queue=args.max_queue, max_new_tokens=args.max_new_tokens_limit,
        max_message_bytes=args.max_message_bytes, grace_s=args.grace_s, metrics_port=args.metrics_port,
    )


def _wait_loaded(server: GenerationServer, stop: threading.Event) -> bool:
    """Wait for the model (a signal during loading also ends the wait)."""
    while not stop.is_set():
        if server.wait_ready(timeout=0.5):
            return True
        if server.load_error is not None:
            log.error("the model failed to load: %s", server.load_error)
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
