"""Decoding engines: one batched engine per mode on one round loop (batch.py).

AR (ar.py) and SD (sd.py) live here; SSD's engine lives with the rest of its
algorithm (ssd.saguaro.target). `ssd.factory.make_engine` makes any of them.
"""

from ssd.engine.ar import AREngine
from ssd.engine.batch import BatchedEngine, Engine, Finished
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest, GenerationResult, Generator
from ssd.engine.sd import SDEngine

__all__ = [
    "AREngine", "SDEngine", "BatchedEngine", "Engine", "Finished",
    "GenerationRequest", "GenerationResult", "GenerationStats", "Generator",
]
