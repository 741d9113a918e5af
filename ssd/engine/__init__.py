"""Decoding engines: AR (the reference) and SD, on one shared loop."""

from ssd.engine.ar import AREngine
from ssd.engine.base import Engine, GenerationResult
from ssd.engine.metrics import GenerationStats
from ssd.engine.sd import SDEngine

__all__ = ["AREngine", "SDEngine", "Engine", "GenerationResult", "GenerationStats"]
