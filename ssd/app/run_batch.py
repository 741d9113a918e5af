"""Run a file of OpenAI batch requests through the configured pair, with no port to
serve (vLLM's `run-batch`): the same lines, and the same output lines, as a batch
created over HTTP (POST /v1/files, POST /v1/batches; ssd/openai/routes/batches.py).

    ssd run-batch -i requests.jsonl -o results.jsonl
    ssd run-batch -i requests.jsonl -o results.jsonl --config configs/tiny.yaml --mode ssd

Each input line is OpenAI's {"custom_id", "method": "POST", "url", "body"}; every line
takes the first line's url (/v1/chat/completions, /v1/completions or /v1/responses).
The output holds one line per request in input order: {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}; a request the API refused has its 4xx
there. A file with a malformed line runs nothing: its errors are printed (exit 2).
Lines run --max-queue at a time (nothing else needs the queue), rows of one
continuous batch.

`python launch/run_batch.py` takes the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ssd.app.cli import add_config_args, add_serve_args, config_from_args, serve_options_from_args
from ssd.openai.batches import Batch, BatchLine, read_lines
from ssd.serve.options import ServeOptions
from ssd.openai.responses import new_id
from ssd.openai.server import serve_config
from ssd.serve.server import GenerationServer

log = logging.getLogger("ssd.run_batch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input", type=Path, required=True, help="the requests, OpenAI's batch JSONL")
    parser.add_argument("-o", "--output", type=Path, required=True, help="where the results go (JSONL)")
    add_serve_args(parser)
    add_config_args(parser)
    return parser


def endpoint_of(content: bytes) -> str:
    """The first request's url: the file's endpoint (read_lines names lines that differ)."""
    for raw in content.decode("utf-8", errors="replace").splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                return ""
            return url if isinstance(url, str) else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    options = serve_options_from_args(args)
    content = args.input.read_bytes()
    endpoint = endpoint_of(content)
    lines, errors = read_lines(content, endpoint)
    if errors:
        for error in errors:
            print(f"{args.input}:{error['line']}: {error['message']}", file=sys.stderr)
        return 2
    # Nothing to serve (a loopback port), nothing kept (a server's stores are the server's), and
    # no live requests to leave room for.
    options = dataclasses.replace(options, host="127.0.0.1", port=0, http_port=None, metrics_port=None,
                                  store_dir=None, batch_concurrency=options.batch_concurrency or options.max_queue)
    server = serve_config(config, options, with_draft=not args.no_draft)
    try:
        if not server.wait_ready():
            sys.exit(f"error: the model failed to load: {server.load_error}")
        batch = run(server, options, lines, endpoint)
    finally:
        server.stop(0)
    args.output.write_bytes(batch.every_line())
    report = batch.public()
    counts, usage = report["request_counts"], report["usage"]
    log.info("%d requests: %d completed, %d failed; %d prompt and %d output tokens; results in %s",
             counts["total"], counts["completed"], counts["failed"], usage["input_tokens"], usage["output_tokens"],
             args.output)
    return 0


def run(server: GenerationServer, options: ServeOptions, lines: list[BatchLine], endpoint: str) -> Batch:
    """The lines through the HTTP front end's own batch runner, with a progress bar."""
    from ssd.openai.app import OpenAIFrontend  # FastAPI loads only when asked for
    from ssd.openai.routes.batches import Running

    front = OpenAIFrontend(server.service, options)
    batch = Batch(new_id("batch"), endpoint, "local", None, len(lines))
    started = time.perf_counter()
    try:
        with tqdm(total=len(lines), unit="req", desc="batch") as bar:
            asyncio.run(front.batches.run(Running(batch, None), lines, on_line=bar.update))
    finally:
        front.close()
    seconds = time.perf_counter() - started
    output = batch.public()["usage"]["output_tokens"]
    log.info("ran %d requests in %.1f s, %d at a time: %.2f output tokens/s", len(lines), seconds,
             options.batch_concurrency, output / seconds)
    return batch

