"""AR, SD, SSD and HuggingFace assisted generation side by side on the same
prompts, model pair, dtypes and max tokens; prints one ratio table per
(prompt set, temperature) and can write JSON, CSV and a PNG plot.

    python launch/bench.py                          # AR and SD at the config's K, code prompts
    python launch/bench.py --ks 3 --ks 4 --ks 6 --prompts 3 --max-new-tokens 64
    python launch/bench.py --modes ar sd hf ssd --thread-counts 1 2 --cluster \\
        --temperatures 0 0.7 --prompt-sets code chat --json bench.json --csv bench.csv --plot bench.png

Modes: ar, sd, ssd (ours) and hf (transformers `generate(assistant_model=...)`
on the same loaded target and draft, drafting exactly K tokens a round:
num_assistant_tokens=K, schedule "constant", no confidence cut-off).
--thread-counts runs the in-process modes once per thread count (each row
labelled with it); ratios are to the best AR and best SD of the same prompt
set and temperature. --cluster runs SSD through the distributed runtime
(target on core 0, draft on core 1, gloo link) instead of in-process threads;
without --ks at the start-up plan's settings (what launch/cluster.py runs
with no flags, where the config asks for a plan), else at each K.
--prompt-sets takes names of configs/prompts/<name>.yaml or paths; chat
entries go through the tokenizer's chat template when it has one.

Each mode gets one warm-up generation; tokens/s counts decode only (after
the first token; for HF after its first round, which admits several). At
T > 0 prompt i is sampled with seed (sampling.seed + i) in every mode.
The physical limit (every round a hit) is E[tokens/round] / T_verify from
the SSD row (or SD without SSD); "x limit" is each row's share of it.

--concurrency runs the serving benchmark instead: a gRPC server on loopback
over the loaded pair, N streaming clients at once (closed loop, each sending
--requests-per-client requests), every mode batched (continuous batching)
and the config's mode one request at a time (batching.max_rows 1: the
server as it was before batching), with total tokens/s, TTFT and per-token
inter-token latency (p50/p99); "x base" is throughput over that
one-at-a-time row at the same concurrency:

    python launch/bench.py --concurrency 1 2 4 8 --modes ar sd --max-new-tokens 64
    python launch/bench.py --concurrency 1 2 4 8 --cluster --modes ar sd --thread-counts 1 2

With --cluster, AR and SSD run batched through the distributed runtime (AR
on the target's core: the baseline; SSD with the start-up plan's settings,
the draft on a core of its own) and the in-process modes at each
--thread-counts (1: the paper's setting, 2: equal hardware).

--background-load runs one busy process at nice 19 for the whole
measurement (ssd.tools.bench.background); every table says which condition it
was measured under.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from ssd.tools.bench.background import busy_background
from ssd.tools.bench.background import describe as describe_background
from ssd.tools.prompts import load_prompt_set
from ssd.tools.bench.report import format_tables, plot_throughput, summarize, write_csv, write_json
from ssd.tools.bench.runner import MODES, SSD_VARIANTS, UNSPECULATIVE, BenchPlan, Results, run_bench
from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args
from ssd.factory import load_pair


def main(argv: list[str] | None = None) -> Results:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if args.concurrency:
        return serving(args, config)
    plan = BenchPlan(
        modes=args.modes,
        ks=args.ks or [config.speculation.k],
        temperatures=args.temperatures or [config.sampling.temperature],
        prompt_sets=_prompt_sets(args),
        thread_counts=args.thread_counts or [0],
        cluster_ssd=args.cluster,
        cluster_planned=args.cluster and not args.ks,
        ssd_variants=args.ssd_variants or (),
        ssd_grid=args.ssd_grid or (),
        sd_ks=args.sd_ks or (),
        progress=not args.no_progress,
    )
    pair = load_pair(config, with_draft=any(m not in UNSPECULATIVE for m, _ in plan.local_runs()))
    with busy_background(args.background_load):
        results: Results = run_bench(pair, config, plan)
    rows, limits = summarize(results)
    print(describe_background(args.background_load))
    print(format_tables(rows, limits))
    if args.json:
        write_json(args.json, results, rows, limits, _settings(args, config, plan))
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot_throughput(args.plot, rows, limits)
    return results


def serving(args: argparse.Namespace, config) -> list:
    """The serving benchmark (--concurrency): see the module docstring."""
    from ssd.tools.bench.serving import ServingPlan, format_serving_table, run_serving_bench

    variants, baseline = _serving_variants(args, config)
    prompts = [p.text for prompt_set in _prompt_sets(args).values() for p in prompt_set if not p.chat]
    local = [v for v in variants if not v.cluster]
    pair = load_pair(config, with_draft=any(v.mode != "ar" for v in local) or args.adaptive) if local else None
    if args.adaptive:  # K by batch size from batched SD measured here, on these prompts
        config = _adaptive(args, config, pair, prompts, variants)
    plan = ServingPlan(
        variants=list(dict.fromkeys(variants)), concurrencies=args.concurrency, prompts=prompts,
        requests_per_client=args.requests_per_client, max_new_tokens=config.generation.max_new_tokens,
        temperature=(args.temperatures or [config.sampling.temperature])[0], progress=not args.no_progress,
    )
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(_ssd_cluster(config)) if args.cluster else None
        if cluster is not None:
            print(f"cluster: SSD runs with K={cluster.config.speculation.k}, "
                  f"budget={cluster.config.speculation.fanout.budget}, glue={cluster.config.speculation.glue}, "
                  f"k_policy={cluster.config.speculation.k_policy}, "
                  f"batch_budget={cluster.config.speculation.fanout.batch_budget}; "
                  f"link round trip {cluster.link_round_trip_s * 1e3:.2f} ms", flush=True)
        stack.enter_context(busy_background(args.background_load))
        results = run_serving_bench(pair, config, plan, cluster)
    print(describe_background(args.background_load))
    print(format_serving_table(results, baseline.label))
    for result in results:
        if result.errors:
            print(f"{result.label} at {result.concurrency} clients: {len(result.errors)} errors, e.g. {result.errors[0]}",
                  file=sys.stderr)
    if args.json:
        import json

        args.json.write_text(json.dumps({"machine": hardware_summary(), "rows": [r.row() for r in results],
                                         "settings": _settings(args, config, None)}, indent=2))
    return results


def _serving_variants(args: argparse.Namespace, config) -> tuple[list, object]:
    """The rows and the baseline. Without --cluster: the config's mode one request at a
    time, then every mode batched. With it: AR and SSD batched through the cluster (AR on
    the target's core is the baseline), then the in-process modes at each thread count."""
    from ssd.tools.bench.serving import Variant

    ks = args.ks or [config.speculation.k]
    threads = args.thread_counts or [None]
    local = [Variant(m, k if m != "ar" else None, threads=t) for m in args.modes if not (args.cluster and m == "ssd")
             for k in (ks if m != "ar" else [None]) for t in threads]
    if args.cluster:
        baseline = Variant("ar", cluster=True)
        return [baseline, Variant("ssd", cluster=True), *local], baseline
    baseline = Variant(config.speculation.mode, batched=False)
    return [baseline, *local], baseline


def _adaptive(args: argparse.Namespace, config, pair, prompts: list[str], variants: list):
    from ssd.tools.ablation.calibrate import calibrate_direct
    from ssd.tools.bench.serving import Variant

    ks = args.ks or [config.speculation.k]
    encoded = [pair.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    table, policy = calibrate_direct(pair, config, encoded, sorted(set(args.concurrency)),
                                     sorted({0, *ks, *(k + 2 for k in ks)}), 32, not args.no_progress)
    print(table, f"\nk_policy = {policy}", flush=True)
    variants.append(Variant("sd", adaptive=True))
    return dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, k_policy=policy))


@contextlib.contextmanager
def _ssd_cluster(config):
    """The distributed runtime in SSD mode (target on core 0, draft on core 1), planned at start."""
    from ssd.cluster.devices import default_cpu_placement
    from ssd.cluster.runtime import Cluster

    ssd_config = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, mode="ssd"))
    with Cluster(ssd_config, default_cpu_placement(os.cpu_count() or 2, with_draft=True)) as cluster:
        yield cluster


def hardware_summary() -> str:
    from ssd import hardware

    return hardware.summary()


def _grid_point(text: str) -> tuple[int, int]:
    try:
        k, budget = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid point is K:BUDGET (e.g. 2:4), got {text!r}") from None
    if k < 1 or budget < 1:
        raise argparse.ArgumentTypeError(f"K and budget are >= 1, got {text!r}")
    return k, budget


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-sets", dest="prompt_sets", nargs="+", default=["code"],
                        help="prompt sets: names in configs/prompts/ or YAML paths (default: code)")
    parser.add_argument("--prompt-file", type=Path, help="one prompt file (overrides --prompt-sets)")
    parser.add_argument("--prompts", type=int, default=3, help="how many prompts of each set")
    parser.add_argument("--ks", type=int, action="append", help="K values for SD/SSD/HF (repeatable)")
    parser.add_argument("--sd-ks", dest="sd_ks", nargs="+", type=int,
                        help="K values for SD only (default: --ks); with --cluster, SSD still plans")
    parser.add_argument("--modes", nargs="+", default=["ar", "sd"], choices=MODES)
    parser.add_argument("--temperatures", nargs="+", type=float,
                        help="sampling temperatures, one table each (default: the config's)")
    parser.add_argument("--thread-counts", dest="thread_counts", nargs="+", type=int,
                        help="torch thread counts for the in-process modes (default: torch's)")
    parser.add_argument("--cluster", action="store_true", help="run SSD through the distributed runtime")
    parser.add_argument("--ssd-variants", dest="ssd_variants", nargs="+", choices=SSD_VARIANTS,
                        help="with --cluster and no --ks: SSD also with parts of its adaptive build off, in the same "
                             "cluster, interleaved (static: no anytime build, no free n-gram entries)")
    parser.add_argument("--ssd-grid", dest="ssd_grid", nargs="+", type=_grid_point, metavar="K:BUDGET",
                        help="with --cluster and no --ks: SSD also at these fixed (K, budget) points, nothing "
                             "adaptive, in the same cluster, interleaved (e.g. 1:1 2:2 2:4 3:4)")
    parser.add_argument("--json", type=Path, help="write everything (machine, aggregates, per-run stats) here")
    parser.add_argument("--csv", type=Path, help="write the aggregate rows here")
    parser.add_argument("--plot", type=Path, help="write a PNG of tokens/s by mode here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--background-load", dest="background_load", action="store_true",
                        help="run one busy process at nice 19 for the whole measurement (robustness)")
    parser.add_argument("--concurrency", nargs="+", type=int,
                        help="serving benchmark: concurrent streaming clients, e.g. 1 2 4 8 (see above)")
    parser.add_argument("--adaptive", action="store_true",
                        help="serving benchmark: measure speculation.k_policy here first (launch/calibrate.py, "
                             "direct) and add an 'sd adaptive' row that runs with it")
    parser.add_argument("--requests-per-client", dest="requests_per_client", type=int, default=2,
                        help="serving benchmark: requests each client sends in turn")
    add_config_args(parser)
    return parser


def _prompt_sets(args: argparse.Namespace) -> dict:
    if args.prompts < 1:
        sys.exit("error: --prompts must be >= 1")
    files = [args.prompt_file] if args.prompt_file else [_prompt_path(name) for name in args.prompt_sets]
    try:
        return {path.stem: load_prompt_set(path, args.prompts) for path in files}
    except (OSError, ValueError) as exc:
        sys.exit(f"error: {exc}")


def _prompt_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix in (".yaml", ".yml") else PROMPT_DIR / f"{name}.yaml"


def _settings(args: argparse.Namespace, config, plan: BenchPlan | None) -> dict:
    """What the run was asked to do, for the JSON file (plan None: the serving benchmark)."""
    asked = {"concurrency": args.concurrency, "requests_per_client": args.requests_per_client, "modes": args.modes,
             "ks": args.ks, "batching": dataclasses.asdict(config.batching)} if plan is None else {
        "modes": list(plan.modes), "ks": list(plan.ks), "temperatures": list(plan.temperatures),
        "thread_counts": list(plan.thread_counts), "cluster": plan.cluster_ssd,
        "prompt_sets": {name: len(prompts) for name, prompts in plan.prompt_sets.items()},
    }
    return {
        "config": str(args.config), **asked, "background_load": args.background_load,
        **{role: {"name": m.name, "dtype": m.dtype, "quantization": m.quantization}
           for role, m in (("target", config.target), ("draft", config.draft))},
        "max_new_tokens": config.generation.max_new_tokens,
        "sampling": {"top_k": config.sampling.top_k, "top_p": config.sampling.top_p, "seed": config.sampling.seed,
                     "coupling": config.sampling.coupling},
        "fanout": {"kind": config.speculation.fanout.kind, "budget": config.speculation.fanout.budget},
    }

