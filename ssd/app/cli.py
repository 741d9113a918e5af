"""Flags shared by the launch scripts (launch/*.py), turned into the package's objects.

Every script that loads a pair takes the same config flags (--config and its
overrides); the two that serve take the same server flags. They live here,
not in launch/, so a script and its tests import them from one place.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ssd.config import BACKENDS, BACKUPS, GLUES, MODES, Config, ConfigError, load_config
from ssd.fields import FLAGS
from ssd.versions import warn_if_untested
from ssd.serve.options import REASONING_PARSERS, ServeOptions

# The repository root: configs/ and its prompt sets sit beside the package.
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "qwen2.5-coder-cpu.yaml"
PROMPT_DIR = ROOT / "configs" / "prompts"
# --target-precision / --draft-precision: one name for a (dtype, quantization) pair.
PRECISIONS = {
    "auto": ("auto", "auto"), "int8": ("fp32", "int8"), "gguf": ("fp32", "gguf"),
    "bf16": ("bf16", None), "fp32": ("fp32", None), "fp64": ("fp64", None),
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML config file")
    parser.add_argument("--mode", choices=MODES, help="override speculation.mode")
    parser.add_argument("-k", type=int, help="override speculation.k (drafted tokens per round)")
    parser.add_argument("--fanout", choices=["uniform", "geometric"], help="override speculation.fanout.kind")
    parser.add_argument("--budget", type=int, help="override speculation.fanout.budget (branches per round)")
    parser.add_argument("--anytime", action=argparse.BooleanOptionalAction, default=None,
                        help="override speculation.fanout.anytime (SSD builds stop when the outcome arrives "
                             "and the budget follows the round)")
    parser.add_argument("--ngram-candidates", action=argparse.BooleanOptionalAction, default=None,
                        help="override speculation.ngram_candidates (free n-gram entries in SSD's cache)")
    parser.add_argument("--prompt-lookup", type=int, metavar="N",
                        help="override speculation.prompt_lookup.max_tokens: a round that drafts nothing (K 0, "
                             "or no draft) verifies up to N tokens the text so far predicts (0: off; default: K)")
    parser.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=None,
                        help="override speculation.adaptive_k (SSD: each round's K from the measured rounds, "
                             "up to speculation.max_k)")
    parser.add_argument("--draft-vocab", type=int, metavar="SIZE",
                        help="override speculation.draft_vocab.size: the draft's LM head over the SIZE most "
                             "frequent tokens of speculation.draft_vocab.source (torch drafts; 0: full)")
    parser.add_argument("--glue", choices=GLUES, help="override speculation.glue (how an SSD cache build starts)")
    parser.add_argument("--always-speculate", action="store_true",
                        help="SSD: speculate at every batch size, even where the start-up plan finds AR faster "
                             "(speculation.k_policy: {}, kept)")
    parser.add_argument("--no-plan", action="store_true",
                        help="SSD: keep the configured K, budget and glue instead of timing this host at start")
    parser.add_argument("--saguaro-c", type=float, help="override speculation.saguaro_c")
    parser.add_argument("--backup", choices=BACKUPS, help="override speculation.backup")
    for spec in FLAGS:  # the request fields' (ssd.fields): each sets the command's value and a server's default
        parser.add_argument(spec.flag, type=spec.kind, choices=spec.choices or None, help=spec.help)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--threads", type=int, help="override runtime.threads")
    parser.add_argument("--prefix-cache", "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="override batching.prefix_cache: later prompts reuse earlier ones' "
                        "whole prompt chunks (vLLM's flag name too)")
    parser.add_argument("--prefill-chunk", type=int, metavar="N",
                        help="override batching.prefill_chunk (prompt tokens a step; the prefix cache's unit)")
    for role in ("target", "draft"):
        parser.add_argument(f"--{role}-precision", choices=sorted(PRECISIONS),
                            help=f"override {role}.dtype and {role}.quantization (auto: fastest on this host)")
    parser.add_argument("--backend", choices=list(BACKENDS),
                        help="override target.backend and draft.backend (auto: llama.cpp on a CPU for a "
                             "GGUF model at precision auto, else torch)")
    parser.add_argument("--no-quant-cache", action="store_true",
                        help="int8: quantize from the checkpoint at every start (no int8 weights on disk)")
    parser.add_argument("--log-level", default="INFO", help="logging level")


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file with the flags' overrides; a bad file or value exits naming it."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    warn_if_untested()  # a GPU image's own torch or transformers, outside the tested range
    overrides: dict[str, Any] = {}
    fanout = {k: v for k, v in (("kind", args.fanout), ("budget", args.budget), ("anytime", args.anytime))
              if v is not None}
    if fanout:
        overrides["speculation"] = {"fanout": fanout}
    for section, key, value in [
        ("speculation", "saguaro_c", args.saguaro_c),
        ("speculation", "backup", args.backup),
        ("speculation", "ngram_candidates", args.ngram_candidates),
        ("speculation", "adaptive_k", args.adaptive_k),
        ("speculation", "mode", args.mode),
        ("speculation", "k", args.k),
        ("speculation", "glue", args.glue),
        ("generation", "stop", args.stop),
        # A request field's flag sets the command's value and is a server's explicit default for
        # requests that omit the field (ssd.config.RequestDefaults); without one, OpenAI's apply.
        *((spec.section, spec.name, getattr(args, spec.name)) for spec in FLAGS),
        *(("serve_defaults", spec.name, getattr(args, spec.name)) for spec in FLAGS if spec.server_default),
        ("runtime", "threads", args.threads),
        ("batching", "prefix_cache", args.prefix_cache),
        ("batching", "prefill_chunk", args.prefill_chunk),
        # launch/cluster.py's placement flags (other scripts do not take them)
        ("cluster", "replicas", getattr(args, "replicas", None)),
        ("cluster", "draft_node", getattr(args, "draft_node", None)),
        ("cluster", "warm_standby", getattr(args, "warm_standby", None)),
    ]:
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    keeps = [name for name, value in (("k", args.k), ("budget", args.budget), ("glue", args.glue)) if value is not None]
    if args.always_speculate:
        overrides.setdefault("speculation", {})["k_policy"] = {}
        keeps.append("k_policy")
    if keeps:
        overrides.setdefault("runtime", {})["plan_keeps"] = keeps
    if args.no_plan:
        overrides.setdefault("runtime", {})["plan"] = False
    if args.draft_vocab is not None:
        overrides.setdefault("speculation", {})["draft_vocab"] = {"size": args.draft_vocab}
    if args.prompt_lookup is not None:
        overrides.setdefault("speculation", {})["prompt_lookup"] = {"max_tokens": args.prompt_lookup}
    for role in ("target", "draft"):
        precision = getattr(args, f"{role}_precision")
        if precision:
            dtype, quantization = PRECISIONS[precision]
            overrides.setdefault(role, {}).update(dtype=dtype, quantization=quantization)
        if args.no_quant_cache:
            overrides.setdefault(role, {})["cache_quantized"] = False
        if args.backend:
            overrides.setdefault(role, {})["backend"] = args.backend
    try:
        return load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The gRPC server's flags (launch/serve.py and launch/cluster.py)."""
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
    parser.add_argument("--http-port", type=int, default=defaults.http_port,
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                             "/v1/responses, /v1/models, /health, /metrics) on this port (0: any free port; "
                             "default: off)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=defaults.reasoning_parser,
                        help="<think>...</think> as reasoning_content (chat) or a reasoning item (responses): "
                             "think, none, or auto: where the tokenizer has <think> tokens (Qwen3, DeepSeek-R1)")
    parser.add_argument("--served-model-name", nargs="+", default=list(defaults.served_model_names),
                        metavar="NAME", help="the model's names over HTTP: requests' model must be one of them "
                                             "(default: the target's name)")
    parser.add_argument("--stored-responses", type=int, default=defaults.stored_responses, metavar="N",
                        help="keep the last N Responses API responses for previous_response_id and GET "
                             "/v1/responses/{id} (0: store none)")
    parser.add_argument("--stored-conversations", type=int, default=defaults.stored_conversations, metavar="N",
                        help="keep the last N conversations of the Conversations API (0: none)")
    parser.add_argument("--stored-file-bytes", type=int, default=defaults.stored_file_bytes, metavar="BYTES",
                        help="bytes of files (batch inputs and outputs: /v1/files, /v1/batches) kept in memory, all "
                             "together; an upload past it is refused (default: 1 GiB)")
    parser.add_argument("--batch-concurrency", type=int, default=defaults.batch_concurrency, metavar="N",
                        help="lines of /v1/batches batches running at once beside live requests (default: half of "
                             "--max-queue, and one fewer than the rows (batching.max_rows x replicas), so a live "
                             "request finds a row free)")
    parser.add_argument("--store-dir", default=defaults.store_dir, metavar="DIR",
                        help="write stored responses and conversations to DIR (every 10 s while they change, and at "
                             "the stop), files and batch journals as they change, and read them back at the start: "
                             "a batch that was running goes on (default: memory only)")
    parser.add_argument("--no-draft", action="store_true", help="load the target only; serve mode ar")


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from add_serve_args' flags; a value ServeOptions refuses exits with its
    message, as config_from_args does."""
    try:
        return ServeOptions(
            host=args.host, port=args.port, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
            max_queue=args.max_queue, max_new_tokens=args.max_new_tokens_limit,
            max_message_bytes=args.max_message_bytes, grace_s=args.grace_s, metrics_port=args.metrics_port,
            http_port=args.http_port, reasoning_parser=args.reasoning_parser,
            served_model_names=tuple(args.served_model_name), stored_responses=args.stored_responses,
            stored_conversations=args.stored_conversations, store_dir=args.store_dir,
            stored_file_bytes=args.stored_file_bytes, batch_concurrency=args.batch_concurrency,
        )
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
