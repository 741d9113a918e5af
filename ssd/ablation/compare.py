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

from ssd.ablation.replay import ReplayData, ReplayResult, replay
from ssd.ablation.trace import Trace
from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.factory import LoadedPair
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LiveTotals:
    """The live run's counts, summed the way ReplayResult sums them."""

    rounds: int = 0
    new_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, s: GenerationStats) -> None:
        self.rounds += s.rounds
        self.new_tokens += max(0, s.new_tokens - 1)
        self.lookups += s.spec.lookups
        self.hits += s.spec.hits
        self.drafted += s.drafted
        self.accepted += s.accepted

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "lookups": self.lookups,
            "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_round": self.new_tokens / self.rounds if self.rounds else 0.0,
        }


def run_live(
    pair: LoadedPair, trace: Trace, spec: SpeculationConfig, seed_offset: int = 0,
    progress: Callable[[], None] | None = None,
) -> LiveTotals:
    """SSD on each trace sequence's prompt. seed_offset != 0 draws fresh samples at T > 0."""
    spec = dataclasses.replace(spec, mode="ssd")
    # Generation ends as it did while recording: max_new_tokens, and EOS unless it was ignored.
    generation = GenerationConfig(max_new_tokens=trace.meta.max_new_tokens, ignore_eos=not trace.meta.eos_ids)
    totals = LiveTotals()
    with pair.engine(spec) as engine:
        for seq in trace.sequences:
            sampling = SamplingConfig(temperature=trace.meta.temperature, seed=seq.seed + seed_offset)
            out = engine.generate(GenerationRequest(trace.prompts[seq.prompt_index], sampling, generation, spec))
            if trace.meta.greedy and out.token_ids != seq.tokens:
                log.warning("live greedy output differs from the trace for prompt %d (numerics?)", seq.prompt_index)
            totals.add(out.stats)
            if progress is not None:
                progress()
    return totals


def compare(
    pair: LoadedPair, trace: Trace, spec: SpeculationConfig, samples: int = 4, seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> dict[str, dict]:
    """{"predicted": replay row, "measured": live row}."""
    predicted: ReplayResult = replay(ReplayData(trace), spec, samples=samples, seed=seed)
    measured = run_live(pair, trace, spec, progress=progress)
    return {"predicted": predicted.as_dict(), "measured": measured.as_dict()}
