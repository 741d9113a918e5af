"""Decoding engines: AR (the reference), SD and SSD, on one shared loop and one interface."""

from ssd.engine.ar import AREngine
from ssd.engine.base import Engine
from ssd.engine.batch import BatchedAREngine, BatchedSDEngine, BatchEngine, Finished
from ssd.engine.batch_ssd import BatchedSSDEngine
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest, GenerationResult, Generator
from ssd.engine.sd import SDEngine

__all__ = [
    "AREngine", "SDEngine", "BatchEngine", "BatchedAREngine", "BatchedSDEngine", "BatchedSSDEngine", "Finished",
    "Engine", "GenerationRequest", "GenerationResult", "GenerationStats", "Generator",
]
