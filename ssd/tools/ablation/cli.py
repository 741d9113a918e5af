"""SSD ablations from recorded traces: record once with the models, then replay
fan-out schedules, K, budget and Saguaro C without them.

    python launch/ablate.py record --prompts 8 --max-new-tokens 128 --out trace.safetensors
    python launch/ablate.py record --temperature 0.7 --samples-per-prompt 4 --out trace-t07.safetensors
    python launch/ablate.py costs --out costs.json            # --quick: a 2 x 2 grid, one repeat
    python launch/ablate.py sweep --trace trace.safetensors --costs costs.json --json sweep.json --plots plots/
    python launch/ablate.py fit --trace trace.safetensors -k 4
    python launch/ablate.py plan --trace trace.safetensors --costs costs.json --top 5
    python launch/ablate.py compare --trace trace.safetensors -k 4 --budget 8
    python launch/ablate.py backups --batch-sizes 1 2 4 8 --temperature 0.7 --plot crossover.png

The base configuration (K, budget, fan-out kind, Saguaro C, planner priors,
branch decoder, models) comes from --config and its override flags. Replays
are exact under greedy decoding and a Monte Carlo given the trajectories at
T > 0 (see ssd/tools/ablation/replay.py); --samples sets the passes per trajectory.
At T > 0 record several trajectories per prompt (--samples-per-prompt; prompt
i, sample s uses seed sampling.seed + i * samples + s). For a dynamically
int8-quantized draft, `record --chunk 5` scores in live-like 5-token calls
(activation scales are per call, so call shapes move the logits a little).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import yaml
from tqdm import tqdm

from ssd.saguaro import costs as costs_mod
from ssd.tools.ablation import planner, report
from ssd.tools.ablation.compare import compare
from ssd.tools.ablation.neighbour import busy_neighbour, pin
from ssd.tools.ablation.replay import ReplayData, fit_power_law, miss_vs_fanout
from ssd.tools.ablation.sweep import SweepGrid, sweep_tables
from ssd.tools.ablation.trace import RecordSettings, Trace, load_trace, record_trace, save_trace
from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args
from ssd.config import Config, SpeculationConfig
from ssd.factory import load_pair
from ssd.models.tokenizer import encode_prompt

log = logging.getLogger("ablate")
PROMPT_FILE = PROMPT_DIR / "code.yaml"
QUICK = {"ks": (2, 4), "budgets": (4, 8), "repeats": 1}


# ---------------------------------------------------------------------------
# Argument types: a bad value names its flag (argparse adds "argument --x:")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


POSITIVE = _int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _record_args(sub.add_parser("record", help="generate trajectories and record both models' logits"))
    _costs_args(sub.add_parser("costs", help="measure verify / backup / build costs on the pair"))
    _sweep_args(sub.add_parser("sweep", help="tables over fan-out kind x budget, K and C (+ plots)"))
    _fit_args(sub.add_parser("fit", help="miss rate vs fan-out and its power-law exponent r"))
    _plan_args(sub.add_parser("plan", help="recommend K, B, C and fan-out kind by modelled tokens/s"))
    _compare_args(sub.add_parser("compare", help="replayed vs live in-process SSD on the trace's prompts"))
    _backups_args(sub.add_parser("backups", help="neural vs fast backup across batch sizes, live, with b*"))
    return parser


def _backups_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-file", type=Path, default=PROMPT_FILE, help="YAML list of prompt strings")
    p.add_argument("--batch-sizes", type=POSITIVE, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--backups", nargs=2, default=["neural", "ngram"], metavar=("NEURAL", "FAST"),
                   help="the neural and the fast backup (default: neural ngram)")
    p.add_argument("--plot", type=Path, help="write the figure here (.png)")
    p.add_argument("--json", type=Path, help="write the rows and the prediction here")
    add_config_args(p)


def _record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-file", type=Path, default=PROMPT_FILE, help="YAML list of prompt strings")
    p.add_argument("--prompts", type=POSITIVE, default=4, help="how many prompts of the file")
    p.add_argument("--samples-per-prompt", type=POSITIVE, default=1, help="trajectories per prompt (T > 0)")
    p.add_argument("--top-n", type=POSITIVE, default=128, help="logits kept per position and model")
    p.add_argument("--chunk", type=_int_at_least(0), default=0,
                   help="tokens per scoring forward (0: one forward; small values mimic live call shapes "
                        "for a dynamically quantized draft, at the cost of more forwards)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--out", type=Path, required=True, help="trace file to write (.safetensors)")
    add_config_args(p)


def _costs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="costs file to write (.json)")
    p.add_argument("--quick", action="store_true", help="K in {2, 4}, B in {4, 8}, one repeat")
    p.add_argument("--ks", type=POSITIVE, nargs="+", help="K values to measure (default 1..8)")
    p.add_argument("--budgets", type=POSITIVE, nargs="+", help="budgets to measure (default 4 8 12 16 24 32)")
    p.add_argument("--repeats", type=POSITIVE, help="timed repetitions per point (default 3)")
    p.add_argument("--prefix", type=POSITIVE, default=200, help="context tokens in the KV cache")
    p.add_argument("--role-threads", type=POSITIVE, default=1, help="intra-op threads while timing a role")
    p.add_argument("--under-load", action="store_true",
                   help="time each role on one core while the other role decodes on another, as in SSD")
    add_config_args(p)


def _replay_args(p: argparse.ArgumentParser, costs: str | None = None) -> None:
    p.add_argument("--trace", type=Path, required=True, help="trace file from `record`")
    if costs == "required":
        p.add_argument("--costs", type=Path, required=True, help="costs file from `costs`")
    elif costs == "optional":
        p.add_argument("--costs", type=Path, help="costs file from `costs` (adds modelled tokens/s)")
    p.add_argument("--samples", type=POSITIVE, default=4, help="Monte Carlo passes per trajectory at T > 0")
    p.add_argument("--replay-seed", type=int, default=0, help="seed of the Monte Carlo replay")
    p.add_argument("--json", type=Path, help="write the results here")
    add_config_args(p)


def _sweep_args(p: argparse.ArgumentParser) -> None:
    _replay_args(p, costs="optional")
    p.add_argument("--ks", type=POSITIVE, nargs="+", default=list(planner.DEFAULT_KS))
    p.add_argument("--budgets", type=POSITIVE, nargs="+", default=list(planner.DEFAULT_BUDGETS))
    p.add_argument("--cs", type=_unit_float, nargs="+", default=list(planner.DEFAULT_CS))
    p.add_argument("--csv", type=Path, help="write every table's rows to one CSV")
    p.add_argument("--plots", type=Path, help="write the PNG figures into this directory")
    p.add_argument("--max-fanout", type=POSITIVE, default=16, help="largest F of the miss-vs-fan-out figure")


def _fit_args(p: argparse.ArgumentParser) -> None:
    _replay_args(p)
    p.add_argument("--max-fanout", type=POSITIVE, default=16, help="fit over F = 1..this")
    p.add_argument("--plot", type=Path, help="write the log-log figure here (.png)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    _replay_args(p, costs="required")
    p.add_argument("--ks", type=POSITIVE, nargs="+", default=list(planner.DEFAULT_KS))
    p.add_argument("--budgets", type=POSITIVE, nargs="+", default=list(planner.DEFAULT_BUDGETS))
    p.add_argument("--cs", type=_unit_float, nargs="+", default=list(planner.DEFAULT_CS))
    p.add_argument("--kinds", nargs="+", choices=planner.KINDS, default=list(planner.KINDS))
    p.add_argument("--top", type=POSITIVE, default=5, help="recommendations to print")


def _compare_args(p: argparse.ArgumentParser) -> None:
    _replay_args(p)


# ---------------------------------------------------------------------------
# Commands


def cmd_record(args: argparse.Namespace, config: Config) -> None:
    if not args.prompt_file.is_file():
        sys.exit(f"error: --prompt-file: file not found: {args.prompt_file}")
    texts = yaml.safe_load(args.prompt_file.read_text())
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        sys.exit(f"error: --prompt-file: {args.prompt_file} must be a YAML list of strings")
    if args.prompts > len(texts):
        sys.exit(f"error: --prompts: {args.prompt_file} has {len(texts)} prompts, asked for {args.prompts}")
    pair = load_pair(config)
    prompts = [encode_prompt(pair.tokenizer, t, args.chat) for t in texts[: args.prompts]]
    settings = RecordSettings(config.sampling, config.generation, args.top_n, args.samples_per_prompt, args.chunk)
    info = {role: _model_info(config, role) for role in ("target", "draft")}
    with tqdm(total=len(prompts) * args.samples_per_prompt, desc="record", file=sys.stderr) as bar:
        try:
            trace = record_trace(pair.target, pair.draft, pair.tokenizer, prompts, settings, info,
                                 str(args.prompt_file), progress=bar.update)
        except ValueError as exc:
            sys.exit(f"error: {exc}")
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {len(trace.sequences)} sequences, {trace.num_positions} positions, "
          f"T={trace.meta.temperature:g}, top-{trace.meta.top_n} of {trace.meta.vocab_size}")


def cmd_costs(args: argparse.Namespace, config: Config) -> None:
    quick = QUICK if args.quick else {}
    settings = costs_mod.CostSettings(
        ks=tuple(args.ks or quick.get("ks", costs_mod.DEFAULT_KS)),
        budgets=tuple(args.budgets or quick.get("budgets", costs_mod.DEFAULT_BUDGETS)),
        prefix=args.prefix, repeats=args.repeats or quick.get("repeats", 3), threads=args.role_threads,
        branch_decoder=config.speculation.branch_decoder, sampling=config.sampling,
    )
    loads = {}
    if args.under_load:
        measured, other = _two_cores()
        pin(measured)  # this process: the role being timed; the neighbour gets the other core
        loads = {
            "beside_draft": lambda: busy_neighbour(config.draft, other, config.speculation.fanout.budget),
            "beside_target": lambda: busy_neighbour(config.target, other, config.speculation.k + 1),
        }
    pair = load_pair(config)
    with tqdm(total=settings.measurements, desc="costs", file=sys.stderr) as bar:
        costs = costs_mod.measure_costs(pair.target, pair.draft, settings, progress=bar.update, **loads)
    costs.meta.update(target=_model_info(config, "target"), draft=_model_info(config, "draft"))
    costs_mod.save_costs(costs, args.out)
    print(f"AR step {costs.ar_step_s * 1e3:.1f} ms")
    rows = [{"k": k, "verify_ms": costs.verify_s[k] * 1e3, "backup_ms": costs.backup_s[k] * 1e3,
             **{f"build_B{b}_ms": costs.build_s[(k, b)] * 1e3 for b in settings.budgets}} for k in settings.ks]
    cols = [("k", "K", ">3"), ("verify_ms", "verify ms", ">9.1f"), ("backup_ms", "backup ms", ">9.1f")]
    cols += [(f"build_B{b}_ms", f"build B={b}", ">10.1f") for b in settings.budgets]
    print(report.table(rows, cols))
    print(f"wrote {args.out}")


def _two_cores() -> tuple[int, int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("error: --under-load needs two cores (one per role)")
    return cores[0], cores[1]


def cmd_sweep(args: argparse.Namespace, config: Config) -> None:
    data, spec = _replay_inputs(args, config)
    costs = _load_costs(args.costs) if args.costs else None
    grid = SweepGrid(args.ks, args.budgets, args.cs)
    with tqdm(total=grid.size(data.greedy), desc="sweep", file=sys.stderr) as bar:
        tables = sweep_tables(data, spec, grid, costs, args.samples, args.replay_seed, progress=bar.update)
    cols = report.REPLAY_COLUMNS + report.SPEED_COLUMNS
    _print_header(data, spec)
    for name, title in (("fanout_budget", "fan-out kind x budget"), ("k", "draft length K"), ("c", "Saguaro C")):
        if tables[name]:
            print(f"\n## {title}\n{report.table(tables[name], cols)}")
    if "sd_best" in tables:
        sd = tables["sd_best"][0]
        print(f"\nSD at its best K={sd['k']}: {sd['tokens_per_s']:.2f} tok/s ({sd['speedup_vs_ar']:.2f}x AR)")
    if args.json:
        report.write_json(tables, args.json)
    if args.csv:
        report.write_csv([{"table": n, **r} for n, rows in tables.items() for r in rows], args.csv)
    if args.plots:
        from ssd.tools.ablation.plots import write_all  # matplotlib (the tools extra): only where asked for

        paths = write_all(data, spec, args.plots, args.budgets, args.cs, args.max_fanout, args.samples, args.replay_seed)
        print("plots: " + ", ".join(str(p) for p in paths))


def cmd_fit(args: argparse.Namespace, config: Config) -> None:
    data, spec = _replay_inputs(args, config)
    points = miss_vs_fanout(data, spec.k, args.max_fanout, spec, args.samples, args.replay_seed)
    _print_header(data, spec)
    rows = [{"fanout": p.fanout, "miss_rate": p.miss_rate, "lookups": p.lookups} for p in points]
    print(report.table(rows, [("fanout", "F", ">3"), ("miss_rate", "miss rate", ">9.4f"), ("lookups", "lookups", ">8")]))
    try:
        fit = fit_power_law([p.fanout for p in points], [p.miss_rate for p in points])
        print(f"power law: miss = {fit.c:.3f} F^-{fit.r:.3f} (least squares on log-log, {fit.points} points)")
    except ValueError as exc:
        fit = None
        print(f"no fit: {exc}")
    if args.json:
        report.write_json({"points": rows, "r": fit and fit.r, "c": fit and fit.c}, args.json)
    if args.plot:
        from ssd.tools.ablation.plots import plot_miss_vs_fanout  # matplotlib (the tools extra)

        print(f"plot: {plot_miss_vs_fanout(points, fit, args.plot)}")


def cmd_plan(args: argparse.Namespace, config: Config) -> None:
    data, spec = _replay_inputs(args, config)
    costs = _load_costs(args.costs)
    try:
        grid = planner.candidates(data.greedy, args.ks, args.budgets, args.cs, args.kinds)
        plan = planner.recommend(data, costs, tqdm(grid, desc="plan", file=sys.stderr), spec,
                                 args.samples, args.replay_seed)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    _print_header(data, spec)
    print(f"AR {plan.ar.tokens_per_s:.2f} tok/s; SD at its best K={plan.sd.k}: {plan.sd.speed.tokens_per_s:.2f} tok/s "
          f"({plan.sd.speed.speedup_vs_ar:.2f}x AR, {plan.sd.tokens_per_round:.2f} tok/round)")
    rows = [e.as_dict() for e in plan.top(args.top)]
    print(report.table(rows, report.REPLAY_COLUMNS + report.SPEED_COLUMNS))
    if args.json:
        report.write_json({"ar_tokens_per_s": plan.ar.tokens_per_s, "sd": dataclasses.asdict(plan.sd),
                           "ranked": [e.as_dict() for e in plan.ranked]}, args.json)


def cmd_compare(args: argparse.Namespace, config: Config) -> None:
    trace = _load_trace(args.trace)
    spec = _base_spec(config)
    for role in ("target", "draft"):
        if getattr(trace.meta, role) and getattr(trace.meta, role) != _model_info(config, role):
            log.warning("the trace's %s %s differs from the config's %s", role, getattr(trace.meta, role),
                        _model_info(config, role))
    pair = load_pair(config)
    with tqdm(total=len(trace.sequences), desc="live ssd", file=sys.stderr) as bar:
        result = compare(pair, trace, spec, args.samples, args.replay_seed, progress=bar.update)
    print(f"K={spec.k}, {spec.fanout.kind} B={spec.fanout.budget}, C={spec.saguaro_c}, "
          f"T={trace.meta.temperature:g}, {len(trace.sequences)} sequences")
    rows = [{"source": name, **row} for name, row in result.items()]
    print(report.table(rows, [("source", "", "<9"), ("hit_rate", "hit rate", ">8.3f"),
                              ("acceptance_rate", "accept", ">7.3f"), ("tokens_per_round", "tok/round", ">9.2f"),
                              ("lookups", "lookups", ">8"), ("rounds", "rounds", ">7")]))
    if args.json:
        report.write_json(result, args.json)


# ---------------------------------------------------------------------------
# Helpers


def cmd_backups(args: argparse.Namespace, config: Config) -> None:
    """Fig. 6 (left) of the SSD paper on this machine: see ssd.tools.ablation.backup_crossover."""
    from ssd import hardware
    from ssd.tools.ablation.backup_crossover import format_crossover, measure_crossover, predict
    from ssd.tools.ablation.plots import plot_backup_crossover
    from ssd.tools.prompts import load_prompt_set

    pair = load_pair(config)
    prompts = [p.encode(pair.tokenizer) for p in load_prompt_set(args.prompt_file)]
    neural, fast = args.backups
    with tqdm(total=2 * len(args.batch_sizes), desc="backup x batch size") as bar:
        points = measure_crossover(pair, config, prompts, [neural, fast], args.batch_sizes,
                                   config.generation.max_new_tokens, bar.update)
    prediction = predict(points, config.speculation.k, fast=fast, neural=neural)
    print(hardware.summary())
    print(format_crossover(points, prediction))
    if args.plot:
        print(f"wrote {plot_backup_crossover(points, prediction, args.plot)}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": hardware.describe(), "rows": [p.row() for p in points], "b_star": prediction.b_star,
            "measured_crossover": prediction.measured_crossover,
            "predicted_speedup": {k: {str(b): s for b, s in v.items()} for k, v in prediction.speedups.items()},
        }, indent=2))


def _base_spec(config: Config) -> SpeculationConfig:
    spec = config.speculation
    if spec.backup_for(batch_size=1) != "neural":
        sys.exit(f"error: --backup: replays model the neural backup only, got {spec.backup_for(1)!r}")
    # Replays model builds of a fixed budget holding the draft's entries only: the
    # live runs they are compared with build the same (no anytime cut, no n-gram entries).
    fanout = dataclasses.replace(spec.fanout, anytime=False)
    return dataclasses.replace(spec, mode="ssd", fanout=fanout, ngram_candidates=False)


def _replay_inputs(args: argparse.Namespace, config: Config) -> tuple[ReplayData, SpeculationConfig]:
    return ReplayData(_load_trace(args.trace)), _base_spec(config)


def _load_trace(path: Path) -> Trace:
    try:
        return load_trace(path)
    except (OSError, ValueError) as exc:
        sys.exit(f"error: --trace: {exc}")


def _load_costs(path: Path) -> costs_mod.Costs:
    try:
        return costs_mod.load_costs(path)
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"error: --costs: {exc}")


def _model_info(config: Config, role: str) -> dict:
    m = getattr(config, role)
    return {"name": m.name, "dtype": m.dtype, "quantization": m.quantization}


def _print_header(data: ReplayData, spec: SpeculationConfig) -> None:
    m = data.meta
    print(f"trace: {len(data.sequences)} sequences, T={m.temperature:g}, max_new_tokens={m.max_new_tokens}, "
          f"target {m.target.get('name', '?')}, draft {m.draft.get('name', '?')}; base K={spec.k}, "
          f"{spec.fanout.kind} B={spec.fanout.budget}, C={spec.saguaro_c}")


COMMANDS = {"record": cmd_record, "costs": cmd_costs, "sweep": cmd_sweep, "fit": cmd_fit,
            "plan": cmd_plan, "compare": cmd_compare, "backups": cmd_backups}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    COMMANDS[args.command](args, config)

