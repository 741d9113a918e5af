"""Run every benchmark mode over prompt sets and temperatures; collect GenerationStats.

Modes: "ar", "sd", "ssd" (our engines), "hf" (transformers assisted
generation on the same modules) and "llama.cpp" (plain decoding of the
target's GGUF file, an optional peer). In-process modes run once per torch thread
count; SSD may instead run through the cluster runtime (target and draft on
their own cores). Every mode sees the same prompt ids, sampling (seed = the
config's seed + prompt index) and end conditions, so rows compare like for like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from ssd.tools.bench.hf_assisted import HFAssistedEngine
from ssd.tools.bench.llamacpp import MODE as LLAMA_CPP
from ssd.tools.bench.llamacpp import LlamaCppEngine, gguf_for
from ssd.tools.prompts import Prompt
from ssd.config import MODES as ENGINE_MODES
from ssd.config import Config, SamplingConfig, SpeculationConfig
from ssd.factory import LoadedPair, make_engine
from ssd.engine.metrics import GenerationStats
from ssd.engine.request import GenerationRequest, Generator

log = logging.getLogger(__name__)

MODES = (*ENGINE_MODES, "hf", LLAMA_CPP)  # ours, then the peers
UNSPECULATIVE = ("ar", LLAMA_CPP)  # modes without K
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class RunKey:
    """What one row of the report measures."""

    prompt_set: str
    temperature: float
    mode: str
    k: int = 0  # drafted tokens per round; 0 for AR
    threads: int = 0  # torch intra-op threads; 0: torch's default
    cluster: bool = False  # through the distributed runtime (one core per role)
    variant: str = ""  # SSD through the cluster with some of its adaptive parts off (SSD_VARIANTS)

    @property
    def name(self) -> str:
        """Mode, K, placement and variant; the thread count aside."""
        name = self.mode if self.mode in UNSPECULATIVE else f"{self.mode} K={self.k}"
        name = f"{name} cluster" if self.cluster else name
        return f"{name} {self.variant}" if self.variant else name

    @property
    def label(self) -> str:
        """Unique within a (prompt set, temperature) group."""
        return f"{self.name} t={self.threads}" if self.threads and not self.cluster else self.name

    @property
    def threads_label(self) -> str:
        if self.cluster:
            return "1+1"  # target pinned to one core, draft to another
        return str(self.threads) if self.threads else "default"


@dataclass
class Sample:
    """One generation of one prompt."""

    prompt_index: int
    stats: GenerationStats
    token_ids: list[int]
    # Tokens admitted together with the first: 1 for our engines, a whole
    # round for HF. The decode rate counts the tokens after them.
    first_tokens: int = 1

    @property
    def decode_tokens(self) -> int:
        return max(0, self.stats.new_tokens - self.first_tokens)

    @property
    def decode_s(self) -> float:
        return max(0.0, self.stats.total_s - self.stats.time_to_first_token_s)


Results = dict[RunKey, list[Sample]]


@dataclass
class BenchPlan:
    modes: Sequence[str]
    ks: Sequence[int]
    temperatures: Sequence[float]
    prompt_sets: dict[str, list[Prompt]]
    thread_counts: Sequence[int] = (0,)
    cluster_ssd: bool = False  # SSD through the cluster runtime, not in-process
    # ... at the start-up plan's settings ("no flags": what launch/cluster.py runs), not at `ks`
    cluster_planned: bool = False
    # ... and, beside it, the same cluster with these SSD_VARIANTS (per-request settings, interleaved)
    ssd_variants: Sequence[str] = ()
    # ... and these fixed (K, budget) points of SSD (fixed_ssd), likewise
    ssd_grid: Sequence[tuple[int, int]] = ()
    sd_ks: Sequence[int] = ()  # SD's K values where they differ from `ks` (the best SD among several)
    progress: bool = True
    mode_runs: list[tuple[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown modes {sorted(unknown)}; known: {MODES}")
        self.mode_runs = [(m, 0) for m in self.modes if m in UNSPECULATIVE] + [
            (m, k) for m in self.modes if m not in UNSPECULATIVE for k in (self.sd_ks if m == "sd" else ()) or self.ks
        ]

    def local_runs(self) -> list[tuple[str, int]]:
        return [(m, k) for m, k in self.mode_runs if not (self.cluster_ssd and m == "ssd")]

    def cluster_runs(self) -> list[tuple[str, int]]:
        return [(m, k) for m, k in self.mode_runs if self.cluster_ssd and m == "ssd"]

    def generations_per_run(self) -> int:
        return len(self.temperatures) * sum(len(p) for p in self.prompt_sets.values())


def bench_engine(pair: LoadedPair, config: Config, mode: str, k: int, threads: int = 0) -> Generator:
    """Our engines from make_engine (the server's and the cluster's); the peers built here."""
    if mode == LLAMA_CPP:
        return LlamaCppEngine(gguf_for(config.target.name), threads)
    if mode != "ar" and pair.draft is None:
        raise ValueError(f"mode {mode!r} needs a draft model; none was loaded")
    speculation = speculation_for(config, mode, k) or config.speculation
    if mode == "hf":
        return HFAssistedEngine(pair.target, pair.draft, pair.tokenizer, speculation)
    return make_engine(mode, pair, speculation, config.batching)


def speculation_for(config: Config, mode: str, k: int) -> SpeculationConfig | None:
    """The settings a row's requests carry: HF assisted generation is SD for its K;
    AR and llama.cpp speculate nothing."""
    if mode in UNSPECULATIVE:
        return None
    return dataclasses.replace(config.speculation, mode="sd" if mode == "hf" else mode, k=k or config.speculation.k)


@dataclass
class Turn:
    """One row's generator and the speculation settings its requests carry."""

    key: RunKey  # without prompt set and temperature
    generator: Generator
    speculation: SpeculationConfig | None

    def run(self, ids: list[int], sampling: SamplingConfig, config: Config, max_new_tokens: int = 0):
        """One request of this row: its prompt, sampling, the config's limits, its speculation."""
        generation = dataclasses.replace(config.generation, max_new_tokens=max_new_tokens or config.generation.max_new_tokens)
        return self.generator.generate(GenerationRequest(ids, sampling, generation, self.speculation))


def seeded(sampling: SamplingConfig, temperature: float, prompt_index: int) -> SamplingConfig:
    """Every mode draws prompt i's sample with the same seed."""
    return dataclasses.replace(sampling, temperature=temperature, seed=sampling.seed + prompt_index)


def run_bench(pair: LoadedPair, config: Config, plan: BenchPlan) -> Results:
    """Every mode on every prompt, interleaved: prompt after prompt, each mode in turn.

    A shared machine speeds up and slows down over minutes; running mode
    after mode would hand those swings to whichever mode ran then. Taking
    turns on each prompt spreads them over all modes alike, so the ratios
    between rows hold. In-process engines set torch's thread count before each
    generation (restored after); SSD through the cluster keeps its actors
    pinned to one core each (target core 0, draft core 1) and idle between turns.
    """
    encoded = {name: [p.encode(pair.tokenizer) for p in prompts] for name, prompts in plan.prompt_sets.items()}
    results: Results = {}
    saved_threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        turns = _open_engines(pair, config, plan, stack)
        warm_ids = next(iter(encoded.values()))[0]
        for turn in turns:  # first calls pay for lazy initialisation, not the measured rows
            _set_threads(turn.key)
            turn.run(warm_ids, config.sampling, config, max_new_tokens=WARM_UP_TOKENS)
        total = len(turns) * plan.generations_per_run()
        with _bar(total, "bench", plan.progress) as bar:
            for set_name, prompts in encoded.items():
                for temperature in plan.temperatures:
                    for i, ids in enumerate(prompts):
                        for turn in turns:
                            key = dataclasses.replace(turn.key, prompt_set=set_name, temperature=float(temperature))
                            bar.set_postfix_str(f"{set_name} T={temperature} {key.label}")
                            _set_threads(key)
                            result = turn.run(ids, seeded(config.sampling, temperature, i), config)
                            results.setdefault(key, []).append(
                                Sample(i, result.stats, list(result.token_ids), result.first_tokens)
                            )
                            log.debug("%s prompt %d: %s", key.label, i, result.stats.summary())
                            bar.update()
        torch.set_num_threads(saved_threads)
    return results


def _open_engines(pair: LoadedPair, config: Config, plan: BenchPlan, stack: contextlib.ExitStack) -> list[Turn]:
    """A turn for every row of the plan."""
    turns = []
    for threads in plan.thread_counts:
        for mode, k in plan.local_runs():
            engine = bench_engine(pair, config, mode, k, threads)
            stack.callback(engine.close)
            turns.append(Turn(RunKey("", 0.0, mode, k, threads), engine, speculation_for(config, mode, k)))
    if plan.cluster_runs():
        from ssd.cluster.devices import default_cpu_placement
        from ssd.cluster.runtime import Cluster

        ssd = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, mode="ssd"))
        placement = default_cpu_placement(os.cpu_count() or 2, with_draft=True)
        cluster = stack.enter_context(Cluster(ssd if plan.cluster_planned else config, placement))
        if plan.cluster_planned:  # the plan ran at start where the config asks for one (runtime.plan)
            speculation = cluster.config.speculation
            off = "plan: AR on both cores" if speculation.k_for(1) == 0 else ""  # the plan's k_policy
            turns.append(Turn(RunKey("", 0.0, "ssd", speculation.k, 0, cluster=True, variant=off), cluster, speculation))
            for variant in plan.ssd_variants:
                key = RunKey("", 0.0, "ssd", speculation.k, 0, cluster=True, variant=variant)
                turns.append(Turn(key, cluster, ssd_variant(speculation, variant)))
            for k, budget in plan.ssd_grid:
                key = RunKey("", 0.0, "ssd", k, 0, cluster=True, variant=f"B={budget} fixed")
                turns.append(Turn(key, cluster, fixed_ssd(speculation, k, budget)))
        else:
            for mode, k in plan.cluster_runs():
                turns.append(Turn(RunKey("", 0.0, mode, k, 0, cluster=True), cluster, speculation_for(config, mode, k)))
    return turns


# speculating: the plan's settings, speculation on at every batch size (k_policy {}); static,
# no-anytime, no-ngram speculate too, with parts of the adaptive build off (static: both the
# anytime build and the free n-gram entries, the build as before); no-lookup: the plan's
# settings as they are, without prompt lookup on the rounds that draft nothing
SSD_VARIANTS = ("speculating", "static", "no-anytime", "no-ngram", "no-lookup")


def ssd_variant(speculation: SpeculationConfig, variant: str) -> SpeculationConfig:
    """SSD's settings speculating at every batch size, some of its adaptive parts off, or
    the settings as they are without prompt lookup (SSD_VARIANTS)."""
    if variant not in SSD_VARIANTS:
        raise ValueError(f"unknown SSD variant {variant!r}; known: {SSD_VARIANTS}")
    if variant == "no-lookup":
        return dataclasses.replace(speculation, prompt_lookup=dataclasses.replace(speculation.prompt_lookup, max_tokens=0))
    anytime = speculation.fanout.anytime and variant in ("speculating", "no-ngram")
    ngram = speculation.ngram_candidates and variant in ("speculating", "no-anytime")
    fanout = dataclasses.replace(speculation.fanout, anytime=anytime)
    return dataclasses.replace(speculation, fanout=fanout, ngram_candidates=ngram, k_policy={})


def fixed_ssd(speculation: SpeculationConfig, k: int, budget: int) -> SpeculationConfig:
    """A point of the fixed (K, budget) grid the start-up plan and the adaptive build replace:
    that K and budget every round, nothing adaptive (no anytime build, no n-gram entries, no
    adaptive K), speculating at every batch size."""
    static = ssd_variant(speculation, "static")
    return dataclasses.replace(static, k=k, adaptive_k=False, fanout=dataclasses.replace(static.fanout, budget=budget))


def _set_threads(key: RunKey) -> None:
    if key.threads and not key.cluster:
        torch.set_num_threads(key.threads)


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True)
