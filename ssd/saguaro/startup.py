"""Seed SSD's K, fan-out budget and glue when it starts, on the devices it runs on.

Two probes, one per role, so that each runs where its model lives (in one
process, or inside the cluster's target and draft actors), at the same time,
as SSD runs them: each role times its own forwards while the other computes
(`probe_pair`; the cluster's: ssd.cluster.planning), and keeps computing
(`keep_busy`) until the other's timing is done too:
- `target_probe`: its greedy continuation of a few prompts (which the draft
  is then scored against), then the verification of K + 1 tokens for a few
  K and one decode step, each after a PREFIX-token context, and a packed
  verification at a few batch sizes;
- `draft_probe`: the draft's backup chain for a few K and its cache build
  per (K, budget) for each glue kind, on a small grid, and a batched backup
  chain at a few batch sizes (the rest is fitted: ssd.saguaro.costs.Costs,
  ssd.saguaro.plan.RowCosts); then, after both, `agreement`: where the
  target's tokens rank among the draft's (ssd.saguaro.plan.Agreement).
Both time with one intra-op thread per role; on the first run the plan takes
FIRST_PLAN (measured; docs/configuration.md), a line at least every
ssd.hardware.HEARTBEAT_S seconds meanwhile. The plan only seeds SSD: the anytime build
and K follow the measured rounds from there. The models are of either
backend (ssd.models.backend: torch or llama.cpp, whose sequences the probes
hand back when done). `plan_from_probes` turns them into
ssd.saguaro.plan.Plan; the result is cached per host (CPU model and torch's
capability, or the GPU), model pair and precision, so later starts only
read a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ssd import hardware
from ssd.hardware import heartbeat
from ssd.saguaro.costs import (
    CostSettings, Costs, backup_probe, build_probe, chain_rows_probe, forward_probe, prefilled_rows, probe_sequence,
    round_robin, verify_rows_probe,
)
from ssd.config import Config, ModelConfig, SpeculationConfig
from ssd.models import offline
from ssd.models import backend
from ssd.models.backend import AnySequence, Model
from ssd.models.loading import LLAMACPP, resolve_backend, resolve_precision
from ssd.saguaro.branches import TreeBranchDecoder, make_branch_decoder
from ssd.saguaro.plan import DEFAULT_BUDGETS, DEFAULT_KS, Agreement, Plan, RowCosts, choose

log = logging.getLogger(__name__)

# What the first run's plan took (probes, llama.cpp's invariance probe inside them, the plan), measured
# with the real q4_k_m pair on llama.cpp through launch/cluster.py --cpu at load averages 0.8-6.4
# (docs/configuration.md); the log line quotes it.
FIRST_PLAN = "18-30 s on a 2-core AMD EPYC (AVX512) host"
FORMAT = "ssd-startup-plan/5"  # 5: llama.cpp loads repacked layouts where they run (its costs changed); 4: AR on the cores a lone target borrows from an idle draft (ar_wide_step_s)
PLAN_GLUES = ("fold", "reuse")
# Measured; the others fitted (linear in K, bilinear in K and budget, linear in rows and tokens).
VERIFY_KS = (1, 2, 4)
BACKUP_KS = (1, 3, 6)
BUILD_KS = (1, 3)
BUILD_BUDGETS = (2, 8)
PROBE_ROWS = (4,)  # batch sizes of the batched probes; one row's are the single-row probes' (the rest interpolated)
REPEATS = 2  # timed passes, the fastest kept (a shared host only adds time); after a warm-up pass on torch
CONTINUATION = 16  # target tokens per prompt the draft is scored against
PREFIX = 32
ROWS_PREFIX = 8  # batched probes: b rows of this context each (a shorter prefill)
ROWS_TOKENS = (1, 3)  # tokens a row in the batched verification probes (one row: ar_step_s, verify_s[2])
ROWS_CHAIN = (1, 3)  # draft tokens a row in the batched backup-chain probes (one row: backup_s[1], [3])
BUSY_TOKENS = 4  # a role that finished its timing keeps forwarding this many tokens a step
TARGET_PART = {"verify_s", "ar_step_s", "rows_verify_s", "sequences"}  # what each probe returns
DRAFT_PART = {"backup_s", "build_s", "rows_chain_s", "agreement"}
SAMPLE_PROMPTS = (  # code and chat, as users send
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Explain in two sentences why the sky is blue.",
    "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n    def __init__(self, capacity):\n",
)


def cache_dir() -> Path:
    return offline.cache_dir() / "plans"  # beside the models and int8 weights ($SSD_CACHE_DIR)


def plan_key(target_name: str, draft_name: str, precisions: Sequence[str], devices: Sequence[str]) -> str:
    """What a plan depends on: host, devices, models and their precisions, torch."""
    parts = [hardware.describe(), torch.__version__, target_name, draft_name, *precisions, *devices, FORMAT]
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:20]


def sample_prompt_ids(tokenizer) -> list[list[int]]:
    """SAMPLE_PROMPTS as token ids; a tokenizer that cannot spell them (the tests'
    tiny one) gets two fixed id sequences instead."""
    try:
        return [tokenizer.encode(p, add_special_tokens=False) for p in SAMPLE_PROMPTS]
    except ValueError as exc:
        log.info("SSD plan: sample prompts not encodable (%s); fixed token ids instead", exc)
        return [list(range(1, 9)), list(range(3, 13)), list(range(2, 8))]


def _probing(fn: Callable[[list[AnySequence]], Any], threads: int | None = 1) -> Any:
    """fn(made) with `threads` intra-op threads (one by default; None: the caller's count);
    the sequences it adds to `made` are released after (llama.cpp contexts follow torch's count)."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    made: list[AnySequence] = []
    try:
        return fn(made)
    finally:
        torch.set_num_threads(saved)
        for sequence in made:
            backend.release(sequence)


def target_probe(target: Model, ks: Sequence[int] = VERIFY_KS, repeats: int = REPEATS) -> dict[str, Any]:
    """The target's verification and decode costs, alone and in batches (one row's: the
    decode step and the verification of K + 1 = ROWS_TOKENS tokens)."""
    def run(made: list[AnySequence]) -> dict[str, Any]:
        gen, prefix, kv = _primed(target, max(ks) + 1)
        made.append(kv)
        probes = {k: forward_probe(kv, prefix, k + 1, gen) for k in ks}
        probes[0] = forward_probe(kv, prefix, 1, gen)
        vocab = backend.vocab_size(target)
        for rows, contexts in _row_contexts(target, gen).items():
            primed = prefilled_rows(target, contexts, max(ROWS_TOKENS))
            made.extend(primed)
            for n in ROWS_TOKENS:
                probes[("rows", rows, n)] = verify_rows_probe(primed, contexts, n, vocab, gen)
        timed = round_robin(probes, repeats, lambda: None, "SSD plan, target probes", backend.ops_of(target).warm_up, min)
        one_row = [[1, n, timed[n - 1]] for n in ROWS_TOKENS]
        return {"verify_s": {k: timed[k] for k in ks}, "ar_step_s": timed[0],
                "rows_verify_s": one_row + [[b, n, timed[("rows", b, n)]] for b in PROBE_ROWS for n in ROWS_TOKENS]}
    return _probing(run)


def wide_step_probe(target: Model, repeats: int = REPEATS) -> float:
    """Seconds of the target's decode step on every core this thread may use (torch's thread count
    as set by the caller: a cluster target with the draft's cores lent, the draft idle), the
    fastest of `repeats` after a warm-up: what AR costs when speculation gives the draft's core back."""
    def run(made: list[AnySequence]) -> float:
        gen, prefix, kv = _primed(target, 1)
        made.append(kv)
        return round_robin({0: forward_probe(kv, prefix, 1, gen)}, repeats, lambda: None, None, True, min)[0]
    return _probing(run, threads=None)


def continuations(target: Model, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Each prompt + the target's greedy continuation of CONTINUATION tokens (what the draft is
    scored against: `agreement`), and where each continuation starts."""
    started = time.perf_counter()
    sequences = _probing(lambda made: _continue_rows(target, prompts, CONTINUATION))
    log.info("SSD plan, target probes: %d sample prompts continued (%.0f s)", len(prompts), time.perf_counter() - started)
    return {"sequences": sequences, "starts": [len(p) for p in prompts]}


def draft_probe(draft: Model, ks: Sequence[int] = BACKUP_KS, budgets: Sequence[int] = BUILD_BUDGETS,
                glues: Sequence[str] = PLAN_GLUES, repeats: int = REPEATS) -> dict[str, Any]:
    """Backup and build costs, alone and in batches (the agreement comes after: `agreement`)."""
    def run(made: list[AnySequence]) -> dict[str, Any]:
        # a build holds the prefix, K drafted tokens and K branch tokens, on up to `budget` branches
        longest = max(*ks, *BUILD_KS)
        gen, prefix, kv = _primed(draft, 2 * longest + 1, branches=max(budgets))
        made.append(kv)
        vocab = backend.vocab_size(draft)
        settings = CostSettings(ks=tuple(ks), budgets=tuple(budgets), repeats=repeats)
        probes = {("backup", k): backup_probe(kv, prefix, k, settings) for k in ks}
        for rows, contexts in _row_contexts(draft, gen).items():
            primed = prefilled_rows(draft, contexts, max(ROWS_CHAIN))
            made.extend(primed)
            for k in ROWS_CHAIN:
                probes[("rows", rows, k)] = chain_rows_probe(primed, contexts, k, seed=0)
        decoder = make_branch_decoder("tree", sequence=kv)  # llama.cpp: its own (a slot per branch)
        timed_glues = list(glues)
        if not isinstance(decoder, TreeBranchDecoder):  # fold rides on torch's tree decoder; elsewhere it is reuse
            timed_glues = [g for g in glues if g != "fold"] or ["reuse"]
        for glue in timed_glues:
            glued = dataclasses.replace(settings, glue=glue)
            for k in BUILD_KS:
                for b in budgets:
                    probes[(glue, k, b)] = build_probe(kv, decoder, prefix, k, b, vocab, glued, gen)
        timed = round_robin(probes, repeats, lambda: None, "SSD plan, draft probes", backend.ops_of(draft).warm_up, min)
        builds: dict[str, list[list]] = {glue: [] for glue in timed_glues}
        for key, seconds in timed.items():
            if key[0] in builds:
                builds[key[0]].append([key[1], key[2], seconds])
        one_row = [[1, k, timed[("backup", k)]] for k in ROWS_CHAIN]
        return {"backup_s": {k: timed[("backup", k)] for k in ks}, "build_s": builds,
                "rows_chain_s": one_row + [[b, k, timed[("rows", b, k)]] for b in PROBE_ROWS for k in ROWS_CHAIN]}
    return _probing(run)


def keep_busy(model: Model, done: Callable[[], bool]) -> int:
    """Forward BUSY_TOKENS tokens at a time on a short context, one intra-op thread, until
    `done()`: a role whose timing is over keeps computing while the other's runs. Steps run."""
    def run(made: list[AnySequence]) -> int:
        steps = 0
        if done():
            return steps
        gen = torch.Generator().manual_seed(1)
        prefix = torch.randint(backend.vocab_size(model), (ROWS_PREFIX,), generator=gen).tolist()
        kv = probe_sequence(model, ROWS_PREFIX + BUSY_TOKENS)
        made.append(kv)
        kv.forward(prefix, last_only=True)
        step, reset = forward_probe(kv, prefix, BUSY_TOKENS, gen)
        while not done():
            reset()
            step()
            steps += 1
        return steps
    return _probing(run)


def probe_pair(target: Model, draft: Model, prompts: Sequence[Sequence[int]]) -> tuple[dict, dict]:
    """Both probes in this process, at once: the draft's on a thread beside the target's (as
    SSD runs its speculator), each role with one intra-op thread. The target continues the
    prompts, then times; the draft times, then scores the continuations (`agreement`); each
    keeps computing until the other is done."""
    continued: Future = Future()
    target_done = threading.Event()

    def draft_side() -> dict[str, Any]:
        part = draft_probe(draft)
        part["agreement"] = agreement(draft, **continued.result()).to_json()
        keep_busy(draft, target_done.is_set)
        return part

    with ThreadPoolExecutor(1, thread_name_prefix="ssd-plan-draft") as pool:
        drafted = pool.submit(draft_side)
        try:
            sequences = continuations(target, prompts)
            continued.set_result(sequences)
            target_part = target_probe(target) | {"sequences": sequences["sequences"]}
        except BaseException as exc:
            if not continued.done():
                continued.set_exception(exc)
            raise
        finally:
            target_done.set()
        keep_busy(target, drafted.done)
        return target_part, drafted.result()


def agreement(draft: Model, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> Agreement:
    """Greedy acceptance and t*'s ranks, teacher-forced on the target's own continuations
    (one intra-op thread: it runs beside the target's probes)."""
    def ranks(made: list[AnySequence]) -> list[int]:
        cut = min(starts) - 1  # the logits from here on: the prompts' heads forward without them
        source = backend.sequence_source(draft, len(sequences), sum(map(len, sequences)), max(map(len, sequences)))
        made.extend(backend.new_sequence(source) for _ in sequences)
        with torch.inference_mode():
            if cut > 0:
                backend.forward_rows(made, [list(seq[:cut]) for seq in sequences], last_only=True)
            outs = backend.forward_rows(made, [list(seq[cut:-1]) for seq in sequences], last_only=False)
            return [int((row > row[token]).sum())
                    for seq, start, out in zip(sequences, starts, outs)
                    for row, token in zip(out[start - 1 - cut :].float(), seq[start:])]

    started = time.perf_counter()
    bonus = _probing(ranks)
    rejected = [rank - 1 for rank in bonus if rank]  # among the draft's tokens other than its rejected top choice
    positions = len(bonus)
    log.info("SSD plan, draft probes: the target's tokens ranked among the draft's at %d positions (%.0f s)",
             positions, time.perf_counter() - started)
    return Agreement(min((positions - len(rejected)) / max(positions, 1), 0.99), rejected, bonus, positions)


def plan_from_probes(target_part: dict[str, Any], draft_part: dict[str, Any], meta: dict[str, Any],
                     link_s: float = 0.0) -> Plan:
    """The plan from both probes; `link_s`: the target-draft link's round trip (the cluster's)."""
    verify = {int(k): v for k, v in target_part["verify_s"].items()}
    backup = {int(k): v for k, v in draft_part["backup_s"].items()}
    costs = {
        glue: Costs(target_part["ar_step_s"], verify, backup, {(k, b): s for k, b, s in rows}, meta)
        for glue, rows in draft_part["build_s"].items()
    }
    rows = RowCosts.from_json({"verify": target_part["rows_verify_s"], "chain": draft_part["rows_chain_s"]})
    plan = choose(costs, Agreement.from_json(draft_part["agreement"]), ks=DEFAULT_KS, budgets=DEFAULT_BUDGETS,
                  rows_costs=rows, link_s=link_s)
    plan.meta = meta
    wide_s = target_part.get("ar_wide_step_s")  # only where a lone target borrows the draft's cores
    plan.ar_wide_tokens_per_s = 1.0 / wide_s if wide_s else None
    return plan


def cached_probes(key: str, measure: Callable[[], tuple[dict, dict]], meta: dict[str, Any],
                  directory: Path | None = None) -> tuple[dict, dict]:
    """The probes for `key` from the cache, else from `measure()` (then cached)."""
    path = (directory or cache_dir()) / f"{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            complete = TARGET_PART <= set(data["target"]) and DRAFT_PART <= set(data["draft"])
            if data.get("format") == FORMAT and complete:
                log.info("SSD plan: probes cached at %s", path)
                return data["target"], data["draft"]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("SSD plan: ignoring unreadable cache %s (%s)", path, exc)
    log.info("SSD plan: timing verification and cache builds on this host, each role beside the other "
             "(once, cached at %s; the real pair's first plan took %s)", path, FIRST_PLAN)
    started = time.perf_counter()
    with heartbeat(log, "SSD plan: probes running"):  # the roles' own lines come from other threads or actors
        target_part, draft_part = measure()
    log.info("SSD plan: probes done in %.0f s", time.perf_counter() - started)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": FORMAT, "meta": meta, "target": target_part, "draft": draft_part}))
    except OSError as exc:  # an unwritable cache costs the next start the probes, not this one
        log.warning("SSD plan: could not cache the probes at %s (%s)", path, exc)
    return target_part, draft_part


def load_or_measure(key: str, measure: Callable[[], tuple[dict, dict]], meta: dict[str, Any],
                    directory: Path | None = None) -> Plan:
    """The plan for `key` from cached probes, else from `measure()` (then cached)."""
    return plan_from_probes(*cached_probes(key, measure, meta, directory), meta)


def plan_in_process(target: Model, draft: Model, tokenizer, key: str, meta: dict[str, Any],
                    directory: Path | None = None) -> Plan:
    """Both probes in this process (the local engines and server)."""
    def measure() -> tuple[dict, dict]:
        return probe_pair(target, draft, sample_prompt_ids(tokenizer))
    return load_or_measure(key, measure, meta, directory)


def wanted(config: Config) -> bool:
    """Whether to plan: asked for, and SSD is the default mode. A tensor-parallel target is
    probed through its leader (ssd.models.tp.TPLeader), the other ranks mirroring each forward."""
    return bool(config.runtime.plan and config.speculation.mode == "ssd")


def config_key(config: Config, devices: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """The cache key and the metadata recorded with a plan."""
    # The backend as resolved here (the driver's host): auto means llama.cpp only where it is installed.
    gpu = any(d.startswith("cuda") for d in devices)
    precisions = [_precision(m, resolve_backend(m, "cuda" if gpu else "cpu")) for m in (config.target, config.draft)]
    meta = {"machine": hardware.describe(), "torch": torch.__version__, "target": config.target.name,
            "draft": config.draft.name, "precisions": precisions, "devices": list(devices)}
    return plan_key(config.target.name, config.draft.name, precisions, devices), meta


def _precision(model: ModelConfig, resolved_backend: str) -> str:
    """One model's part of the plan's key: its backend, precision and, on llama.cpp, the
    layouts and KV cache asked for and what "auto" may resolve to (the build, the probe's candidates)."""
    text = f"{resolved_backend}:{model.dtype}/{model.quantization}"
    if resolved_backend != LLAMACPP:
        return text + _kernels_signature(model)
    from ssd.models import llamacpp

    return (text + ("" if model.llamacpp_repack is None else f"/repack={model.llamacpp_repack}")
            + f"/kv={model.llamacpp_kv}/{llamacpp.plan_signature()}")


def _kernels_signature(model: ModelConfig) -> str:
    """On ssd's GGUF kernels, their build (a digest of their source): a faster kernel is a new plan."""
    if resolve_precision(model).quantization != "gguf":
        return ""
    from ssd.models.kernels.build import library_path

    return f"/{library_path().stem}"


def planned(config: Config, plan: Plan) -> Config:
    """config with the plan applied to its speculation defaults (runtime.plan_keeps kept), reported."""
    report(plan)
    speculation = apply_plan(config.speculation, plan, config.runtime.plan_keeps)
    if config.runtime.plan_keeps:
        log.info("SSD plan: kept as configured: %s", ", ".join(config.runtime.plan_keeps))
    log.info("SSD runs with K=%d, budget=%d, glue=%s, k_policy=%s, batch_budget=%s", speculation.k,
             speculation.fanout.budget, speculation.glue, speculation.k_policy, speculation.fanout.batch_budget)
    return dataclasses.replace(config, speculation=speculation)


def plan_for_pair(config: Config, pair) -> Config:
    """config with SSD's start-up plan applied, where it asks for one, both models in
    this process (ssd.factory.LoadedPair: the local engines and servers)."""
    if pair.draft is None or not wanted(config):
        return config
    devices = [backend.device_name(pair.target), backend.device_name(pair.draft), "in-process"]
    key, meta = config_key(config, devices)
    return planned(config, plan_in_process(pair.target, pair.draft, pair.tokenizer, key, meta))


def apply_plan(speculation: SpeculationConfig, plan: Plan, fixed: Sequence[str] = ()) -> SpeculationConfig:
    """The speculation defaults with the plan's K, budget and glue, and by batch size its
    k_policy (speculation off where AR is faster) and batch_budget, except the `fixed` ones
    (set by the user; a k_policy or batch_budget the config sets counts as set), and its
    measured acceptance as the fan-out's prior."""
    best = plan.best
    fanout = speculation.fanout
    keep_budget_cap = "batch_budget" in fixed or fanout.batch_budget is not None
    fanout = dataclasses.replace(
        fanout, budget=fanout.budget if "budget" in fixed else best.budget, initial_a=plan.agreement.a,
        batch_budget=fanout.batch_budget if keep_budget_cap else plan.batch_budget,
    )
    keep_policy = "k_policy" in fixed or bool(speculation.k_policy)
    return dataclasses.replace(
        speculation, fanout=fanout, k=speculation.k if "k" in fixed else best.k,
        glue=speculation.glue if "glue" in fixed else best.glue,
        k_policy=speculation.k_policy if keep_policy else plan.k_policy,
    )


def report(plan: Plan) -> None:
    log.info("%s", plan.summary())
    if plan.rows:
        log.info("%s", plan.rows_summary())
    if plan.lends_draft_core:
        log.warning("SSD plan: %s, the draft's core lent while speculation is off: speculation off at every batch "
                    "size; speculation.k_policy: {} in the config (--always-speculate), or a K in the request, "
                    "keeps it on", plan.off_reason())
    elif plan.rows and not plan.rows[0].speculates:
        log.warning("SSD plan: AR is predicted faster than SSD even at one row on this host (%.2f vs %.2f tok/s)",
                    plan.rows[0].ar_tokens_per_s, plan.rows[0].ssd_tokens_per_s)
    if not plan.beats_sd:
        log.warning(
            "SSD plan: no SSD setting is predicted to beat SD on this host (best SSD %.2f tok/s, SD %.2f): "
            "the draft's cache build (%.0f ms) against the verification it hides behind (%.0f ms) is why; "
            "--mode sd is the faster choice here", plan.best.tokens_per_s, plan.sd_tokens_per_s,
            plan.best.build_s * 1e3, plan.best.verify_s * 1e3,
        )


def _primed(model: Model, room: int = 0, branches: int = 0) -> tuple[torch.Generator, list[int], AnySequence]:
    """A seeded generator, a random PREFIX-token context and a cache holding it, which
    may take `room` tokens more and decode `branches` branches (llama.cpp sizes its
    context by them; torch needs neither)."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(backend.vocab_size(model), (PREFIX,), generator=gen).tolist()
    kv = probe_sequence(model, PREFIX + room, branches)
    kv.forward(prefix, last_only=True)
    return gen, prefix, kv


def _row_contexts(model: Model, gen: torch.Generator) -> dict[int, list[list[int]]]:
    """Random ROWS_PREFIX-token contexts for each batch size the plan covers."""
    vocab = backend.vocab_size(model)
    return {rows: [torch.randint(vocab, (ROWS_PREFIX,), generator=gen).tolist() for _ in range(rows)]
            for rows in PROBE_ROWS}


def _continue_rows(model: Model, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Each prompt + the model's greedy continuation of n tokens, the prompts decoding together."""
    lengths = [len(p) for p in prompts]
    source = backend.sequence_source(model, len(prompts), max(sum(lengths), len(prompts)), max(lengths) + n)
    rows = [backend.new_sequence(source) for _ in prompts]
    try:
        outs = [list(p) for p in prompts]
        logits = backend.forward_rows(rows, outs, last_only=True)
        for _ in range(n):
            for out, row_logits in zip(outs, logits):
                out.append(int(row_logits[-1].argmax()))
            logits = backend.forward_rows(rows, [out[-1:] for out in outs])
        return outs
    finally:
        for row in rows:
            backend.release(row)
