"""What one SSD round costs on this machine: measured once, priced many times.

Measured on the loaded pair, one role at a time (each with `threads` intra-op
threads, one by default, as each role gets its own core in SSD), alone or,
with `ablate.py costs --under-load`, while the other role keeps decoding on
the other core (ssd.tools.ablation.neighbour), as it does in SSD:
- ar_step: one target forward of 1 token after a `prefix`-token context;
- verify(K): one target forward of K + 1 tokens after the prefix;
- backup(K): the draft's chain of K tokens after a miss (its cache lacks only
  t*, so: one 1-token forward, then K - 1 steps; ssd.engine.drafting.draft_chain);
- build(K, B): the real ssd.saguaro.builder.build_cache with the configured
  branch decoder, B branches (uniform split) after a hit (glue of K + 1 tokens).
Each is the median of `repeats` timed runs after one warm-up. The models are
of either backend (ssd.models.backend: torch or llama.cpp); each probe's
sequences are sized for it (`probe_sequence`, `prefilled_rows`). The context is
random token ids: attention cost depends on length, not content. The roles
run one after the other here; in SSD they overlap on two cores and slow each
other unevenly: on the 2-core CPU the bandwidth-bound bf16 verification took
~1.1-1.3x longer beside a busy draft (launch/contention.py; 562 ms live
against 433 ms here), while the int8 build did not slow measurably. Planner
picks that differ by less than that margin need a live check.

Queries at unmeasured points: exact where measured; elsewhere a least-squares
fit, linear in K for verify and backup (a + b K) and bilinear for the build
(a + b K + c B + d K B: a glue pass growing with K plus K branch steps growing
with B). Fitted values are floored at half the smallest measurement of that
kind (a line can dip below zero far outside the measured range).
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from ssd import hardware
from ssd.config import GLUES, SamplingConfig
from ssd.saguaro.fanout import uniform_fanout
from ssd.models import backend
from ssd.models.backend import AnySequence, Model
from ssd.sampling import make_generator
from ssd.saguaro.branches import BatchedBranchDecoder, BranchDecoder, TreeBranchDecoder
from ssd.saguaro.builder import build_cache
from ssd.saguaro.cache import DraftWork
from ssd.engine.drafting import Chain, draft_chains, drafted_chain

log = logging.getLogger(__name__)

FORMAT = "ssd-ablation-costs/1"
DEFAULT_KS = tuple(range(1, 9))
DEFAULT_BUDGETS = (4, 8, 12, 16, 24, 32)


@dataclass
class Costs:
    """Measured seconds, with interpolation for the points not measured."""

    ar_step_s: float
    verify_s: dict[int, float]  # K -> seconds
    backup_s: dict[int, float]
    build_s: dict[tuple[int, int], float]  # (K, B) -> seconds
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.ar_step_s > 0 and self.verify_s and self.backup_s and self.build_s):
            raise ValueError("costs need ar_step_s > 0 and at least one verify, backup and build point")

    def verify(self, k: int) -> float:
        return _linear_in_k(self.verify_s, k, "verify")

    def backup(self, k: int) -> float:
        return _linear_in_k(self.backup_s, k, "backup")

    def build(self, k: int, budget: int) -> float:
        if (k, budget) in self.build_s:
            return self.build_s[(k, budget)]
        pts = list(self.build_s)
        if len({p[0] for p in pts}) < 2 or len({p[1] for p in pts}) < 2:
            raise ValueError(
                f"build cost at K={k}, B={budget} was not measured, and extrapolating needs at least "
                f"two measured K and two measured B (have {sorted(pts)})"
            )
        feats = lambda kk, bb: [1.0, kk, bb, kk * bb]  # noqa: E731
        coef = np.linalg.lstsq(np.array([feats(*p) for p in pts]), np.array(list(self.build_s.values())), rcond=None)[0]
        return max(float(np.dot(coef, feats(k, budget))), min(self.build_s.values()) / 2)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "meta": self.meta, "ar_step_s": self.ar_step_s,
            "verify_s": {str(k): v for k, v in sorted(self.verify_s.items())},
            "backup_s": {str(k): v for k, v in sorted(self.backup_s.items())},
            "build_s": [{"k": k, "budget": b, "seconds": s} for (k, b), s in sorted(self.build_s.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Costs":
        if data.get("format") != FORMAT:
            raise ValueError(f"not an ssd ablation costs file (format {data.get('format')!r}, expected {FORMAT!r})")
        return cls(
            ar_step_s=float(data["ar_step_s"]),
            verify_s={int(k): float(v) for k, v in data["verify_s"].items()},
            backup_s={int(k): float(v) for k, v in data["backup_s"].items()},
            build_s={(int(e["k"]), int(e["budget"])): float(e["seconds"]) for e in data["build_s"]},
            meta=data.get("meta", {}),
        )


def _linear_in_k(points: dict[int, float], k: int, what: str) -> float:
    if k in points:
        return points[k]
    if len(points) < 2:
        raise ValueError(
            f"{what} cost at K={k} was not measured, and extrapolating needs two measured K (have {sorted(points)})"
        )
    slope, intercept = np.polyfit(np.array(list(points), float), np.array(list(points.values())), 1)
    return max(float(intercept + slope * k), min(points.values()) / 2)


def save_costs(costs: Costs, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.to_json(), indent=2))
    return path


def load_costs(path: str | Path) -> Costs:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"costs file not found: {path}")
    return Costs.from_json(json.loads(path.read_text()))


# ---------------------------------------------------------------------------
# Measuring


@dataclass
class CostSettings:
    ks: tuple[int, ...] = DEFAULT_KS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    prefix: int = 200  # context tokens already in the KV caches
    repeats: int = 3
    threads: int = 1
    branch_decoder: str = "tree"
    glue: str = "full"  # how each build starts (ssd.config.GLUES)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be a non-empty list of K >= 1, got {self.ks}")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be a non-empty list of B >= 1, got {self.budgets}")
        for name in ("prefix", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.glue not in GLUES:
            raise ValueError(f"glue must be one of {GLUES}, got {self.glue!r}")
        if self.branch_decoder not in ("tree", "batched"):
            raise ValueError(f"branch_decoder must be tree or batched, got {self.branch_decoder!r}")

    @property
    def measurements(self) -> int:
        """How many timed quantities `measure_costs` produces (for progress bars)."""
        return 1 + 2 * len(self.ks) + len(self.ks) * len(self.budgets)


def measure_costs(
    target: Model, draft: Model, settings: CostSettings,
    progress: Callable[[], None] | None = None,
    beside_draft: Callable[[], ContextManager] = contextlib.nullcontext,
    beside_target: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Costs:
    """Time AR, verify, backup and build on the pair; `progress` is called after each quantity.

    The target's costs are measured inside `beside_draft()` and the draft's
    inside `beside_target()`: contexts in which the other role keeps busy
    (ssd.tools.ablation.neighbour), as in SSD. The defaults measure each role alone.
    """
    tick = progress or (lambda: None)
    vocab = min(backend.vocab_size(target), backend.vocab_size(draft))
    gen = torch.Generator().manual_seed(settings.seed)
    prefix = torch.randint(vocab, (settings.prefix,), generator=gen).tolist()
    longest = max(settings.ks)  # a build holds the prefix, K drafted tokens and K branch tokens
    tkv = probe_sequence(target, settings.prefix + longest + 1)
    dkv = probe_sequence(draft, settings.prefix + 2 * longest + 1, branches=max(settings.budgets))
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        tkv.forward(prefix, last_only=True)
        dkv.forward(prefix, last_only=True)
        target_probes = {("verify", k): forward_probe(tkv, prefix, k + 1, gen) for k in settings.ks}
        target_probes[("ar", 1)] = forward_probe(tkv, prefix, 1, gen)
        decoder = backend.branch_decoder(dkv) or _decoder(settings.branch_decoder)
        draft_probes = {("backup", k): backup_probe(dkv, prefix, k, settings) for k in settings.ks}
        for k in settings.ks:
            for b in settings.budgets:
                draft_probes[("build", k, b)] = build_probe(dkv, decoder, prefix, k, b, vocab, settings, gen)
        with beside_draft():
            timed = round_robin(target_probes, settings.repeats, tick)
        with beside_target():
            timed |= round_robin(draft_probes, settings.repeats, tick)
    finally:
        torch.set_num_threads(threads)
        backend.release(tkv)
        backend.release(dkv)
    ar = timed[("ar", 1)]
    verify = {k: timed[("verify", k)] for k in settings.ks}
    backup = {k: timed[("backup", k)] for k in settings.ks}
    build = {(k, b): timed[("build", k, b)] for k in settings.ks for b in settings.budgets}
    meta = {
        "prefix": settings.prefix, "repeats": settings.repeats, "threads": settings.threads,
        "under_load": beside_draft is not contextlib.nullcontext, "machine": hardware.describe(),
        "branch_decoder": settings.branch_decoder, "glue": settings.glue, "temperature": settings.sampling.temperature,
    }
    return Costs(ar, verify, backup, build, meta)


# A probe: (run, reset); reset puts the caches back where `run` expects them.
Probe = tuple[Callable[[], Any], Callable[[], Any]]


def round_robin(
    probes: dict[Any, Probe], repeats: int, tick: Callable[[], None], progress: str | None = None,
    warm_up: bool = True, pick: Callable[[list[float]], float] = statistics.median,
) -> dict[Any, float]:
    """The median (or `pick`) seconds of each probe over `repeats` passes, after one warm-up
    pass unless `warm_up` is False (where the caches' prefill already ran every weight once).

    Each pass times every probe once, so a machine that speeds up or slows
    down over minutes (a shared host does) shifts all of them alike instead of
    whichever happened to be measured then: the ratios the planner uses hold.
    progress: a name to log a line under after every pass (start-up waits on these).
    """
    times: dict[Any, list[float]] = {key: [] for key in probes}
    started_all = time.perf_counter()
    first = 0 if warm_up else 1
    for rep in range(first, repeats + 1):
        for key, (run, reset) in probes.items():
            reset()
            started = time.perf_counter()
            run()
            if rep:
                times[key].append(time.perf_counter() - started)
            if rep == repeats:
                tick()
        if progress is not None:
            log.info("%s: pass %d of %d over %d probes done (%.0f s)", progress, rep + 1 - first, repeats + 1 - first,
                     len(probes), time.perf_counter() - started_all)
    for _, reset in probes.values():
        reset()
    return {key: pick(values) for key, values in times.items()}


def probe_sequence(model: Model, tokens: int, branches: int = 0) -> AnySequence:
    """An empty sequence of `model` for the probes: it holds up to `tokens` tokens, takes
    up to that many in one forward, and has `branches` branch slots beside it
    (ssd.models.backend.branch_decoder). torch: a KVSequence, whatever the sizes.
    llama.cpp: a context sized so, rather than the model's whole context per slot."""
    source = backend.sequence_source(model, 1 + branches, max(tokens, branches), tokens)
    return backend.new_sequence(source)


def forward_probe(kv: AnySequence, prefix: list[int], n: int, gen: torch.Generator) -> Probe:
    ids = torch.randint(backend.vocab_size(backend.model_of(kv)), (n,), generator=gen).tolist()
    return lambda: hardware.sync(kv.forward(ids)), lambda: kv.rollback(len(prefix))


def backup_probe(kv: AnySequence, prefix: list[int], k: int, s: CostSettings) -> Probe:
    """draft_chain after a miss: the cache lacks only t* (the last prefix token)."""
    gen = make_generator(s.seed)
    return lambda: drafted_chain(kv, prefix, k, s.sampling, gen), lambda: kv.rollback(len(prefix) - 1)


def build_probe(kv: AnySequence, decoder: BranchDecoder, prefix: list[int], k: int, budget: int,
                vocab: int, s: CostSettings, gen: torch.Generator) -> Probe:
    """build_cache after a round, with the settings' glue: "full" feeds t* and
    K drafted tokens; "reuse" and "fold" start where a backup chain left the
    cache (prefix + drafted[:-1], its logits kept: ssd.saguaro.cache.DraftWork)."""
    drafted = torch.randint(vocab, (k,), generator=gen).tolist()
    fanout = uniform_fanout(k, budget, caps=[vocab - 1] * k + [vocab])
    sample_gen = make_generator(s.seed)
    model = backend.model_of(kv)
    device = backend.device_of(model)
    work_logits = torch.randn(k, backend.vocab_size(model), generator=gen).to(device)  # ranking only

    def run() -> None:
        work = None if s.glue == "full" else DraftWork(list(work_logits))
        build_cache(kv, decoder, prefix, drafted, fanout, s.sampling, sample_gen, work=work, depth=k, glue=s.glue)
        hardware.sync(device)

    def reset() -> None:
        if s.glue == "full":
            kv.rollback(min(kv.length, len(prefix) - 1))
            return
        sequence = prefix + drafted
        kv.trim_to_prefix_of(sequence)
        if kv.length < len(sequence) - 1:
            kv.forward(sequence[kv.length : -1])

    return run, reset


def _decoder(name: str) -> BranchDecoder:
    return TreeBranchDecoder() if name == "tree" else BatchedBranchDecoder()


# --- batched probes: b rows at once (the plan by batch size) ---------------------------------

def prefilled_rows(model: Model, contexts: list[list[int]], room: int = 16) -> list[AnySequence]:
    """A sequence per context holding it, the rows' sequences of one source (a llama.cpp
    context: their forwards pack into one); each may then take `room` tokens more.
    llama.cpp sequences go back with ssd.models.backend.release."""
    longest = max(map(len, contexts)) + room
    source = backend.sequence_source(model, len(contexts), max(sum(map(len, contexts)), room * len(contexts)), longest)
    rows = [backend.new_sequence(source) for _ in contexts]
    backend.forward_rows(rows, contexts, last_only=True)
    return rows


def verify_rows_probe(rows: list[AnySequence], contexts: list[list[int]], n: int, vocab: int, gen: torch.Generator):
    ids = [torch.randint(vocab, (n,), generator=gen).tolist() for _ in rows]

    def run() -> None:
        hardware.sync(backend.forward_rows(rows, ids, last_only=False)[0])

    def reset() -> None:
        for row, context in zip(rows, contexts):
            row.rollback(len(context))

    return run, reset


def chain_rows_probe(rows: list[AnySequence], contexts: list[list[int]], k: int, seed: int):
    sampling = SamplingConfig(temperature=1.0)
    gens = [make_generator(seed + i) for i in range(len(rows))]
    device = backend.device_of(backend.model_of(rows[0]))

    def run() -> None:
        draft_chains([Chain(row, context, k, sampling, g) for row, context, g in zip(rows, contexts, gens)])
        hardware.sync(device)

    def reset() -> None:  # after a round the draft lacks only the last token
        for row, context in zip(rows, contexts):
            row.rollback(len(context) - 1)

    return run, reset
