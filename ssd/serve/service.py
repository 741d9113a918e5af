"""What both front ends (gRPC: ssd.serve.server, HTTP: ssd.serve.http) share about the service's state."""

from __future__ import annotations


class NotServing(RuntimeError):
    """The model is loading, restarting or shutting down; str() says which."""
