"""Decoding engines: one batched engine per mode on one round loop (batch.py).

AR (ar.py) and SD (sd.py) live here; SSD's engine lives with the rest of its
algorithm (ssd.saguaro.target). `ssd.factory.make_engine` makes any of them.
processing.py applies a request's logit_bias, penalties and grammar mask (grammar.py,
llguidance) to the target's law and the draft's, with the grammar state following the rows.
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
