"""Coupled (Gumbel) against standard sampling in SSD: acceptance, cache hit rate, tokens/s;
what shared noise costs and buys SSD.

    python launch/ablate_coupling.py --no-plan --prompts 4 --max-new-tokens 48 \
        --temperatures 0.7 1.0 --json docs/results/coupling.json \
        --txt docs/results/coupling.txt --plot docs/results/plots_t07/coupling_tradeoff.png

For each temperature, over the same prompts and seeds, SSD in process (the
speculator on a thread of this process) runs three variants:
- standard: rejection sampling (the default);
- gumbel: coupled sampling, t* guessed by the draft's perturbed scores
  log q + g (ssd.saguaro.builder.guess_scores);
- gumbel, raw guesses: coupled, t* guessed by raw logits as the standard
  sampler does: what the perturbed ranking is worth;
and AR with each coupling, the reference: a row says how many SSD outputs
equal AR's for the same seed (all of them under coupling; by chance only
under standard sampling). Acceptance and hit rate do not depend on timing;
tokens/s does, and the two roles share this process's cores.

Realised acceptance compares runs whose outputs differ (the samplers draw
differently), so `same_contexts` also compares the two samplers on the same
contexts, coupled AR's outputs: per drafted position, the standard sampler's
acceptance probability 1 - TV(p, q), the coupling's P(argmax(log p + g) =
argmax(log q + g)) over many noise seeds, and the bound (1 - TV) / (1 + TV)
that Gumbel sampling never falls below (Daliri, Musco and Suresh,
arXiv:2408.07978).

Part "ssd" is the runs above (SSD's K, budget and glue from the config and
flags), part "contexts" the comparison on the same contexts; the tables name
the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

import ssd.saguaro.builder as builder
from ssd import hardware
from ssd.app.cli import PROMPT_DIR, add_config_args, config_from_args
from ssd.config import Config, SamplingConfig
from ssd.engine.metrics import GenerationStats, total
from ssd.engine.request import GenerationRequest
from ssd.factory import LoadedPair, load_pair, make_engine
from ssd.models.backend import new_sequence, release
from ssd.models.tokenizer import encode_prompt
from ssd.sampling import GumbelNoise, coupled_ids, probs_from_logits

log = logging.getLogger(__name__)

VARIANTS = ("standard", "gumbel", "gumbel-raw-guesses")


@dataclass(frozen=True)
class Row:
    temperature: float
    variant: str
    prompts: int
    new_tokens: int
    acceptance: float
    hit_rate: float
    hit_rate_after_reject: float  # lookups with k < K: t* is the target's token where the draft's was rejected
    hit_rate_bonus: float  # lookups with k = K: t* is the bonus token
    tokens_per_round: float
    ssd_tok_s: float
    ar_tok_s: float
    equal_to_ar: int  # SSD outputs identical to AR's at the same seed


@dataclass(frozen=True)
class SameContexts:
    temperature: float
    positions: int  # drafted positions averaged over
    noise_draws: int
    standard: float  # mean 1 - TV(p, q): rejection sampling's acceptance probability
    coupled: float  # mean P(argmax(log p + g) = argmax(log q + g)) over noise_draws seeds
    bound: float  # mean (1 - TV) / (1 + TV)


@contextlib.contextmanager
def raw_logit_guesses() -> Iterator[None]:
    """Ablation only: the builder guesses t* by raw logits even under coupling."""
    real = builder.guess_scores
    builder.guess_scores = lambda logits, sampling, first: logits
    try:
        yield
    finally:
        builder.guess_scores = real


def run(config: Config, pair: LoadedPair, prompts: Sequence[list[int]], temperatures: Sequence[float],
        progress: Any = None) -> list[Row]:
    """Every (temperature, variant) row; one AR reference per (temperature, coupling)."""
    rows = []
    with make_engine("ssd", pair, config.speculation) as ssd, make_engine("ar", pair, config.speculation) as ar:
        for temperature in temperatures:
            reference: dict[str, list] = {}
            for variant in VARIANTS:
                coupling = "standard" if variant == "standard" else "gumbel"
                sampling = dataclasses.replace(config.sampling, temperature=temperature, coupling=coupling)
                if coupling not in reference:
                    reference[coupling] = _generate(ar, prompts, sampling, config, progress)
                with raw_logit_guesses() if variant.endswith("raw-guesses") else contextlib.nullcontext():
                    outs = _generate(ssd, prompts, sampling, config, progress)
                rows.append(_row(temperature, variant, outs, reference[coupling], config.speculation.k))
    return rows


def same_contexts(config: Config, pair: LoadedPair, prompts: Sequence[list[int]], temperatures: Sequence[float],
                  noise_draws: int = 16) -> list[SameContexts]:
    """Both samplers' acceptance per drafted position on the same contexts: coupled AR's outputs."""
    out = []
    with make_engine("ar", pair, config.speculation) as ar:
        for temperature in temperatures:
            sampling = dataclasses.replace(config.sampling, temperature=temperature, coupling="gumbel")
            outputs = _generate(ar, prompts, sampling, config, None)
            sums = [0.0, 0.0, 0.0]
            positions = 0
            for prompt, result in zip(prompts, outputs):
                ids = [*prompt, *result.token_ids]
                p, q = (probs_from_logits(_scored(model, ids, len(prompt)), sampling)
                        for model in (pair.target, pair.draft))
                vocab = min(p.shape[-1], q.shape[-1])  # the draft's head may be padded
                p, q = p[:, :vocab], q[:, :vocab]
                tv = 0.5 * (p - q).abs().sum(dim=-1)
                where = tuple(range(len(prompt), len(ids)))
                agree = sum((coupled_ids(p, GumbelNoise(s, where)) == coupled_ids(q, GumbelNoise(s, where))).double()
                            for s in range(noise_draws)) / noise_draws
                for i, part in enumerate((1 - tv, agree, (1 - tv) / (1 + tv))):
                    sums[i] += float(part.sum())
                positions += len(where)
            out.append(SameContexts(temperature, positions, noise_draws, *(x / positions for x in sums)))
    return out


def _scored(model, ids: list[int], start: int) -> torch.Tensor:
    """The model's logits for the tokens at positions start .. len(ids) - 1, in float64 on the host."""
    sequence = new_sequence(model)
    try:
        return sequence.forward(ids[:-1])[start - 1 :].to(torch.float64).cpu()
    finally:
        release(sequence)


def _generate(engine, prompts, sampling: SamplingConfig, config: Config, progress) -> list:
    outs = []
    for seed, ids in enumerate(prompts):
        request = GenerationRequest(ids, dataclasses.replace(sampling, seed=sampling.seed + seed), config.generation)
        outs.append(engine.generate(request))
        if progress is not None:
            progress.update()
    return outs


def _row(temperature: float, variant: str, outs: list, reference: list, k: int) -> Row:
    t = total([o.stats for o in outs])
    spec = t.spec
    reject = [kk for kk in spec.lookups_by_k if kk < k]
    return Row(
        temperature=temperature, variant=variant, prompts=len(outs), new_tokens=t.new_tokens,
        acceptance=t.acceptance_rate, hit_rate=spec.hit_rate,
        hit_rate_after_reject=_rate(spec.hits_by_k, spec.lookups_by_k, reject),
        hit_rate_bonus=_rate(spec.hits_by_k, spec.lookups_by_k, [k]),
        tokens_per_round=(t.new_tokens - t.requests) / max(1, t.rounds),
        ssd_tok_s=_decode_rate(t), ar_tok_s=_decode_rate(total([o.stats for o in reference])),
        equal_to_ar=sum(o.token_ids == r.token_ids for o, r in zip(outs, reference)),
    )


def _rate(hits: dict[int, int], lookups: dict[int, int], ks: Sequence[int]) -> float:
    n = sum(lookups.get(k, 0) for k in ks)
    return sum(hits.get(k, 0) for k in ks) / n if n else float("nan")


def _decode_rate(t: GenerationStats) -> float:
    """Tokens after each request's first over the time after it, pooled."""
    seconds = t.total_s - t.time_to_first_token_s
    return (t.new_tokens - t.requests) / seconds if seconds > 0 else 0.0


def table(rows: Sequence[Row]) -> str:
    head = (f"{'T':>4} {'variant':<19} {'accept':>7} {'hit':>6} {'hit k<K':>8} {'hit k=K':>8} "
            f"{'tok/round':>9} {'SSD tok/s':>9} {'AR tok/s':>8} {'== AR':>6}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.temperature:>4.1f} {r.variant:<19} {r.acceptance:>7.3f} {r.hit_rate:>6.3f} "
            f"{r.hit_rate_after_reject:>8.3f} {r.hit_rate_bonus:>8.3f} {r.tokens_per_round:>9.2f} "
            f"{r.ssd_tok_s:>9.2f} {r.ar_tok_s:>8.2f} {r.equal_to_ar:>3}/{r.prompts:<2}"
        )
    return "\n".join(lines)


def contexts_table(rows: Sequence[SameContexts]) -> str:
    lines = [f"{'T':>4} {'positions':>9} {'standard 1-TV':>13} {'coupled':>8} {'(1-TV)/(1+TV)':>13} {'noise seeds':>11}"]
    lines += [f"{r.temperature:>4.1f} {r.positions:>9} {r.standard:>13.3f} {r.coupled:>8.3f} {r.bound:>13.3f} "
              f"{r.noise_draws:>11}" for r in rows]
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: Path) -> Path:
    """Hit rate against acceptance, one point per (variant, T): beside the Saguaro C trade-off plots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    markers = {"standard": "o", "gumbel": "s", "gumbel-raw-guesses": "^"}
    for variant in VARIANTS:
        points = [r for r in rows if r.variant == variant]
        ax.plot([r.acceptance for r in points], [r.hit_rate for r in points], markers[variant] + "-", label=variant)
        for r in points:
            ax.annotate(f"T={r.temperature:g}", (r.acceptance, r.hit_rate), textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="acceptance rate", ylabel="cache hit rate", title="SSD: coupled (Gumbel) vs standard sampling")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)
    return path


def as_json(rows: Sequence[Row], contexts: Sequence[SameContexts], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows],
            "same_contexts": [dataclasses.asdict(c) for c in contexts]}


# --- launch/ablate_coupling.py ------------------------------------------------------------


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
        runs = len(args.temperatures) * len(prompts) * (len(VARIANTS) + 2)
        with tqdm(total=runs, desc="coupling", file=sys.stderr) as bar:
            rows = run(config, pair, prompts, args.temperatures, bar)
    if "contexts" in args.parts:
        contexts = same_contexts(config, pair, prompts, args.temperatures, args.noise_draws)
    s = config.speculation
    header = (f"{machine_line(args.shared)}\n{config.target.name} / {config.draft.name}, SSD in process, "
              f"K={s.k}, budget {s.fanout.budget} {s.fanout.kind}, glue {s.glue}, "
              f"{len(prompts)} prompts x {config.generation.max_new_tokens} tokens")
    text = header
    if rows:
        text += "\n" + table(rows)
    if contexts:
        text += "\n\nacceptance per drafted position on the same contexts (coupled AR's outputs):\n"
        text += contexts_table(contexts)
    print(text)
    _write(args, config, text, header, rows, contexts, len(prompts))


def _write(args: argparse.Namespace, config: Config, text: str, header: str, rows: list[Row],
           contexts: list[SameContexts], prompts: int) -> None:
    """--txt, --json and --plot, each where asked for."""
    if args.txt:
        args.txt.write_text(text + "\n")
    if args.json:
        s = config.speculation
        meta = {"header": header, "machine": hardware.describe(), "shared": args.shared, "k": s.k,
                "budget": s.fanout.budget, "kind": s.fanout.kind, "glue": s.glue, "prompts": prompts,
                "max_new_tokens": config.generation.max_new_tokens, "parts": args.parts}
        args.json.write_text(json.dumps(as_json(rows, contexts, meta), indent=2) + "\n")
    if args.plot and rows:
        plot(rows, args.plot)
