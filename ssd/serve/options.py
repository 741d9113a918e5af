"""What a server binds to and what it admits: network, security and request limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ssd.config import ConfigError


REASONING_PARSERS = ("auto", "think", "none")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"  # loopback unless asked: the API has no per-user quotas
    port: int = 50051  # 0: any free port (the server reports the one it got)
    token: str | None = None  # bearer token required on every ssd.v1 call when set
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = 4 * 1024 * 1024
    max_queue: int = 16  # requests queued + running; more get RESOURCE_EXHAUSTED
    max_new_tokens: int = 2048  # also capped by the model's context
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    max_k: int = 16
    max_budget: int = 256
    max_chat_messages: int = 256
    grace_s: float = 10.0  # on stop: how long running requests may finish
    # HTTP /metrics for Prometheus on `host`, without the token (it shows counts,
    # never prompts or outputs); TLS when the gRPC port has it. 0: any free
    # port (the server reports the one it got); None: no endpoint.
    metrics_port: int | None = None
    # The OpenAI-compatible HTTP API (ssd.openai.server) on `host`, same process,
    # same batch; TLS and the token as for gRPC. 0: any free port; None: off.
    http_port: int | None = None
    # Reasoning models' <think>...</think> as `reasoning_content` (chat) or a reasoning item
    # (Responses), as vLLM's reasoning parsers split it: "think" on, "none" off, "auto" on
    # where the tokenizer has <think> and </think> tokens (Qwen3, QwQ, DeepSeek-R1).
    reasoning_parser: str = "auto"
    # The names the HTTP API serves the model under (vLLM's --served-model-name): requests'
    # `model` must be one of them, /v1/models lists each. Empty: the target's own name.
    served_model_names: tuple[str, ...] = ()
    # Finished Responses API responses kept in memory for previous_response_id and GET
    # /v1/responses/{id} (ssd.openai.stored), least recently used out first; 0: none.
    stored_responses: int = 1024
    # Conversations (OpenAI's Conversations API, ssd.openai.routes.conversations) kept in
    # memory, least recently used out first; 0: none.
    stored_conversations: int = 1024
    # A directory where the stored responses and conversations are written (every 10 s while
    # they change, and at the stop) and read back at the start, so they outlive a restart;
    # files and batch journals too (ssd.openai.batch_disk: a running batch goes on). None: memory only.
    store_dir: str | None = None
    # Bytes of files (OpenAI's Files API: batch inputs, batch outputs) kept in memory, all
    # files together; an upload past it is refused (ssd.openai.files). 0: no files, no batches.
    stored_file_bytes: int = 1024 * 1024 * 1024
    # Lines of OpenAI batches (/v1/batches) running at once, as rows beside live requests;
    # None: `batch_lines` (half of max_queue, leaving live requests a row).
    batch_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("serve: tls_cert and tls_key must be given together")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port must be in 0..65535, got {self.port}")
        for name in ("metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"serve.{name} must be in 0..65535, got {value}")
        if self.token is not None and not self.token.strip():
            raise ConfigError("serve.token must not be blank")
        for name in ("max_queue", "max_new_tokens", "max_stop_strings", "max_stop_chars",
                     "max_k", "max_budget", "max_chat_messages", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"serve.{name} must be >= 1, got {getattr(self, name)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"serve.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        if any(not name.strip() for name in self.served_model_names):
            raise ConfigError("serve.served_model_names must not hold a blank name")
        for name in ("stored_responses", "stored_conversations", "stored_file_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"serve.{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_concurrency is not None and not 1 <= self.batch_concurrency <= self.max_queue:
            raise ConfigError(f"serve.batch_concurrency must be in 1..max_queue ({self.max_queue}), "
                              f"got {self.batch_concurrency}")
        if self.grace_s < 0:
            raise ConfigError(f"serve.grace_s must be >= 0, got {self.grace_s}")

    def batch_lines(self, rows: int) -> int:
        """Batch lines that run at once beside live requests, on a server of `rows` rows in all:
        batch_concurrency, else half the queue and at most rows - 1 (a row stays free for a
        live request, where lines ask for one choice each)."""
        return self.batch_concurrency or max(1, min(self.max_queue // 2, rows - 1))

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
