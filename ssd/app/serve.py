"""Serve the configured pair over gRPC (ssd.v1.GenerationService, health, reflection)
and, with --http-port, the OpenAI-compatible HTTP API (ssd/openai/).

    ssd serve --config configs/tiny.yaml --port 50051
    ssd serve --host 0.0.0.0 --token "$TOKEN" --tls-cert cert.pem --tls-key key.pem
    ssd serve --metrics-port 9400   # Prometheus scrapes http://127.0.0.1:9400/metrics
    ssd serve --http-port 8000      # + the OpenAI API at http://127.0.0.1:8000/v1 (same batch)

Config flags (--mode, --max-new-tokens, --temperature, ...) set the defaults
for requests that leave those fields unset. The token may also come from
$SSD_SERVE_TOKEN (keeps it out of `ps`). SIGINT/SIGTERM: health turns
NOT_SERVING, running requests get --grace-s seconds to finish, then the
server stops.

`python launch/serve.py` takes the same flags.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from ssd.app.cli import add_config_args, add_serve_args, config_from_args, serve_options_from_args
from ssd.openai.server import serve_config
from ssd.serve.server import GenerationServer

log = logging.getLogger("ssd.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    options = serve_options_from_args(args)
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


def _wait_loaded(server: GenerationServer, stop: threading.Event) -> bool:
    """Wait for the model (a signal during loading also ends the wait)."""
    while not stop.is_set():
        if server.wait_ready(timeout=0.5):
            return True
        if server.load_error is not None:
            log.error("the model failed to load: %s", server.load_error)
            return False
    return True

