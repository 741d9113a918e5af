"""Talk to a running `ssd serve` (launch/serve.py) or `ssd cluster`: generate, abort, model info, stats.

    ssd client "abcab" --stream                       # tokens as they arrive
    ssd client "def add(a, b):" --mode ssd --max-new-tokens 64
    ssd client "abcab" --stream --abort-after 8       # Abort RPC after 8 tokens
    ssd client "abcab" --logprobs 2 --prompt-logprobs 0  # each token's log-probability
    ssd client --info                                 # ModelInfo
    ssd client --stats                                # Prometheus text

The generated text goes to stdout; the request id and the stats go to stderr.

`python launch/client.py` takes the same flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf import json_format

from ssd.config import MODES
from ssd.fields import FIELDS
from ssd.serve.client import Completion, GenerationClient

log = logging.getLogger("ssd.client")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    with GenerationClient(args.target, token=args.token, root_certificates=root, tls=args.tls) as client:
        try:
            return run(client, args)
        except grpc.RpcError as exc:
            log.error("%s: %s", exc.code().name, exc.details())
            return 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.prompt or args.info or args.stats):
        p.error("a prompt, --info or --stats is required")
    if not args.chat and (args.prefill is not None or args.template_kwargs is not None):
        p.error("--prefill and --template-kwargs lay out a chat: add --chat")
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    p.add_argument("--token", default=os.environ.get("SSD_SERVE_TOKEN"), help="bearer token (default: $SSD_SERVE_TOKEN)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--tls-ca", type=Path, help="TLS, trusting this PEM certificate (e.g. self-signed)")
    p.add_argument("--stream", action="store_true", help="print text as each round arrives")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--prefill", metavar="TEXT",
                   help="with --chat: the assistant's reply starts with TEXT, which the model continues")
    p.add_argument("--suffix", metavar="TEXT",
                   help="fill in the middle: the text after the insertion (code models with FIM tokens)")
    p.add_argument("--prediction", metavar="TEXT",
                   help="a predicted output (e.g. the code an edit rewrites): prompt lookup also searches it")
    p.add_argument("--template-kwargs", type=json.loads, metavar="JSON",
                   help='with --chat: more chat template variables, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--mode", choices=MODES)
    for spec in FIELDS:  # the request fields (ssd.fields); unset: the server's default
        p.add_argument(spec.flag, type=spec.kind, choices=spec.choices or None, help=f"{spec.rule}; unset: the server's")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--logprobs", type=int, help="report each output token's log-probability, with N alternatives")
    p.add_argument("--prompt-logprobs", type=int,
                   help="report each prompt token's log-probability (after the first) and their sum, with N alternatives")
    p.add_argument("-k", type=int, help="drafted tokens per round (sd, ssd)")
    p.add_argument("--budget", type=int, help="fan-out budget (ssd)")
    p.add_argument("--fanout", choices=["uniform", "geometric"], help="fan-out kind (ssd)")
    p.add_argument("--saguaro-c", type=float, help="Saguaro sampling constant (ssd)")
    p.add_argument("--backup", choices=["neural", "ngram", "random"], help="backup on a cache miss (ssd)")
    p.add_argument("--priority", type=int, help="vLLM's priority: among queued requests, lower is admitted sooner")
    p.add_argument("--request-id", default="", help="id to Abort by (default: server-assigned)")
    p.add_argument("--abort-after", type=int, metavar="N", help="send Abort after N tokens arrive")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--info", action="store_true", help="print ModelInfo and exit")
    p.add_argument("--stats", action="store_true", help="print the Prometheus text of Stats and exit")
    p.add_argument("--log-level", default="INFO")
    return p


def run(client: GenerationClient, args: argparse.Namespace) -> int:
    if args.info:
        sys.stdout.write(json_format.MessageToJson(client.model_info()) + "\n")
        return 0
    if args.stats:
        sys.stdout.write(client.stats().prometheus_text)
        return 0
    out = client.generate(timeout=args.timeout, on_message=_on_message(client, args), **request_args(args))
    sys.stdout.write(("" if args.stream else out.text) + "\n")
    report(out)
    report_logprobs("prompt", out.prompt_logprobs)
    report_logprobs("output", out.logprobs)
    return 0 if out.finish_reason != "error" else 1


def request_args(args: argparse.Namespace) -> dict:
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"text": args.prompt}
    if args.chat and args.prefill is not None:
        prompt["messages"].append({"role": "assistant", "content": args.prefill})
        prompt["chat_options"] = {"add_generation_prompt": False, "continue_final_message": True}
    if args.chat and args.template_kwargs is not None:
        prompt.setdefault("chat_options", {})["template_kwargs"] = args.template_kwargs
    return dict(
        prompt, request_id=args.request_id, mode=args.mode, stop=args.stop,
        **{spec.name: getattr(args, spec.name) for spec in FIELDS}, k=args.k, fanout_budget=args.budget,
        fanout_kind=args.fanout, saguaro_c=args.saguaro_c, backup=args.backup, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs, suffix=args.suffix, prediction=args.prediction, priority=args.priority,
    )


def _on_message(client: GenerationClient, args: argparse.Namespace) -> Callable[[Any], None]:
    """Print deltas when streaming; send Abort once --abort-after tokens have arrived."""
    received = 0
    aborted = False

    def on_message(message) -> None:
        nonlocal received, aborted
        if args.stream and message.text:
            sys.stdout.write(message.text)
            sys.stdout.flush()
        received += len(message.token_ids)
        if args.abort_after is not None and not aborted and received >= args.abort_after:
            aborted = True
            log.info("aborting %s after %d tokens: found=%s", message.request_id, received,
                     client.abort(message.request_id))

    return on_message


def report(out: Completion) -> None:
    s = out.stats
    line = f"request {out.request_id}: finish {out.finish_reason}"
    if out.finished is not None and out.finished.error:
        line += f" ({out.finished.error})"
    if s is not None:
        line += (f"; {s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, TTFT {s.time_to_first_token_s * 1000:.0f} ms, "
                 f"queue {s.queue_s * 1000:.0f} ms, rounds {s.rounds}, acceptance {s.acceptance_rate:.3f}")
        if s.spec.lookups:
            line += f", cache hit rate {s.spec.hit_rate:.3f}"
    log.info("%s", line)
    if s is not None:
        log.debug("stats: %s", json_format.MessageToJson(s))


def report_logprobs(which: str, entries: list) -> None:
    """One line a token (its id, log-probability and the alternatives' id:log-probability), then the sum."""
    if not entries:
        return
    for e in entries:
        top = " ".join(f"{t.token}:{t.logprob:.4f}" for t in e.top)
        log.info("%s token %d %.6f%s", which, e.token, e.logprob, f" [{top}]" if top else "")
    log.info("%s log-probability: %.6f over %d tokens", which, sum(e.logprob for e in entries), len(entries))

