"""Coupled (Gumbel) against standard sampling in SSD: acceptance, cache hit rate, tokens/s.

    python launch/ablate_coupling.py --no-plan --prompts 4 --max-new-tokens 48 \
        --temperatures 0.7 1.0 --json docs/results/coupling.json \
        --txt docs/results/coupling.txt --plot docs/results/plots_t07/coupling_tradeoff.png

Runs SSD in process (its K, budget and glue from the config and flags) and
AR over the same prompts and seeds for each temperature: standard sampling,
coupled sampling, and coupled sampling with t* guessed by raw logits (part
"ssd"); and both samplers' acceptance probability on the same contexts,
coupled AR's outputs (part "contexts"). The study lives in
ssd/tools/ablation/coupling.py; the tables name the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

import torch  # noqa: E402
import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ssd import hardware  # noqa: E402
from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args  # noqa: E402
from ssd.factory import load_pair  # noqa: E402
from ssd.models.tokenizer import encode_prompt  # noqa: E402
from ssd.tools.ablation import coupling  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-file", type=Path, default=PROMPT_DIR / "code.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.7, 1.0])
    parser.add_argument("--parts", nargs="+", choices=["ssd", "contexts"], default=["ssd", "contexts"])
    parser.add_argument("--noise-draws", type=int, default=16, help="contexts: noise seeds per position")
    parser.add_argument("--shared", action="store_true", help="say in the header that the machine was shared")
    parser.add_argument("--json", type=Path, help="write the rows and the machine here")
    parser.add_argument("--txt", type=Path, help="write the table here")
    parser.add_argument("--plot", type=Path, help="write hit rate against acceptance here (PNG)")
    add_config_args(parser)
    return parser


def machine_line(shared: bool) -> str:
    lscpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout
    cpu = lscpu.partition(":")[2].strip()
    return (f"{cpu or hardware.cpu_model()}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"{hardware.describe()['cores']} cores" + ("; machine shared with other jobs: tok/s is noisy" if shared else ""))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    pair = load_pair(config)
    texts = yaml.safe_load(args.prompt_file.read_text())[: args.prompts]
    prompts = [encode_prompt(pair.tokenizer, p) for p in texts]
    rows, contexts = [], []
    if "ssd" in args.parts:
        runs = len(args.temperatures) * len(prompts) * (len(coupling.VARIANTS) + 2)
        with tqdm(total=runs, desc="coupling", file=sys.stderr) as bar:
            rows = coupling.run(config, pair, prompts, args.temperatures, bar)
    if "contexts" in args.parts:
        contexts = coupling.same_contexts(config, pair, prompts, args.temperatures, args.noise_draws)
    s = config.speculation
    header = (f"{machine_line(args.shared)}\n{config.target.name} / {config.draft.name}, SSD in process, "
              f"K={s.k}, budget {s.fanout.budget} {s.fanout.kind}, glue {s.glue}, "
              f"{len(prompts)} prompts x {config.generation.max_new_tokens} tokens")
    text = header
    if rows:
        text += "\n" + coupling.table(rows)
    if contexts:
        text += "\n\nacceptance per drafted position on the same contexts (coupled AR's outputs):\n"
        text += coupling.contexts_table(contexts)
    print(text)
    if args.txt:
        args.txt.write_text(text + "\n")
    if args.json:
        meta = {"header": header, "machine": hardware.describe(), "shared": args.shared, "k": s.k,
                "budget": s.fanout.budget, "kind": s.fanout.kind, "glue": s.glue, "prompts": len(prompts),
                "max_new_tokens": config.generation.max_new_tokens, "parts": args.parts}
        args.json.write_text(json.dumps(coupling.as_json(rows, contexts, meta), indent=2) + "\n")
    if args.plot and rows:
        coupling.plot(rows, args.plot)


if __name__ == "__main__":
    main()
