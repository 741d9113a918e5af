"""What a precision buys in speed and costs in quality, on this host.

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
"""

from __future__ import annotations

import math
import statistics
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

# CPython standard library modules none of the prompt sets are cut from.
HELD_OUT_FILES = ("calendar.py", "difflib.py", "queue.py")


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
        if k is not None:
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
