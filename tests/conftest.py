"""Shared fixtures: a tiny target and a tiny draft that agrees with it often."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ssd.config import TinyModelConfig
from ssd.models import TinyTokenizer, build_tiny_model

# One intra-op thread: tiny models are dominated by per-op overhead, and the
# suite must not oversubscribe a 2-core CI machine.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
TINY = TinyModelConfig(vocab_size=16, seed=0)


def tiny_pair(tcfg: TinyModelConfig = TINY, noise: float = 0.03, dtype=torch.float64):
    """(target, draft): the draft is the target with relative Gaussian noise.

    noise 0.03 gives greedy acceptance around 0.5 with K = 4 on the 16-token
    model: both the accept and the reject branches are exercised constantly.
    """
    target = build_tiny_model(tcfg, dtype)
    draft = build_tiny_model(dataclasses.replace(tcfg, noise=noise), dtype)
    return target, draft


@pytest.fixture(scope="session")
def tiny_models():
    return tiny_pair()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return TinyTokenizer.from_config(TINY)
