"""The GPU smoke's T > 0 check: does SD on this device sample the target's law?

A 4-token vocabulary, one layer (the test suite's tests/test_distribution.py
setting, fp32 on the device): SAMPLES seeded SD requests (K = 3, T = 1) run
as rows of one continuous batch, as serving runs them (packed forwards), and
the joint of generated tokens 1-4 (the first round's three drafted depths
and its bonus) is tested against the target's exact joint, enumerated on
the same model (ssd.tools.bench.exact): chi-square, alpha 0.001. Seconds on
a GPU; the verifier is a parameter so the test suite can show the check's
power with a broken one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig
from ssd.engine import SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.tools.bench.exact import chi_square_pvalue, exact_marginal
from ssd.verify import verify

log = logging.getLogger(__name__)

SMALL = TinyModelConfig(vocab_size=4, num_hidden_layers=1, initializer_range=0.4, seed=4)
DRAFT_NOISE = 0.1
PROMPT = [0, 1, 2]
K = 3
POSITIONS = [1, 2, 3, 4]  # the first round's drafted depths 1..K and its bonus
SAMPLES = 800
ROWS = 16
ALPHA = 1e-3
SAMPLING = SamplingConfig(temperature=1.0)


def check_sampling(device: str, samples: int = SAMPLES, verifier: Callable = verify) -> dict[str, Any]:
    """SD's sampled tokens 1-4 against the target's exact joint (see the module docstring)."""
    target = build_tiny_model(SMALL, torch.float32).to(device)
    draft = build_tiny_model(dataclasses.replace(SMALL, noise=DRAFT_NOISE), torch.float32).to(device)
    engine = SDEngine(target, draft, TinyTokenizer(SMALL.vocab_size), SpeculationConfig(mode="sd", k=K),
                      BatchingConfig(max_rows=ROWS), verifier=verifier)
    generation = GenerationConfig(max_new_tokens=max(POSITIONS) + 1, ignore_eos=True)
    requests = [GenerationRequest(PROMPT, dataclasses.replace(SAMPLING, seed=seed), generation)
                for seed in range(samples)]
    drawn = [tuple(r.token_ids[i] for i in POSITIONS) for r in run_rows(engine, requests)]
    pvalue = chi_square_pvalue(drawn, exact_marginal(target, PROMPT, max(POSITIONS) + 1, SAMPLING, POSITIONS))
    log.info("sampling check on %s: p = %.3g over %d samples", device, pvalue, samples)
    return {"passed": pvalue > ALPHA, "pvalue": pvalue, "samples": samples, "temperature": SAMPLING.temperature,
            "vocab_size": SMALL.vocab_size, "k": K, "rows": ROWS}


def run_rows(engine, requests: list[GenerationRequest]) -> list:
    """Every request's result, admitted in order as rows free up (continuous batching)."""
    results, queue = {}, list(reversed(requests))
    while queue or engine.rows:
        while queue and engine.can_admit(queue[-1]):
            engine.admit(queue.pop())
        for finished in engine.step():
            if finished.error is not None:
                raise RuntimeError(f"a sampled request failed: {finished.error}")
            results[id(finished.request)] = finished.result
    return [results[id(r)] for r in requests]
