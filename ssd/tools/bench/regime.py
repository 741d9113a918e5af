"""The paper's regime on one device: a 32B-shaped target, drafts at the paper's cost ratio, AR / SD / SSD.

One process, no Ray, no network: random weights at named shapes
(configs/models/, drawn in the timing dtype on the device piece by piece,
ssd.models.shapes.draw_direct), or tiny shapes on a CPU (`shapes="tiny"`,
the test suite's run). In order, each phase logged and the report
rewritten after each:

1. exactness, on fp32 models cut to a few layers of the target's shapes:
   greedy AR = SD = SSD with each draft construction, each prompt alone and
   all as rows of one batch, SSD's draft on a CUDA stream of its own; SD at
   T = 1 against the target's exact law (ssd.tools.bench.sampling_check).
   Forced acceptance is never on here.
2. the timed models: the target; draft (a), a view of its first L layers
   (ssd.tools.bench.layer_view); draft (b), a separate model at a small
   model's shapes whose acceptance is forced, and its SSD cache hits by the
   real pair's rank law (ssd.tools.bench.forced).
3. costs, each role alone (ssd.saguaro.costs' probes): target step,
   verify(K), and per draft the backup chain and the cache build; packed
   at the largest batch; the device's copy rate (AR's bandwidth floor).
4. rows, most wanted first, until the deadline: AR at each batch and
   temperature; per acceptance level and draft, SD at its best K by the
   measured costs (measured), SSD in one process with the draft on its own
   stream (measured), and SSD on two devices by the speed model
   (ssd.saguaro.speed) from the measured costs and that run's hit rate and
   tokens a round (modelled: `kind` says which).

A row that the deadline leaves no room for is listed under `cut`; what ran
is written whatever happens after it.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ssd import hardware
from ssd.config import BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine.ar import AREngine
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest
from ssd.engine.sd import SDEngine
from ssd.models.shapes import RandomModelSpec, build_random_model, shape_config, weight_bytes
from ssd.saguaro.costs import (
    CostSettings, Costs, backup_probe, build_probe, chain_rows_probe, forward_probe, prefilled_rows, probe_sequence,
    round_robin, verify_rows_probe,
)
from ssd.saguaro.fanout import geometric_fanout
from ssd.saguaro.plan import Agreement, Plan, RowCosts, choose, hit_rate, tokens_per_round
from ssd.saguaro.speed import sd_speed, ssd_rows_speed, ssd_speed_from
from ssd.saguaro.startup import agreement as measure_agreement
from ssd.saguaro.speculator import Speculator
from ssd.saguaro.target import SSDEngine
from ssd.models import backend
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.tools.bench.forced import ForcedAcceptance, ForcedRanks, honoured
from ssd.tools.bench.layer_view import Calibration, DeepScale, calibrate, layer_view
from ssd.tools.bench.sampling_check import check_sampling, run_rows
from ssd.tools.bench.smoke import SMALL, IdTokenizer, environment, require_positive
from ssd.verify import verify

log = logging.getLogger(__name__)

FORMAT = "ssd-gpu-bench/1"
# Tiny shapes (CPU, the suite): the named configs with these sizes. The larger init spreads
# the logits, so greedy choices are far from ties (as the smoke run's small shapes).
TINY = {"target": {**SMALL["target"], "num_hidden_layers": 4}, "draft": SMALL["draft"]}  # the smoke run's
VIEW = "view"  # draft (a)'s name in rows
KINDS = ("measured", "modelled")
DRAFT_TIMEOUT_S = 60.0  # the longest a measured SSD round waits for the draft's reply


@dataclass
class BenchSettings:
    device: str = "cpu"
    shapes: str = "tiny"  # tiny | real
    target: str = "qwen2.5-32b"
    draft: str = "qwen2.5-0.5b"  # draft (b)'s shapes
    view_layers: int = 4  # draft (a): the target's first L layers
    acceptances: tuple[float, ...] = (0.8, 0.6, 0.9)  # most wanted first: the deadline cuts the last
    batches: tuple[int, ...] = (1, 8)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 48
    prompt_len: int = 32
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    budgets: tuple[int, ...] = (4, 8, 16)
    repeats: int = 3
    prefix: int = 128  # context tokens in the caches while timing
    dtype: str | None = None  # timed models; None: bf16 on a GPU, fp32 on a CPU
    exact_layers: int = 2  # the fp32 exactness check's cut of the target's shapes
    exact_tokens: int = 16
    sampling_samples: int = 800
    calibration_tokens: int = 16
    calibration_steps: int = 5
    rank_law: Path | None = None  # an Agreement JSON (ranks of t* among the draft's): draft (b)'s SSD hit rate
    deadline_s: float = 170.0  # from `started`; rows past it are cut, results still written
    reserve_s: float | None = None  # time kept for writing out (None: 10 s on a GPU, 0.5 s on a CPU)
    out: Path | None = None
    threads: int | None = None  # torch's intra-op threads; None: 1 on a CPU (tiny models gain nothing from
    #                             more, and on a shared host spinning threads cost 10x), torch's own on a GPU
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shapes not in ("tiny", "real"):
            raise ValueError(f"shapes must be tiny or real, got {self.shapes!r}")
        if self.device == "cuda":
            self.device = "cuda:0"
        if self.dtype is None:
            self.dtype = "bf16" if self.on_gpu else "fp32"
        if self.reserve_s is None:
            self.reserve_s = 10.0 if self.on_gpu else 0.5
        if self.threads is None and not self.on_gpu:
            self.threads = 1
        if self.shapes == "tiny":
            self.view_layers = min(self.view_layers, TINY["target"]["num_hidden_layers"] - 1)
        if len(set(self.ks)) < 2 or len(set(self.budgets)) < 2 or min(self.ks + self.budgets) < 1:
            # the plan prices points it did not time from a fit over K and B (ssd.saguaro.costs.Costs.build)
            raise ValueError(f"ks and budgets need two values >= 1 each at least, got {self.ks} and {self.budgets}")
        for a in self.acceptances:
            if not 0.0 < a < 1.0:
                raise ValueError(f"acceptances must be in (0, 1), got {a}")
        require_positive(self, ("max_new_tokens", "prompt_len", "repeats", "prefix", "exact_tokens",
                                "calibration_tokens"))

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


class Clock:
    """Seconds left before the deadline, counted from the process's start (imports included)."""

    def __init__(self, started: float, deadline_s: float, reserve_s: float) -> None:
        self.started, self.deadline_s, self.reserve_s = started, deadline_s, reserve_s

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.deadline_s - self.reserve_s - self.elapsed()


@dataclass
class Report:
    settings: dict[str, Any]
    environment: dict[str, Any]
    models: dict[str, Any] = field(default_factory=dict)
    exactness: dict[str, Any] = field(default_factory=dict)
    costs: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.errors and all(c.get("passed") for c in self.exactness.values())

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "passed": self.passed, **asdict(self)}


# --- models ------------------------------------------------------------------------------


def configs(s: BenchSettings) -> dict[str, dict[str, Any]]:
    """Target and draft (b) shapes; the draft takes the target's vocabulary (a pair shares one)."""
    target, draft = shape_config(s.target), shape_config(s.draft)
    if s.shapes == "tiny":
        target, draft = {**target, **TINY["target"]}, {**draft, **TINY["draft"]}
    return {"target": target, "draft": {**draft, "vocab_size": target["vocab_size"]}}


def describe(model: torch.nn.Module, shapes_of: str, dtype: str) -> dict[str, Any]:
    c = model.config
    return {"shapes_of": shapes_of, "weights": "random", "dtype": dtype, "layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "weight_bytes": weight_bytes(model)}


def prompts_for(s: BenchSettings, vocab: int, n: int, length: int | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(s.seed)
    return [torch.randint(vocab, (length or s.prompt_len,), generator=gen).tolist() for _ in range(n)]


def draft_stream(device: str) -> torch.cuda.Stream | None:
    """SSD's draft gets a CUDA stream of its own (none on a CPU: the roles just take turns)."""
    return torch.cuda.Stream(torch.device(device)) if device.startswith("cuda") else None


# --- generation ----------------------------------------------------------------------------


@dataclass
class Run:
    tokens: list[list[int]]
    stats: GenerationStats
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


def generate(make: Callable[[], Any], prompts: list[list[int]], new_tokens: int, temperature: float,
             speculation: SpeculationConfig | None, seed: int = 0) -> Run:
    """Every prompt as a row of one continuous batch on a fresh engine (closed after)."""
    generation = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)  # random models: fixed lengths
    requests = [GenerationRequest(p, SamplingConfig(temperature=temperature, seed=seed + i), generation, speculation)
                for i, p in enumerate(prompts)]
    engine = make()
    try:
        started = time.perf_counter()
        results = run_rows(engine, requests)
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    return Run([r.token_ids for r in results], total(r.stats for r in results), seconds)


def engine_maker(mode: str, target: torch.nn.Module, draft: torch.nn.Module | None, spec: SpeculationConfig | None,
                 rows: int, verifier: Callable = verify, device: str = "cpu",
                 speculator: Callable[..., Speculator] = Speculator) -> Callable[[], Any]:
    """A maker of fresh engines (each run gets its own: an SSD engine owns its draft thread)."""
    batching = BatchingConfig(max_rows=rows)
    if mode == "ar":
        return lambda: AREngine(target, IdTokenizer(), batching)
    if mode == "sd":
        return lambda: SDEngine(target, draft, IdTokenizer(), spec, batching, verifier)
    if mode == "ssd":
        return lambda: bounded(SSDEngine.in_process(target, draft, IdTokenizer(), spec, batching, verifier,
                                                    draft_stream=draft_stream(device), speculator=speculator))
    raise ValueError(f"unknown mode {mode!r}")


def bounded(engine: SSDEngine) -> SSDEngine:
    """A draft that stalls past DRAFT_TIMEOUT_S degrades the rows to target-only steps (counted in the
    row as degraded rounds) instead of hanging the run until the deadline's backstop kills it."""
    engine.draft_timeout_s = DRAFT_TIMEOUT_S
    return engine


def positions_tried(stats: GenerationStats) -> int:
    """Drafted positions that verification reached: every round's first, and position i wherever
    position i - 1 was accepted and drafted past."""
    return sum(stats.drafted_at[:1]) + sum(min(a, d) for a, d in zip(stats.accepted_at, stats.drafted_at[1:]))


def per_position_acceptance(stats: GenerationStats) -> float:
    """Acceptance per drafted position tried (accepted / (accepted + rejections)): the a of the
    capped geometric law, which accepted / drafted understates (drafts past a rejection count there)."""
    tried = positions_tried(stats)
    return sum(stats.accepted_at) / tried if tried else math.nan


def tokens_a_round(stats: GenerationStats) -> float:
    return 1.0 + stats.accepted / stats.rounds if stats.rounds else math.nan


# --- 1. exactness ---------------------------------------------------------------------------


def check_exactness(s: BenchSettings) -> dict[str, dict[str, Any]]:
    """fp32 greedy AR = SD = SSD on a cut of the shapes, both draft constructions, alone and as rows."""
    cfg = configs(s)
    layers = min(s.exact_layers, cfg["target"]["num_hidden_layers"])
    target = build_random_model(RandomModelSpec({**cfg["target"], "num_hidden_layers": layers}, seed=s.seed + 7),
                                s.device, direct=True)
    view = layer_view(target, max(1, layers // 2))
    DeepScale(target, view.config.num_hidden_layers).set(0.3)  # partly accepted: both branches of verify run
    separate = build_random_model(RandomModelSpec(cfg["draft"], seed=s.seed + 8), s.device, direct=True)
    prompts = prompts_for(s, cfg["target"]["vocab_size"], 2, min(s.prompt_len, 16))
    out = {}
    for name, draft in ((VIEW, view), ("separate", separate)):
        out[f"greedy: {name} draft"] = greedy_equal(target, draft, prompts, s)
    del target, view, separate
    free(s.device)
    out["sampling: SD at T = 1"] = check_sampling(s.device, s.sampling_samples)
    return out


def greedy_equal(target: torch.nn.Module, draft: torch.nn.Module, prompts: list[list[int]],
                 s: BenchSettings) -> dict[str, Any]:
    k = 4
    specs = {"sd": SpeculationConfig(mode="sd", k=k),
             "ssd": SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(budget=8))}
    runs: dict[str, Run] = {}
    for rows in (False, True):
        groups = [prompts] if rows else [[p] for p in prompts]
        for mode in ("ar", "sd", "ssd"):
            parts = [generate(engine_maker(mode, target, draft, specs.get(mode), len(g), device=s.device), g,
                              s.exact_tokens, 0.0, specs.get(mode)) for g in groups]
            runs[mode + (" rows" if rows else "")] = Run([t for r in parts for t in r.tokens],
                                                        total(r.stats for r in parts), sum(r.seconds for r in parts))
    equal = {mode: run.tokens == runs["ar"].tokens for mode, run in runs.items() if mode != "ar"}
    accepted = {mode: run.stats.accepted for mode, run in runs.items() if not mode.startswith("ar")}
    degraded = sum(runs[m].stats.spec.degraded_rounds for m in ("ssd", "ssd rows"))  # rounds SSD ran target-only
    return {"passed": all(equal.values()) and degraded == 0, "equal_to_ar": equal, "accepted": accepted,
            "ssd_degraded_rounds": degraded, "ssd_hit_rate": runs["ssd"].stats.hit_rate,
            "layers": target.config.num_hidden_layers}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# --- 3. costs -------------------------------------------------------------------------------


@dataclass
class RoleCosts:
    """One draft's costs against the target, each role timed alone."""

    costs: Costs  # one row: AR step, verify(K), backup(K), build(K, B)
    rows: RowCosts  # packed at batch sizes 1 and the largest: verify(b, n), chain(b, k)
    draft_step_s: float  # one draft forward of one token after the prefix


def target_costs(target: torch.nn.Module, s: BenchSettings) -> dict[str, Any]:
    """AR step and verify(K) at one row; packed verifications at each larger batch."""
    gen = torch.Generator().manual_seed(s.seed)
    prefix = torch.randint(backend.vocab_size(target), (s.prefix,), generator=gen).tolist()
    kv = probe_sequence(target, s.prefix + max(s.ks) + 1)
    kv.forward(prefix, last_only=True)
    probes = {("verify", k): forward_probe(kv, prefix, k + 1, gen) for k in s.ks}
    probes[("ar", 1)] = forward_probe(kv, prefix, 1, gen)
    timed = round_robin(probes, s.repeats, lambda: None)
    del probes, kv  # its graphed slot goes back now, so the packed probes' rows take the first slots
    gc.collect()  # (a sequence's slot returns when it is collected)
    tokens = [1, *(k + 1 for k in s.ks)]  # a row's tokens in a verification (1: the decode step)
    rows_verify = {(1, n): timed[("ar", 1)] if n == 1 else timed[("verify", n - 1)] for n in tokens}
    for b in sorted(set(s.batches) - {1}):
        rows_verify |= {(b, n): t for n, t in packed_verify(target, [prefix] * b, tokens, s, gen).items()}
    return {"ar_step_s": timed[("ar", 1)], "verify_s": {k: timed[("verify", k)] for k in s.ks},
            "rows_verify_s": rows_verify}


def packed_verify(target: torch.nn.Module, contexts: list[list[int]], tokens: list[int], s: BenchSettings,
                  gen: torch.Generator) -> dict[int, float]:
    """Seconds of one packed verification of n tokens a row, per n; the rows go when this returns."""
    seqs = prefilled_rows(target, contexts, room=max(s.ks) + 2)
    probes = {n: verify_rows_probe(seqs, contexts, n, backend.vocab_size(target), gen) for n in tokens}
    return round_robin(probes, s.repeats, lambda: None)


def draft_costs(draft: torch.nn.Module, s: BenchSettings) -> dict[str, Any]:
    """One draft step, the backup chain for each K and the build for each (K, B); packed chains."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    settings = CostSettings(ks=s.ks, budgets=s.budgets, prefix=s.prefix, repeats=s.repeats, seed=s.seed)
    prefix = torch.randint(backend.vocab_size(draft), (s.prefix,), generator=gen).tolist()
    kv = probe_sequence(draft, s.prefix + 2 * max(s.ks) + 1, branches=max(s.budgets))
    kv.forward(prefix, last_only=True)
    decoder = backend.branch_decoder(kv) or TreeBranchDecoder()
    probes = {("step", 1): forward_probe(kv, prefix, 1, gen)}
    probes |= {("backup", k): backup_probe(kv, prefix, k, settings) for k in s.ks}
    probes |= {("build", k, b): build_probe(kv, decoder, prefix, k, b, backend.vocab_size(draft), settings, gen)
               for k in s.ks for b in s.budgets}
    timed = round_robin(probes, s.repeats, lambda: None)
    del probes, kv, decoder  # as in target_costs
    gc.collect()
    rows_chain = {(1, k): timed[("backup", k)] for k in s.ks}
    for b in sorted(set(s.batches) - {1}):
        rows_chain |= {(b, k): t for k, t in packed_chains(draft, [prefix] * b, s).items()}
    return {"step_s": timed[("step", 1)], "backup_s": {k: timed[("backup", k)] for k in s.ks},
            "build_s": {(k, b): timed[("build", k, b)] for k in s.ks for b in s.budgets}, "rows_chain_s": rows_chain}


def packed_chains(draft: torch.nn.Module, contexts: list[list[int]], s: BenchSettings) -> dict[int, float]:
    """Seconds of one packed backup chain of k tokens a row, per K; the rows go when this returns."""
    seqs = prefilled_rows(draft, contexts, room=max(s.ks) + 2)
    return round_robin({k: chain_rows_probe(seqs, contexts, k, s.seed) for k in s.ks}, s.repeats, lambda: None)


def role_costs(target_part: dict[str, Any], draft_part: dict[str, Any]) -> RoleCosts:
    costs = Costs(target_part["ar_step_s"], target_part["verify_s"], draft_part["backup_s"], draft_part["build_s"])
    return RoleCosts(costs, RowCosts(target_part["rows_verify_s"], draft_part["rows_chain_s"]), draft_part["step_s"])


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes moved per second by a device-to-device copy (read + write): what a decode step can
    stream its weights at, for AR's bandwidth floor."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(4):
        hardware.sync(src)
        started = time.perf_counter()
        dst.copy_(src)
        hardware.sync(dst)
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * src.element_size() / min(times[1:])


def costs_json(rc: RoleCosts) -> dict[str, Any]:
    return {**rc.costs.to_json(), "rows": rc.rows.to_json(), "draft_step_s": rc.draft_step_s}


# --- 4. rows --------------------------------------------------------------------------------


@dataclass
class Draft:
    """One draft at one acceptance level: how it is made to accept, and what the rows need."""

    name: str  # "view" or the separate draft's shapes
    model: torch.nn.Module
    level: float  # the acceptance aimed at
    costs: RoleCosts
    verifier_for: Callable[[], Callable]  # a fresh verifier per run (forced: a fresh seeded law)
    forced: bool
    agreement: Agreement | None = None  # what the plan and the modelled hit rate use
    calibration: Calibration | None = None


def sd_best_k(costs: RoleCosts, a: float, rows: int, ks: Sequence[int]) -> tuple[int, float]:
    """(K, modelled tokens/s) of SD at its best K for acceptance a, from the measured costs."""
    def tps(k: int) -> float:
        if rows == 1:
            return sd_speed(tokens_per_round(a, k), k, costs.costs).tokens_per_s
        return rows * tokens_per_round(a, k) / (costs.rows.verify_s(rows, k + 1) + costs.rows.chain_s(rows, k))
    best = max(ks, key=tps)
    return best, tps(best)


def ssd_plan(d: Draft, s: BenchSettings) -> Plan:
    """The start-up plan's choice (ssd.saguaro.plan.choose) on the measured costs and the draft's agreement."""
    return choose({"full": d.costs.costs}, d.agreement, ks=s.ks, budgets=s.budgets, rows_costs=d.costs.rows,
                  sizes=tuple(sorted(set(s.batches))))


def plan_budget(plan: Plan, rows: int) -> int:
    return next((c.budget for c in plan.rows if c.rows == rows), plan.best.budget)


def modelled_ssd(costs: RoleCosts, k: int, budget: int, rows: int, p: float, e: float) -> float:
    """SSD on two devices by the speed model: the measured costs and hit rate p, tokens a round e."""
    c = costs.costs
    if rows == 1:
        return ssd_speed_from(p, e, e, c.verify(k), c.backup(k), c.build(k, budget), c.ar_step_s).tokens_per_s
    return ssd_rows_speed(p, e, rows, costs.rows.verify_s(rows, k + 1), c.build(k, rows * budget),
                          costs.rows.chain_s(rows, k), costs.rows.verify_s(rows, 1)).tokens_per_s


def ratios(costs: RoleCosts, k: int, budget: int | None) -> dict[str, float]:
    c = costs.costs
    out = {"draft_step_over_verify": costs.draft_step_s / c.verify(k), "verify_over_step": c.verify(k) / c.ar_step_s}
    if budget:
        out["build_over_verify"] = c.build(k, budget) / c.verify(k)
    return out


def row(mode: str, kind: str, draft: str | None, rows: int, temperature: float, **fields: Any) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    return {"mode": mode, "kind": kind, "draft": draft, "batch": rows, "temperature": temperature, **fields}


class Bench:
    """The timed phase's state: models, costs and the report's rows, with the deadline."""

    def __init__(self, s: BenchSettings, report: Report, clock: Clock) -> None:
        self.s, self.report, self.clock = s, report, clock
        self.prompts: list[list[int]] = []
        self.ar_tps: dict[tuple[int, float], float] = {}
        self.warm: set[tuple] = set()
        self.refs: dict[tuple[float, int], list[list[int]]] = {}  # (dial scale, rows) -> greedy AR tokens

    def room(self, name: str) -> bool:
        return room(self.report, self.clock, name)

    def timed(self, key: tuple, make: Callable[[], Any], rows: int, temperature: float,
              spec: SpeculationConfig | None) -> Run:
        """One run of `rows` prompts; the first run of a (mode, draft, rows, K) shape is run twice
        and the second timed, so CUDA graph captures and lazy inits stay out of the figure."""
        prompts = self.prompts[:rows]
        if key not in self.warm:
            generate(make, prompts, self.s.max_new_tokens, temperature, spec, self.s.seed)
            self.warm.add(key)
        return generate(make, prompts, self.s.max_new_tokens, temperature, spec, self.s.seed)

    def add(self, r: dict[str, Any]) -> None:
        """Keep a row, log it, and rewrite the files: a run killed later still has it."""
        self.report.rows.append(r)
        log.info("row: %s", line(r))
        write(self.report, self.s.out)

    def ar_rows(self, target: torch.nn.Module, floor_tps: float) -> None:
        for rows in self.s.batches:
            for t in self.s.temperatures:
                name = f"AR b={rows} T={t:g}"
                if not self.room(name):
                    continue
                run = self.timed(("ar", rows), engine_maker("ar", target, None, None, rows, device=self.s.device),
                                 rows, t, None)
                self.ar_tps[(rows, t)] = run.tokens_per_s
                extra = {"bandwidth_floor_tokens_per_s": floor_tps * rows,
                         "fraction_of_floor": run.tokens_per_s / (floor_tps * rows)}
                self.add(row("ar", "measured", None, rows, t, tokens_per_s=run.tokens_per_s, **extra))

    def reference(self, target: torch.nn.Module, rows: int, scale: float) -> list[list[int]]:
        """Greedy AR's tokens at the target's current weights, which the dial's `scale` sets."""
        if (scale, rows) not in self.refs:
            make = engine_maker("ar", target, None, None, rows, device=self.s.device)
            run = generate(make, self.prompts[:rows], self.s.max_new_tokens, 0.0, None, self.s.seed)
            self.refs[(scale, rows)] = run.tokens
        return self.refs[(scale, rows)]

    def draft_rows(self, target: torch.nn.Module, d: Draft) -> None:
        """SD measured, SSD measured (view) and SSD modelled, at each batch and temperature."""
        plan = ssd_plan(d, self.s)
        refs = {} if d.forced or 0.0 not in self.s.temperatures else {
            rows: self.reference(target, rows, d.calibration.scale) for rows in self.s.batches}
        for rows in self.s.batches:
            for t in self.s.temperatures:
                self.sd_row(target, d, rows, t, refs.get(rows) if t == 0 else None)
                self.ssd_rows(target, d, plan, rows, t, refs.get(rows) if t == 0 else None)

    def sd_row(self, target: torch.nn.Module, d: Draft, rows: int, t: float, ref: list[list[int]] | None) -> None:
        name = f"SD {d.name}@{d.level:g} b={rows} T={t:g}"
        if not self.room(name):
            return
        k, _ = sd_best_k(d.costs, d.agreement.a, rows, self.s.ks)
        spec = SpeculationConfig(mode="sd", k=k)
        make = engine_maker("sd", target, d.model, spec, rows, d.verifier_for(), self.s.device)
        run = self.timed(("sd", d.name, rows, k), make, rows, t, spec)
        measured = per_position_acceptance(run.stats)
        forcing = {"forcing_honoured": honoured(measured, d.level, positions_tried(run.stats))} if d.forced else {}
        self.add(row("sd", "measured", d.name, rows, t, level=d.level, forced=d.forced, k=k, **forcing,
                     tokens_per_s=run.tokens_per_s, speedup_vs_ar=self.vs_ar(run.tokens_per_s, rows, t),
                     acceptance=measured, acceptance_accepted_over_drafted=run.stats.acceptance_rate,
                     tokens_per_round=tokens_a_round(run.stats), equal_to_ar=equal(run.tokens, ref),
                     **ratios(d.costs, k, None)))

    def ssd_rows(self, target: torch.nn.Module, d: Draft, plan: Plan, rows: int, t: float,
                 ref: list[list[int]] | None) -> None:
        """SSD measured on this device, then modelled on two from its hit rate and tokens a round (or,
        where the measured run was cut, from the rank law at the plan's schedule for a forced draft)."""
        k, budget = plan.best.k, plan_budget(plan, rows)
        name = f"SSD {d.name}@{d.level:g} b={rows} T={t:g}"
        common = dict(level=d.level, forced=d.forced, k=k, budget=budget, **ratios(d.costs, k, budget))
        law = d.agreement if d.forced and d.agreement.ranks_bonus and d.agreement.ranks_rejected else None
        p = e = source = None
        if (law is not None or not d.forced) and self.room(name + " (measured, one device)"):
            spec = SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(budget=budget))
            speculator = functools.partial(ForcedRanks, law=law, seed=self.s.seed) if law else Speculator
            make = engine_maker("ssd", target, d.model, spec, rows, d.verifier_for(), self.s.device, speculator)
            run = self.timed(("ssd", d.name, rows, k, budget), make, rows, t, spec)
            p, e, source = run.stats.hit_rate, tokens_a_round(run.stats), "this run's SSD"
            self.add(row("ssd", "measured", d.name, rows, t, **common, where="one device, draft on its own stream",
                         tokens_per_s=run.tokens_per_s, speedup_vs_ar=self.vs_ar(run.tokens_per_s, rows, t),
                         acceptance=per_position_acceptance(run.stats), hit_rate=p, tokens_per_round=e,
                         equal_to_ar=equal(run.tokens, ref), round_ms=where_time_goes(run),
                         degraded_rounds=run.stats.spec.degraded_rounds,
                         hits_forced_by="the rank law" if law else None))
        if p is None and law is not None:
            p = hit_rate(law, geometric_fanout(law.a, 1.0, k, budget))
            e, source = tokens_per_round(law.a, k), "the rank law at the plan's schedule"
        if p is None:
            reason = "no rank law for a forced draft (--rank-law)" if d.forced else "its measured run was cut"
            self.report.cut.append(f"{name} (modelled): {reason}")
            return
        tps = modelled_ssd(d.costs, k, budget, rows, p, e)
        self.add(row("ssd", "modelled", d.name, rows, t, **common, where="two devices, speed model",
                     tokens_per_s=tps, speedup_vs_ar=self.vs_ar(tps, rows, t), hit_rate=p, tokens_per_round=e,
                     hit_rate_from=source))

    def vs_ar(self, tps: float, rows: int, t: float) -> float | None:
        ar = self.ar_tps.get((rows, t))
        return tps / ar if ar else None


def where_time_goes(run: Run) -> dict[str, float]:
    """A measured SSD round's milliseconds (per row-round, summed over rows): the whole round, the
    target waiting for the draft's reply, its verification, and the draft's backup and build, which
    overlap the verification only as far as the two streams really run at once."""
    n = max(run.stats.rounds, 1)
    spec = run.stats.spec
    return {"round": 1e3 * run.seconds * len(run.tokens) / n, "wait": 1e3 * spec.wait_s / n,
            "verify": 1e3 * spec.verify_s / n, "backup": 1e3 * spec.backup_s / n, "build": 1e3 * spec.build_s / n}


def equal(tokens: list[list[int]], ref: list[list[int]] | None) -> bool | None:
    return None if ref is None else tokens == ref


# --- the run -----------------------------------------------------------------------------


def phase(report: Report, name: str, fn: Callable[[], Any], out: Path | None) -> Any:
    """Run one phase; an exception is recorded (and logged), not raised, so the report is still written."""
    log.info("== %s", name)
    started = time.perf_counter()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        log.exception("%s failed", name)
        report.errors[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        return None
    finally:
        report.phases_s[name] = time.perf_counter() - started
        log.info("%s took %.1f s", name, report.phases_s[name])
        write(report, out)


def run_bench(s: BenchSettings, started: float | None = None) -> Report:
    """Every phase (see the module docstring); writes bench.json and table.txt under `s.out`."""
    clock = Clock(time.monotonic() if started is None else started, s.deadline_s, s.reserve_s)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    report = Report(settings, environment(s.device))
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads or threads)
    try:
        # No inference_mode around it all: the forwards enter it themselves, and models or caches made
        # under it would be inference tensors that the speculator's thread (outside it) may not update.
        if room(report, clock, "exactness"):
            checks = phase(report, "exactness (fp32, a cut of the shapes)", lambda: check_exactness(s), s.out)
            report.exactness = checks or {}
            free(s.device)
        if room(report, clock, "timed models, costs and every row"):
            phase(report, "timed models and rows", lambda: timed_phase(s, report, clock), s.out)
    finally:
        torch.set_num_threads(threads)
    report.elapsed_s = clock.elapsed()
    write(report, s.out)
    return report


def room(report: Report, clock: Clock, name: str) -> bool:
    """Whether the deadline leaves room to start `name`; if not it is listed as cut."""
    if clock.left() > 0:
        return True
    report.cut.append(name)
    log.warning("deadline: cut %s (%.0f s elapsed)", name, clock.elapsed())
    return False


def timed_phase(s: BenchSettings, report: Report, clock: Clock) -> None:
    cfg = configs(s)
    target = build_random_model(RandomModelSpec(cfg["target"], seed=s.seed, dtype=s.dtype), s.device, direct=True)
    separate = build_random_model(RandomModelSpec(cfg["draft"], seed=s.seed + 1, dtype=s.dtype), s.device, direct=True)
    view = layer_view(target, s.view_layers)
    report.models = {"target": describe(target, s.target, s.dtype), "separate": describe(separate, s.draft, s.dtype),
                     VIEW: {"layers": s.view_layers, "of": s.target, "extra_weight_bytes": 0}}
    log.info("models: target %.2f GB, draft %.2f GB (%s), view of %d layers", weight_bytes(target) / 1e9,
             weight_bytes(separate) / 1e9, s.dtype, s.view_layers)
    bench = Bench(s, report, clock)
    bench.prompts = prompts_for(s, cfg["target"]["vocab_size"], max(s.batches))
    if not bench.room("costs and every row"):
        return
    tpart = target_costs(target, s)
    role = {VIEW: role_costs(tpart, draft_costs(view, s)), "separate": role_costs(tpart, draft_costs(separate, s))}
    floor_tps = copy_rate(s.device, min(weight_bytes(target), 1 << 30 if s.on_gpu else 1 << 24)) / weight_bytes(target)
    report.costs = {"floor_tokens_per_s": floor_tps, **{name: costs_json(rc) for name, rc in role.items()}}
    log.info("costs: step %.2f ms, verify(4) %.2f ms; view step %.2f ms, draft step %.2f ms; floor %.1f tok/s",
             tpart["ar_step_s"] * 1e3, role[VIEW].costs.verify(4) * 1e3, role[VIEW].draft_step_s * 1e3,
             role["separate"].draft_step_s * 1e3, floor_tps)
    write(report, s.out)
    bench.ar_rows(target, floor_tps)
    dial = DeepScale(target, s.view_layers)
    law = load_rank_law(s.rank_law)
    for level in s.acceptances:
        if bench.room(f"view@{level:g} (calibration)"):
            d = view_draft(bench, target, view, dial, level, role[VIEW])
            bench.draft_rows(target, d)
        forced = Draft(s.draft, separate, level, role["separate"],
                       lambda level=level: ForcedAcceptance(level, s.seed), True,
                       Agreement(level, law.ranks_rejected, law.ranks_bonus, law.positions) if law else
                       Agreement(level, [], [], 0))
        bench.draft_rows(target, forced)
        write(report, s.out)


def view_draft(bench: Bench, target: torch.nn.Module, view: torch.nn.Module, dial: DeepScale, level: float,
               costs: RoleCosts) -> Draft:
    """Draft (a) calibrated to `level`: the dial set by short greedy SD runs, then its agreement measured."""
    s = bench.s
    rows = max(s.batches)
    spec = SpeculationConfig(mode="sd", k=4)
    make = engine_maker("sd", target, view, spec, rows, device=s.device)

    def measure() -> float:
        run = generate(make, bench.prompts[:rows], s.calibration_tokens, 0.0, spec, s.seed)
        return per_position_acceptance(run.stats)

    known = [t for c in bench.report.calibration.values() for t in c["tried"]]
    cal = calibrate(dial, measure, level, steps=s.calibration_steps, known=known)
    bench.report.calibration[f"{level:g}"] = asdict(cal)
    refs = bench.reference(target, rows, cal.scale)
    agreement = measure_agreement(view, [p + r for p, r in zip(bench.prompts, refs)], [len(p) for p in bench.prompts])
    log.info("view@%g: scale %.4g, acceptance %.3f (ranks over %d positions: a %.3f)", level, cal.scale,
             cal.acceptance, agreement.positions, agreement.a)
    return Draft(VIEW, view, level, costs, lambda: verify, False, agreement, cal)


def load_rank_law(path: Path | None) -> Agreement | None:
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    return Agreement.from_json(data.get("agreement", data))


# --- output --------------------------------------------------------------------------------


COLUMNS = ("mode", "kind", "draft", "batch", "temperature", "k", "budget", "tokens_per_s", "speedup_vs_ar",
           "acceptance", "hit_rate", "tokens_per_round", "draft_step_over_verify", "verify_over_step",
           "build_over_verify", "fraction_of_floor", "equal_to_ar")
HEADS = ("mode", "kind", "draft", "b", "T", "K", "B", "tok/s", "xAR", "acc", "hit", "tok/rnd", "dstep/ver",
         "ver/step", "build/ver", "AR/floor", "=AR")


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def line(r: dict[str, Any]) -> str:
    level = f"@{r['level']:g}" if "level" in r else ""
    cells = " ".join(f"{h}={cell(r.get(c))}" for h, c in zip(HEADS, COLUMNS) if c != "draft")
    return f"{cells} draft={r['draft']}{level}"


def table(report: Report) -> str:
    body = [[cell(r.get(c)) + (f"@{r['level']:g}" if c == "draft" and "level" in r else "") for c in COLUMNS]
            for r in report.rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEADS)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    env = report.environment
    where = env.get("gpu") or env["machine"]["cpu_model"]
    lines = [f"gpu bench ({report.settings['shapes']} shapes, {report.settings['dtype']}) on {where}, "
             f"{report.elapsed_s:.0f} s; kind: measured = timed here, modelled = speed model on two devices",
             fmt(HEADS), *map(fmt, body)]
    lines += bar_lines(report)
    for name, c in report.exactness.items():
        lines.append(f"exactness {name}: {'ok' if c.get('passed') else 'FAILED'}"
                     + (f" (p = {c['pvalue']:.2g})" if "pvalue" in c else f" {c.get('equal_to_ar')}"))
    lines += [f"cut: {c}" for c in report.cut] + [f"error: {n}: {e.splitlines()[0]}" for n, e in report.errors.items()]
    return "\n".join(lines)


def find(report: Report, **want: Any) -> dict[str, Any] | None:
    return next((r for r in report.rows if all(r.get(k) == v for k, v in want.items())), None)


def bar_lines(report: Report, level: float = 0.8) -> list[str]:
    """Issue 55's bar at batch 1, T = 0, acceptance `level`, from whichever rows ran (the view draft's SD
    and SSD, the forced draft's where the view's are missing); each figure says measured or modelled."""
    ar = find(report, mode="ar", batch=1, temperature=0.0)
    if ar is None:
        return []
    out = [f"bar: AR {ar['tokens_per_s']:.1f} tok/s (measured) = {ar['fraction_of_floor']:.2f} of its bandwidth "
           f"floor {ar['bandwidth_floor_tokens_per_s']:.1f} (want >= 0.85)"]
    for draft in (VIEW, report.settings.get("draft")):
        sd = find(report, mode="sd", draft=draft, level=level, batch=1, temperature=0.0)
        if sd is None:
            continue
        out.append(f"bar: SD {draft}@{level:g} K={sd['k']} {sd['tokens_per_s']:.1f} tok/s (measured) = "
                   f"{sd['tokens_per_s'] / ar['tokens_per_s']:.2f}x AR (want >= 2.0)")
        for kind in KINDS:
            ssd = find(report, mode="ssd", kind=kind, draft=draft, level=level, batch=1, temperature=0.0)
            if ssd is not None:
                out.append(f"bar: SSD {draft}@{level:g} {ssd['tokens_per_s']:.1f} tok/s ({kind}, {ssd['where']}) = "
                           f"{ssd['tokens_per_s'] / sd['tokens_per_s']:.2f}x SD"
                           + (" (want >= 1.5)" if kind == "modelled" else "")
                           + (f"; round ms {fmt_ms(ssd['round_ms'])}" if "round_ms" in ssd else ""))
    return out


def fmt_ms(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in parts.items())


def write(report: Report, out: Path | None) -> None:
    """bench.json and table.txt (rewritten after every phase: a cut run leaves what it found)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
    (out / "table.txt").write_text(table(report) + "\n")
