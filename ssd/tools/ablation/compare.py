"""Check the replay against the real thing: live in-process SSD on the trace's own prompts.

Every sequence of the trace is generated again by SSD (LoadedPair.engine, the
speculator in a thread) with the trace's prompt, seed, temperature and
max_new_tokens; the live hit rate and tokens per round are set beside the
replay's prediction. Under greedy the two must agree exactly (up to the
models' numerical reproducibility); at T > 0 they agree within sampling noise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ssd.tools.ablation.replay import ReplayData, ReplayResult, replay
from ssd.tools.ablation.trace import Trace
from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.factory import LoadedPair, make_engine
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest

log = logging.getLogger(__name__)


def live_row(total: GenerationStats) -> dict:
    """The live run's counts, summed the way ReplayResult sums them (tokens after each first)."""
    after_first = total.new_tokens - total.requests
    return {
        "rounds": total.rounds, "lookups": total.spec.lookups, "hit_rate": total.spec.hit_rate,
        "acceptance_rate": total.acceptance_rate,
        "tokens_per_round": after_first / total.rounds if total.rounds else 0.0,
    }


def run_live(
    pair: LoadedPair, trace: Trace, spec: SpeculationConfig, seed_offset: int = 0,
    progress: Callable[[], None] | None = None,
) -> GenerationStats:
    """SSD on each trace sequence's prompt, its stats totalled. seed_offset != 0 draws fresh samples at T > 0."""
    spec = dataclasses.replace(spec, mode="ssd")
    # Generation ends as it did while recording: max_new_tokens, and EOS unless it was ignored.
    generation = GenerationConfig(max_new_tokens=trace.meta.max_new_tokens, ignore_eos=not trace.meta.eos_ids)
    runs = []
    with make_engine("ssd", pair, spec) as engine:
        for seq in trace.sequences:
            sampling = SamplingConfig(temperature=trace.meta.temperature, seed=seq.seed + seed_offset)
            out = engine.generate(GenerationRequest(trace.prompts[seq.prompt_index], sampling, generation, spec))
            if trace.meta.greedy and out.token_ids != seq.tokens:
                log.warning("live greedy output differs from the trace for prompt %d (numerics?)", seq.prompt_index)
            runs.append(out.stats)
            if progress is not None:
                progress()
    return total(runs, mode="ssd")


def compare(
    pair: LoadedPair, trace: Trace, spec: SpeculationConfig, samples: int = 4, seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict]:
    """{"predicted": replay row, "measured": live row}."""
    predicted: ReplayResult = replay(ReplayData(trace), spec, samples=samples, seed=seed)
    measured = run_live(pair, trace, spec, progress=progress)
    return {"predicted": predicted.as_dict(), "measured": live_row(measured)}
