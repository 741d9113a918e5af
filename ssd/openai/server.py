"""The gRPC server with the OpenAI-compatible HTTP API beside it, in one process.

OpenAIServer is ssd.serve.server.GenerationServer plus, when options.http_port is
set, the HTTP API (ssd.openai.app, served by ssd.openai.http) over the same
GenerationService: one admission path, one validation, one worker, so HTTP and
gRPC requests run in the same batch. This composition lives here, above
ssd.serve, so that the serving core never imports the OpenAI surface
(.importlinter). Without http_port it is the gRPC server alone, and FastAPI is
never imported.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from ssd.config import ConfigError
from ssd.serve.backend import Backend
from ssd.serve.options import ServeOptions
from ssd.serve.server import GenerationServer

# What the HTTP API imports that gRPC does not (pyproject.toml's `openai` extra; pydantic
# and starlette come with fastapi), by import name.
HTTP_STACK = ("fastapi", "uvicorn", "python_multipart")


class OpenAIServer(GenerationServer):
    """gRPC, and the OpenAI-compatible API on options.http_port when it is set."""

    serves_http = True

    def __init__(self, options: ServeOptions, load_backend: Callable[[], Backend]) -> None:
        if options.http_port is not None:
            _require_http_stack()
        super().__init__(options, load_backend)
        self.http: Any = None  # ssd.openai.http.HttpServer, while it serves
        self.http_port: int | None = None  # the HTTP API's port, once started

    def _start_front_ends(self) -> None:
        if self.options.http_port is None:
            return
        from ssd.openai.app import OpenAIFrontend  # FastAPI loads only when asked for
        from ssd.openai.http import HttpServer

        self.http = HttpServer(OpenAIFrontend(self.service, self.options), self.options)
        try:
            self.http_port = self.http.start()
        except OSError:  # the port is taken: the front end's threads end with it
            self.http.front.close()
            self.http = None
            raise

    def _stop_front_ends(self) -> None:
        if self.http is not None:
            self.http.stop()


def _require_http_stack() -> None:
    """Refuse http_port before any port is bound, naming the extra, where it is not installed
    (rather than fail on the first import once gRPC already listens)."""
    missing = [name for name in HTTP_STACK if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"serve.http_port needs the `openai` extra ({', '.join(missing)} not installed): "
                          f"pip install 'ssd[openai]'")


def serve_config(config: Any, options: ServeOptions, with_draft: bool = True) -> OpenAIServer:
    """A started server for a Config (HTTP too when options.http_port is set), loading a
    LocalBackend in the background."""
    from ssd.serve.backend import LocalBackend

    server = OpenAIServer(options, lambda: LocalBackend(config, with_draft=with_draft))
    server.start()
    return server
