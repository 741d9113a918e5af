"""What a precision buys in speed and costs in quality, on this host.

    python launch/precision.py                        # fp32, bf16, int8, torch.ao int8: speed and quality
    python launch/precision.py --precisions bf16 int8 --tokens 0     # speed only
    python launch/precision.py --precisions fp32 int8 --tokens 2048 --json precision.json
    python launch/precision.py --precisions llama.cpp gguf --no-speed    # ssd's GGUF kernels vs llama.cpp, same file

Speed: one target forward of 1 token (a decode step) and of K+1 tokens (a
verification) after a fixed context, on the lean forward, median of repeats;
their ratio says whether speculation can pay (SD needs a verification to
cost little more than a step).

Each precision of the target scores the same token stream teacher-forced
(chunks of `chunk` tokens, each position conditioned on the true prefix of
its chunk). Reported per precision: perplexity, and top-1 agreement with the
reference precisions' argmax at every position (how often greedy decoding
would pick the same next token). fp32 is the natural reference for the
offline pair: its weights are the q4_k_m values dequantized exactly.

The text is CPython standard library source this Python ships (calendar.py,
difflib.py, queue.py by default; none of the prompt sets comes from them).
One thread unless --threads. "int8-tensor" is torch.ao's dynamic int8 with
one activation scale per call, shown to compare with our per-row scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from ssd import hardware
from ssd.app.cli import add_config_args, config_from_args
from ssd.config import ModelConfig
from ssd.models import load_model, load_tokenizer

# CPython standard library modules none of the prompt sets are cut from.
HELD_OUT_FILES = ("calendar.py", "difflib.py", "queue.py")
# --precisions: name -> (dtype, quantization); int8-tensor is torch.ao's, applied after loading in fp32
PRECISIONS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int8": ("fp32", "int8"), "int8-tensor": ("fp32", None),
              "gguf": ("fp32", "gguf"), "llama.cpp": (None, None)}
# Scored but not timed here (its forwards are not torch modules'): launch/bench_kernels.py times it.
UNTIMED = ("llama.cpp",)


def held_out_text(files: Sequence[str] = HELD_OUT_FILES) -> str:
    """The concatenated source of stdlib `files` from this Python's installation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / name).read_text() for name in files)


@dataclass
class Scores:
    """Teacher-forced results of one precision over the same positions."""

    precision: str
    nll: list[float] = field(default_factory=list)  # -log p(true next token), per position
    argmax: list[int] = field(default_factory=list)  # greedy choice, per position

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll)) if self.nll else float("nan")

    def agreement(self, other: "Scores") -> float:
        same = sum(a == b for a, b in zip(self.argmax, other.argmax))
        return same / len(self.argmax) if self.argmax else float("nan")


def forward_times(model: torch.nn.Module, k: int, prefix: int = 200, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of a 1-token and a (k+1)-token forward after `prefix` cached tokens."""
    from ssd.hardware import sync
    from ssd.models.kv import KVSequence

    kv = KVSequence(model)
    vocab = model.config.vocab_size
    kv.forward([(1000 + i) % vocab for i in range(prefix)], last_only=True)

    def median(n: int) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            sync(kv.forward([(7 + i) % vocab for i in range(n)]))  # the timer covers the device's work
            times.append(time.perf_counter() - started)
            kv.rollback(prefix)
        return statistics.median(times[1:])

    return median(1), median(k + 1)


@torch.inference_mode()
def score(model: torch.nn.Module, precision: str, ids: Sequence[int], chunk: int = 512,
          progress: bool = True) -> Scores:
    """Teacher-forced NLL and argmax at every position that has a true next token in its chunk."""
    out = Scores(precision)
    starts = range(0, len(ids) - 1, chunk)
    for start in tqdm(starts, desc=f"score {precision}", disable=not progress):
        piece = torch.tensor([list(ids[start : start + chunk + 1])])
        logits = model(input_ids=piece[:, :-1]).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = piece[0, 1:]
        out.nll += (-logp.gather(1, target[:, None])[:, 0]).tolist()
        out.argmax += logits.argmax(dim=-1).tolist()
    return out


def compare(
    loaders: dict[str, Callable[[], torch.nn.Module]], ids: Sequence[int], chunk: int = 512,
    progress: bool = True, k: int | None = None,
) -> list[dict[str, Any]]:
    """Measure each precision in turn (one model in memory at a time); one row each.

    Every row has perplexity, its difference to the first precision and top-1
    agreement with each precision (when `ids` is not empty), and with `k` the
    step and verification times.
    """
    rows, scores = [], []
    for precision, load in loaders.items():
        started = time.perf_counter()
        model = load()
        row: dict[str, Any] = {"precision": precision, "load_s": time.perf_counter() - started}
        if k is not None and precision not in UNTIMED:
            step, verify = forward_times(model, k)
            row.update(step_ms=1000 * step, verify_ms=1000 * verify, verify_in_steps=verify / step, k=k)
        if ids:
            scores.append(score(model, precision, ids, chunk, progress))
        rows.append(row)
        del model
    for row, s in zip(rows, scores):
        row.update(
            positions=len(s.nll), perplexity=s.perplexity, perplexity_delta=s.perplexity - scores[0].perplexity,
            **{f"agreement_vs_{o.precision}": s.agreement(o) for o in scores},
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The measured columns of `compare`'s rows as a text table ('-' where not measured)."""
    names = [r["precision"] for r in rows if "perplexity" in r]
    k = next((r["k"] for r in rows if "k" in r), None)
    columns = [("precision", "precision", "<12", "{}"), ("load_s", "load s", ">7", "{:.1f}")]
    if k is not None:
        columns += [("step_ms", "step ms", ">9", "{:.1f}"), ("verify_ms", f"verify {k + 1} ms", ">12", "{:.1f}"),
                    ("verify_in_steps", "in steps", ">9", "{:.2f}")]
    if names:
        columns += [("positions", "positions", ">10", "{}"), ("perplexity", "ppl", ">8", "{:.4f}"),
                    ("perplexity_delta", "d ppl", ">8", "{:+.4f}")]
        columns += [(f"agreement_vs_{n}", f"agree {n}", f">{max(12, len(n) + 8)}", "{:.4f}") for n in names]
    lines = ["".join(f"{title:{align}}" for _, title, align, _ in columns)]
    for r in rows:
        lines.append("".join(
            f"{'-' if r.get(key) is None else fmt.format(r[key]):{align}}" for key, _, align, fmt in columns
        ))
    return "\n".join(lines)


# --- launch/precision.py ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                        help="target precisions to score; the first is the perplexity reference")
    parser.add_argument("--tokens", type=int, default=4096, help="positions to score (0: speed only)")
    parser.add_argument("--no-speed", action="store_true", help="quality only")
    parser.add_argument("--chunk", type=int, default=512, help="teacher-forced chunk length")
    parser.add_argument("--files", nargs="+", default=list(HELD_OUT_FILES), help="stdlib files to score")
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    torch.set_num_threads(config.runtime.threads or 1)
    ids = []
    if args.tokens:
        ids = load_tokenizer(config.target).encode(held_out_text(args.files), add_special_tokens=False)
        ids = ids[: args.tokens + 1]
    loaders = {name: _loader(config.target, name) for name in args.precisions}
    rows = compare(loaders, ids, args.chunk, k=None if args.no_speed else config.speculation.k)
    print(f"machine: {hardware.summary()}; {torch.get_num_threads()} thread(s)")
    print(f"target {config.target.name}" + (f", {len(ids) - 1} positions of {', '.join(args.files)}" if ids else ""))
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": hardware.describe(), "files": args.files, "rows": rows}, indent=2))
    return rows


class LlamaCppScorer:
    """A llama.cpp model behind the one call `score` makes: model(input_ids=[1, n]).logits [1, n, V]."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor):
        from types import SimpleNamespace

        from ssd.models.backend import ops_of

        ops = ops_of(self.model)
        sequence = ops.new_sequence(self.model, 0)
        try:
            return SimpleNamespace(logits=sequence.forward(input_ids[0].tolist())[None])
        finally:
            ops.release(sequence)


def _loader(model_config: ModelConfig, name: str) -> Callable[[], torch.nn.Module]:
    if name == "llama.cpp":  # the same GGUF file on llama.cpp, as the llama.cpp backend loads it
        cfg = dataclasses.replace(model_config, backend="llamacpp", dtype="auto", quantization="auto")
        return lambda: LlamaCppScorer(load_model(cfg))
    dtype, quantization = PRECISIONS[name]
    cfg = dataclasses.replace(model_config, dtype=dtype, quantization=quantization)

    def load() -> torch.nn.Module:
        model = load_model(cfg)
        if name == "int8-tensor":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        return model

    return load
