"""The GPU smoke run: is every decoding path exact on this device, and what does a round cost here?

One process and one device, no Ray, no hub: random weights at the real
pair's shapes (configs/models/, ssd.models.shapes), or a scaled-down copy of
them (`shapes="small"`, for CPU and CI). What it does, in order:

1. generation: fp32 greedy AR, SD and SSD give the same tokens, with SSD's
   draft side (ssd.saguaro.speculator) in a second process over the host
   link (ssd.tools.bench.draft_process); each prompt alone, and all of them
   as rows of one continuous batch (packed forwards, as serving runs them),
   each against AR alone. Twice: on the real pair (unrelated random
   weights: drafts are almost always rejected) and on a pair whose draft is
   a noisy copy of its target (drafts are accepted, so acceptance and cache
   hits are exercised too).
2. branches: tree-masked branch decoding agrees with sequential decoding
   under each SDPA backend this device runs (ssd.tools.bench.branch_check);
   graphs: CUDA graph replays compute the lean forward's logits, on this
   device and on another index when there is one, and the batched rows'
   graphs (2 and batching.max_rows sequences) the lean packed forward's
   (ssd.tools.bench.graph_check);
   sampling: at T = 1, SD's batched rows sample the target's exact law on a
   4-token vocabulary (chi-square; ssd.tools.bench.sampling_check).
3. link: round trips of the protocol's messages over the host link.
4. timings: the planner's costs (ssd.saguaro.costs.measure_costs: target
   step, verify(K) for K + 1 tokens, backup, build) plus one draft tree step
   per budget, written as an "ssd-ablation-costs/1" file that
   `launch/ablate.py plan --trace T --costs F` reads; given a trace, the plan
   itself.
Every phase records its result or its error, so one failure does not hide
the rest; the report says which phases passed.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.tools.ablation import planner
from ssd.saguaro.costs import DEFAULT_BUDGETS, DEFAULT_KS, Costs, CostSettings, measure_costs, save_costs
from ssd.tools.bench.branch_check import branch_case, check_branches
from ssd.tools.bench.graph_check import batch_sizes, check_graphs
from ssd.tools.bench.sampling_check import SAMPLES, check_sampling, run_rows
from ssd.tools.bench.hot_path import time_batches, time_hot_path
from ssd.tools.bench.draft_process import DraftProcess, exact_fp32
from ssd.tools.bench.link import summarize_ms
from ssd.config import BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import Engine
from ssd.factory import LoadedPair, make_engine
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest
from ssd.saguaro.target import SSDEngine
from ssd.models.fast import fast_supported
from ssd.models.kv import KVSequence
from ssd.models.offline import DRAFT_NAME, TARGET_NAME
from ssd.models.shapes import RandomModelSpec, build_random_model, fingerprint, rope_theta, shape_config
from ssd.saguaro import protocol
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.cache import Proposal
from ssd.sampling import as_drawn

log = logging.getLogger(__name__)

FORMAT = "ssd-gpu-smoke/1"
# `shapes="small"`: the real configs with these sizes, so everything but the
# sizes (tied embeddings, rope base, norms, GQA) stays as in the real pair.
# The larger init spreads the logits of a small model, so greedy choices are
# far from ties and a noisy draft still agrees with its target.
_SMALL_COMMON = {"vocab_size": 512, "max_position_embeddings": 1024, "initializer_range": 0.2,
                 "bos_token_id": None, "eos_token_id": None}
SMALL = {
    "target": {**_SMALL_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2},
    "draft": {**_SMALL_COMMON, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
}
NAMES = {"target": TARGET_NAME, "draft": DRAFT_NAME}
# Past ROW_LIMIT (65), so the branch check's prefill takes the causal-mask SDPA call, as long prompts do.
BRANCH_CONTEXT = 96


@dataclass
class SmokeSettings:
    device: str = "cpu"
    shapes: str = "small"  # real | small
    out: Path | None = None  # where costs.json, smoke.json and summary.txt go
    max_new_tokens: int = 32
    prompts: int = 2
    prompt_len: int = 16
    k: int = 4  # SD and SSD's drafted tokens per round
    budget: int = 8  # SSD's branches per round
    noise: float = 0.03  # the noisy pair's relative weight noise
    ks: tuple[int, ...] = DEFAULT_KS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    repeats: int = 3
    prefix: int = 200  # context tokens in the KV caches while timing
    timing_dtype: str | None = None  # None: bf16 on a GPU (what the pair runs in there), fp32 on a CPU
    branch_dtypes: tuple[str, ...] | None = None  # None: fp32, and bf16 too on a GPU
    link_rounds: int = 100
    sampling_samples: int = SAMPLES  # seeded requests in the T > 0 distribution check
    trace: Path | None = None  # a recorded trace of the real pair: plan from it with the measured costs
    threads: int | None = None  # torch threads per process (None: 1 on a CPU, torch's default on a GPU)
    timeout_s: float = 180.0  # bound on every wait for the second process
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device == "cuda":  # an explicit index: the second process must pick the same device
            self.device = "cuda:0"
        if self.shapes not in ("real", "small"):
            raise ValueError(f"shapes must be real or small, got {self.shapes!r}")
        if self.timing_dtype is None:
            self.timing_dtype = "bf16" if self.on_gpu else "fp32"
        if self.branch_dtypes is None:
            self.branch_dtypes = ("fp32", "bf16") if self.on_gpu else ("fp32",)
        if self.threads is None and not self.on_gpu:
            self.threads = 1
        require_positive(self, ("max_new_tokens", "prompts", "prompt_len", "k", "budget", "repeats", "prefix",
                                "link_rounds", "sampling_samples"))

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def require_positive(settings: Any, names: tuple[str, ...]) -> None:
    """A ValueError naming the first of `settings`' fields `names` under 1 (the GPU runs' counts)."""
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(settings, name)}")


class IdTokenizer:
    """Random weights come without a tokenizer; the engines only decode (the result's text) and read the EOS id."""

    eos_token_id = None

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


# --- models --------------------------------------------------------------------


def model_specs(s: SmokeSettings) -> dict[str, tuple[RandomModelSpec, RandomModelSpec]]:
    """(target, draft) per check: the real pair, and a draft-shaped target with a noisy copy as its draft."""
    configs = {role: shape_config(name) for role, name in NAMES.items()}
    if s.shapes == "small":
        configs = {role: {**cfg, **SMALL[role]} for role, cfg in configs.items()}
    target = RandomModelSpec(configs["target"], seed=s.seed)
    draft = RandomModelSpec(configs["draft"], seed=s.seed + 1)
    close_target = RandomModelSpec(configs["draft"], seed=s.seed + 2)
    close_draft = RandomModelSpec(configs["draft"], seed=s.seed + 2, noise=s.noise, noise_seed=s.seed + 3)
    return {"real pair": (target, draft), "noisy pair": (close_target, close_draft)}


def describe(spec: RandomModelSpec, model: torch.nn.Module, name: str) -> dict[str, Any]:
    c = model.config
    return {
        "shapes_of": name, "weights": "random", "seed": spec.seed, "noise": spec.noise, "dtype": spec.dtype,
        "params": sum(p.numel() for p in model.parameters()), "hidden_size": c.hidden_size,
        "layers": c.num_hidden_layers, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size, "rope_theta": rope_theta(model), "tie_word_embeddings": c.tie_word_embeddings,
    }


# --- 1. generation ----------------------------------------------------------------


@dataclass
class Run:
    tokens: list[list[int]]
    stats: GenerationStats
    seconds: float


def prompts_for(s: SmokeSettings, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(s.seed)
    return [torch.randint(vocab, (s.prompt_len,), generator=gen).tolist() for _ in range(s.prompts)]


def generate_all(engine: Engine, prompts: list[list[int]], s: SmokeSettings,
                 speculation: SpeculationConfig | None, rows: bool = False) -> Run:
    """Every prompt alone, one after another, or (`rows`) as rows of one continuous batch."""
    generation = GenerationConfig(max_new_tokens=s.max_new_tokens, ignore_eos=True)  # random models: same length always
    requests = [GenerationRequest(p, SamplingConfig(), generation, speculation) for p in prompts]
    started = time.perf_counter()
    results = run_rows(engine, requests) if rows else [engine.generate(r) for r in requests]
    return Run([r.token_ids for r in results], total(r.stats for r in results), time.perf_counter() - started)


def run_ssd(target: torch.nn.Module, draft_spec: RandomModelSpec, host: DraftProcess, prompts: list[list[int]],
            s: SmokeSettings, rows: bool = False) -> tuple[Run, float]:
    """SSD with the speculator in the second process; the run and the remote draft's fingerprint."""
    spec = SpeculationConfig(mode="ssd", k=s.k, fanout=FanoutConfig(budget=s.budget))
    channel, remote = host.speculate(draft_spec)
    engine = SSDEngine(target, IdTokenizer(), spec, batching_for(prompts, rows), channel=channel,
                       draft_timeout_s=host.timeout_s)
    with engine:  # close() shuts the remote speculator down
        return generate_all(engine, prompts, s, spec, rows), remote


def batching_for(prompts: list[list[int]], rows: bool) -> BatchingConfig | None:
    """Room for every prompt at once when they run as rows; the engine's default otherwise."""
    return BatchingConfig(max_rows=len(prompts)) if rows else None


def divergence(target: torch.nn.Module, prompt: list[int], ref: list[int], got: list[int]) -> dict[str, Any]:
    """Where `got` first parts from AR's `ref`, and how close the target's top two logits are there
    (a gap near 0 is a near-tie that rounding may flip; a large one is a bug)."""
    i = next(j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b)
    logits = KVSequence(target).forward(prompt + ref[:i], last_only=True)[-1].double()
    top = logits.topk(2).values
    return {"position": i, "ar_token": ref[i], "token": got[i],
            "target_top2_gap_rel": float((top[0] - top[1]) / logits.abs().max())}


def check_generation(target: torch.nn.Module, draft: torch.nn.Module, draft_spec: RandomModelSpec,
                     host: DraftProcess, s: SmokeSettings, need_acceptance: bool) -> dict[str, Any]:
    """AR == SD == SSD, token for token, on every prompt; with `need_acceptance`, drafts must also be accepted."""
    prompts = prompts_for(s, target.config.vocab_size)
    pair, sd = LoadedPair(target, draft, IdTokenizer()), SpeculationConfig(mode="sd", k=s.k)
    runs: dict[str, Run] = {}
    for rows in (False, True):  # each prompt alone, then all of them as rows of one batch (as serving runs them)
        suffix = " rows" if rows else ""
        for mode, spec in (("ar", None), ("sd", sd)):
            engine = make_engine(mode, pair, sd, batching_for(prompts, rows))
            runs[mode + suffix] = generate_all(engine, prompts, s, spec, rows)
        runs["ssd" + suffix], remote = run_ssd(target, draft_spec, host, prompts, s, rows)
    modes = tuple(m for m in runs if m != "ar")  # each against AR alone
    speculative = tuple(m for m in modes if not m.startswith("ar"))
    equal = {mode: runs[mode].tokens == runs["ar"].tokens for mode in modes}
    spec_stats = runs["ssd"].stats.spec
    degraded = sum(runs[m].stats.spec.degraded_rounds for m in ("ssd", "ssd rows"))
    accepted = {mode: runs[mode].stats.accepted for mode in speculative}
    same_draft = remote == fingerprint(draft)
    passed = (all(equal.values()) and degraded == 0 and same_draft
              and (not need_acceptance or min(accepted.values()) > 0))
    return {
        "passed": passed, "equal_to_ar": equal, "ssd_degraded_rounds": degraded,
        "draft_same_in_both_processes": same_draft, "accepted": accepted,
        "acceptance_rate": {mode: runs[mode].stats.acceptance_rate for mode in speculative},
        "ssd_hit_rate": spec_stats.hit_rate, "ssd_lookups": spec_stats.lookups,
        "tokens": s.prompts * s.max_new_tokens,
        "tokens_per_s": {mode: sum(map(len, r.tokens)) / r.seconds for mode, r in runs.items()},
        "divergence": {
            mode: [divergence(target, p, a, b) for p, a, b in zip(prompts, runs["ar"].tokens, runs[mode].tokens,
                                                                  strict=True) if a != b]
            for mode in modes if not equal[mode]
        },
    }


# --- 3. link ---------------------------------------------------------------------


def link_messages(k: int, vocab: int) -> dict[str, Any]:
    """The messages of one SSD round: the outcome (header only) and a proposal with q rows
    (sampled decoding), as shipped (ssd.sampling.as_drawn) and in the float32 shipped before."""
    q = torch.softmax(torch.randn(k, vocab), dim=-1)
    messages = {"round (header only)": protocol.rounds([protocol.RoundRow(0, k, 1)])}
    for rows, when in ((q, "before"), (as_drawn(q), "shipped")):
        reply = protocol.ProposalReply(0, True, Proposal(list(range(k)), rows, "cache"), 0.0, 0.0)
        name = f"proposal q [{k}, {vocab}] {str(rows.dtype).removeprefix('torch.')} ({when}, {rows.nbytes} B)"
        messages[name] = protocol.proposals([reply])
    return messages


def time_link(host: DraftProcess, k: int, vocab: int, rounds: int) -> dict[str, Any]:
    out = {}
    for name, message in link_messages(k, vocab).items():
        for _ in range(3):  # warm-up: first sends set up buffers
            host.echo(message)
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            host.echo(message)
            seconds.append(time.perf_counter() - started)
        out[name] = summarize_ms(seconds)
        log.info("link %s: median %.3f ms", name, out[name]["median_ms"])
    return out


# --- 4. timings ------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_tree_steps(draft: torch.nn.Module, budgets: tuple[int, ...], s: SmokeSettings) -> dict[int, float]:
    """Median seconds of one tree step of B tokens (the second of a build, the first after `start`)."""
    device = next(draft.parameters()).device
    decoder = TreeBranchDecoder()
    out = {}
    for budget in budgets:
        case = branch_case(draft.config.vocab_size, s.prefix, budget, s.k, s.seed)
        kv = KVSequence(draft)
        kv.forward(case.context, last_only=True)
        times = []
        for rep in range(s.repeats + 1):
            decoder.start(kv, case.prefix_lens, case.first)
            try:
                synchronize(device)
                started = time.perf_counter()
                decoder.step(case.first)
                synchronize(device)
            finally:
                decoder.finish()
            if rep:  # the first pass warms up
                times.append(time.perf_counter() - started)
        out[budget] = statistics.median(times)
    return out


def measure(target: torch.nn.Module, draft: torch.nn.Module, s: SmokeSettings) -> tuple[Costs, dict[int, float]]:
    """The planner's costs (measured by the one routine `ablate.py costs` uses) and the tree step per budget.

    KVSequence returns logits on the CPU, so every timed call there ends in a
    device-to-host copy that waits for the GPU: the costs are synchronous.
    """
    threads = s.threads or torch.get_num_threads()
    settings = CostSettings(ks=s.ks, budgets=s.budgets, prefix=s.prefix, repeats=s.repeats, threads=threads,
                            branch_decoder="tree", seed=s.seed)
    with tqdm(total=settings.measurements, desc="costs", file=sys.stderr, disable=None) as bar:
        costs = measure_costs(target, draft, settings, progress=bar.update)
    return costs, time_tree_steps(draft, s.budgets, s)


def plan_from_trace(trace: Path, costs: Costs, s: SmokeSettings) -> dict[str, Any]:
    """What `launch/ablate.py plan` prints, from the measured costs and a recorded trace."""
    base = SpeculationConfig(mode="ssd", k=s.k, fanout=FanoutConfig(budget=s.budget))
    plan = planner.plan_trace(trace, costs, s.ks, s.budgets, base)
    best = plan.ranked[0]
    return {
        "trace": str(trace), "ar_tokens_per_s": plan.ar.tokens_per_s,
        "sd": {"k": plan.sd.k, "tokens_per_s": plan.sd.speed.tokens_per_s,
               "speedup_vs_ar": plan.sd.speed.speedup_vs_ar},
        "ssd": {"kind": best.candidate.kind, "k": best.candidate.k, "budget": best.candidate.budget,
                "tokens_per_s": best.speed.tokens_per_s, "speedup_vs_sd": best.speedup_vs_sd,
                "hit_rate": best.replay.hit_rate},
    }


# --- the run -----------------------------------------------------------------------


@dataclass
class Report:
    settings: dict[str, Any]
    environment: dict[str, Any]
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    errors: dict[str, str] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)
    out: Path | None = None  # where smoke.json is rewritten after every phase

    @property
    def passed(self) -> bool:
        return not self.errors and all(c.get("passed") for c in self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if k != "out"}
        return {"format": FORMAT, "passed": self.passed, **body}

    def checkpoint(self) -> None:
        """Rewrite smoke.json: a run cut short (a hang, the device's time limit) still leaves what it found."""
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "smoke.json").write_text(json.dumps(self.as_dict(), indent=2, default=str))


def environment(device: str) -> dict[str, Any]:
    import transformers

    env = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "machine": hardware.describe()}
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=torch.cuda.get_device_name(dev), capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return env


def phase(report: Report, name: str, fn: Callable[[], Any]) -> Any:
    """Run one phase; an exception is recorded (and logged), not raised, so later phases still run."""
    log.info("== %s", name)
    started = time.perf_counter()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the report; the run goes on
        log.exception("%s failed", name)
        report.errors[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        return None
    finally:
        report.phases_s[name] = time.perf_counter() - started
        log.info("%s took %.1f s", name, report.phases_s[name])
        report.checkpoint()


def run_smoke(s: SmokeSettings) -> Report:
    """All phases (see the module docstring); writes the files when `s.out` is set."""
    if s.threads:
        torch.set_num_threads(s.threads)
    exact_fp32()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    report = Report(settings, environment(s.device), out=s.out)
    specs = model_specs(s)
    with DraftProcess(s.device, s.timeout_s, s.threads) as host:  # it imports torch while we build models
        run_checks(report, specs, host, s)
    gc.collect()  # the checks' fp32 models go before the timed ones arrive
    costs = phase(report, "timings", lambda: run_timings(report, specs["real pair"], s))
    if costs is not None and s.trace is not None:
        report.plan = phase(report, "plan", lambda: plan_from_trace(s.trace, costs, s))
    if s.out is not None:
        write_outputs(report, costs, s.out)
    return report


def run_checks(report: Report, specs: dict[str, tuple[RandomModelSpec, RandomModelSpec]], host: DraftProcess,
               s: SmokeSettings) -> None:
    """Branches, generation per pair and the link, on fp32 models that live only as long as this call."""
    models = phase(report, "build models", lambda: build_models(specs, s.device))
    if models is None:
        return
    # Join the draft process's control link before the checks that do not need it: the
    # process waits to be joined only `timeout_s`, which those checks can outlast (on a CPU
    # at real shapes they did).
    phase(report, "draft link", host.connect)
    for name, pair in specs.items():
        for role, spec, model in zip(NAMES, pair, models[name], strict=True):
            shapes_of = NAMES[role] if name == "real pair" else DRAFT_NAME
            report.environment.setdefault("models", {})[f"{name}/{role}"] = describe(spec, model, shapes_of)
    draft_spec = specs["real pair"][1]
    case = branch_case(draft_spec.config["vocab_size"], BRANCH_CONTEXT, branches=s.budget, steps=s.k, seed=s.seed)
    check(report, "branches", lambda: check_branches(branch_models(draft_spec, s), case))
    check(report, "graphs", lambda: check_graphs(draft_spec, s.device))
    check(report, "sampling", lambda: check_sampling(s.device, s.sampling_samples))
    for name, (target, draft) in models.items():
        run = functools.partial(check_generation, target, draft, specs[name][1], host, s,
                                need_acceptance=name == "noisy pair")
        check(report, f"generation: {name}", run)
    vocab = specs["real pair"][0].config["vocab_size"]
    report.timings["link_round_trip"] = phase(report, "link", lambda: time_link(host, s.k, vocab, s.link_rounds))


def check(report: Report, name: str, fn: Callable[[], dict[str, Any]]) -> None:
    result = phase(report, name, fn)
    if result is not None:
        report.checks[name] = result


def build_models(specs: dict[str, tuple[RandomModelSpec, RandomModelSpec]], device: str) -> dict[str, tuple]:
    return {name: (build_random_model(t, device), build_random_model(d, device)) for name, (t, d) in specs.items()}


def branch_models(draft_spec: RandomModelSpec, s: SmokeSettings) -> dict[str, torch.nn.Module]:
    """The real draft (SSD's branch decoder runs on the draft) in each dtype checked."""
    return {dtype: build_random_model(draft_spec.with_dtype(dtype), s.device) for dtype in s.branch_dtypes}


def run_timings(report: Report, specs: tuple[RandomModelSpec, RandomModelSpec], s: SmokeSettings) -> Costs:
    """The costs file's contents, on the real pair in the timing dtype, with the machine and extras in its meta."""
    target, draft = (build_random_model(spec.with_dtype(s.timing_dtype), s.device) for spec in specs)
    costs, tree_steps = measure(target, draft, s)
    names = {role: name if s.shapes == "real" else f"{name}, scaled down" for role, name in NAMES.items()}
    costs.meta.update(
        source="launch/gpu_smoke.py", device=s.device, gpu=report.environment.get("gpu"), shapes=s.shapes,
        **{role: {"name": name, "weights": "random", "dtype": s.timing_dtype, "quantization": None}
           for role, name in names.items()},
        tree_step_s={str(b): t for b, t in tree_steps.items()},
        link_round_trip_ms=report.timings.get("link_round_trip"),
    )
    report.timings.update(
        dtype=s.timing_dtype, ar_step_s=costs.ar_step_s, verify_s=costs.verify_s, backup_s=costs.backup_s,
        build_s={f"{k},{b}": v for (k, b), v in costs.build_s.items()}, tree_step_s=tree_steps,
    )
    if fast_supported(target) and fast_supported(draft):  # per row vs one call, eager vs captured
        report.timings["hot_path"] = time_hot_path(target, draft, s.k, s.budgets, s.prefix, s.repeats)
        report.timings["hot_path"].update(time_batches(target, batch_sizes(), s.prefix, s.repeats))
    return costs


# --- output --------------------------------------------------------------------------


def write_outputs(report: Report, costs: Costs | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if costs is not None:
        save_costs(costs, out / "costs.json")
    (out / "smoke.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
    (out / "summary.txt").write_text(summary_text(report) + "\n")


def summary_text(report: Report) -> str:
    env = report.environment
    where = env.get("gpu") or env["machine"]["cpu_model"]
    lines = [f"gpu smoke: {'PASSED' if report.passed else 'FAILED'} on {where} (torch {env['torch']}, "
             f"transformers {env['transformers']}), shapes {report.settings['shapes']}"]
    for name, check in report.checks.items():
        lines.append(f"  {name}: {'ok' if check.get('passed') else 'FAILED'}  {_check_line(name, check)}")
    for name, error in report.errors.items():
        lines.append(f"  {name}: ERROR {error.splitlines()[0]}")
    lines += _timing_lines(report.timings)
    if report.plan:
        p, sd, ssd = report.plan, report.plan["sd"], report.plan["ssd"]
        lines.append(f"  plan: AR {p['ar_tokens_per_s']:.1f} tok/s; SD K={sd['k']} {sd['tokens_per_s']:.1f} tok/s; "
                     f"SSD {ssd['kind']} K={ssd['k']} B={ssd['budget']} {ssd['tokens_per_s']:.1f} tok/s "
                     f"({ssd['speedup_vs_sd']:.2f}x SD)")
    lines.append("  phases: " + ", ".join(f"{n} {v:.1f}s" for n, v in report.phases_s.items()))
    return "\n".join(lines)


def _timing_lines(t: dict[str, Any]) -> list[str]:
    def ms(points: dict[Any, float], label: str) -> str:
        return " ".join(f"{label}={key}:{v * 1e3:.2f}" for key, v in sorted(points.items()))

    lines = []
    if "ar_step_s" in t:
        lines.append(f"  timings ({t['dtype']}): target step {t['ar_step_s'] * 1e3:.2f} ms; "
                     f"verify {ms(t['verify_s'], 'K')} ms")
        lines.append(f"    draft tree step {ms(t['tree_step_s'], 'B')} ms")
    for name, variants in (t.get("hot_path") or {}).items():
        lines.append(f"    {name}: " + ", ".join(f"{v} {s * 1e3:.2f}" for v, s in variants.items()) + " ms")
    for name, rtt in (t.get("link_round_trip") or {}).items():
        lines.append(f"    link {name}: median {rtt['median_ms']:.3f} ms (p90 {rtt['p90_ms']:.3f})")
    return lines


def _check_line(name: str, check: dict[str, Any]) -> str:
    if name == "branches":
        ran = [f"{key} ({check['results'][key].get('graph_replays', 0)} graph replays)" for key in check["ran"]]
        return f"ran {', '.join(ran) or 'none'}; skipped {', '.join(check['skipped']) or 'none'}"
    if name == "sampling":
        return (f"SD at T = {check['temperature']:g}, {check['samples']} samples in rows of {check['rows']}: "
                f"p = {check['pvalue']:.2g} against the target's exact law")
    if name == "graphs":
        parts = [*check["devices"].items(), *((f"{n} rows batched", r) for n, r in check.get("batched", {}).items())]
        return "; ".join(f"{d}: max rel diff {r['max_rel_diff']:.1e}, {r['graph_replays']} replays"
                         + (f", graphs off: {r['graphs_off']}" if r["graphs_off"] else "")
                         for d, r in parts)
    equal = " ".join(f"{m}={'=' if v else '!='}AR" for m, v in check["equal_to_ar"].items())
    return (f"{equal}, acceptance SD {check['acceptance_rate']['sd']:.2f} SSD {check['acceptance_rate']['ssd']:.2f}, "
            f"SSD hit rate {check['ssd_hit_rate']:.2f}, degraded rounds {check['ssd_degraded_rounds']}, "
            f"same draft in both processes: {check['draft_same_in_both_processes']}")
