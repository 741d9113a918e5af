"""The routes open without the token, as grpc.health.v1 and the metrics port are.

    GET  /health (and vLLM's /ping, GET or POST)     200 only while SERVING
    GET  /metrics                                    the server's Prometheus registry
    GET  /version                                    vLLM's: this server's version
    GET  /load                                       vLLM's: requests running and queued now
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import ssd
from ssd.serve.service import GenerationService


class HealthRoutes:
    """Health, metrics, version and load, read from the service."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ping", self.health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for it
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/load", self.load, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])

    async def health(self) -> JSONResponse:
        """200 only while SERVING: the same truth as grpc.health.v1 (both follow the service)."""
        health = self.service.health()
        if not health.serving:
            return JSONResponse({"status": "NOT_SERVING", "reason": health.reason}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def version(self) -> JSONResponse:
        """vLLM's /version: this server's version (open, as /health)."""
        return JSONResponse({"version": ssd.__version__})

    async def load(self) -> JSONResponse:
        """vLLM's /load: the requests running and queued now (open, as /health)."""
        worker = self.service.worker
        running, waiting = worker.counts if worker is not None else (0, 0)
        return JSONResponse({"server_load": running + waiting})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.service.registry), media_type=CONTENT_TYPE_LATEST)
