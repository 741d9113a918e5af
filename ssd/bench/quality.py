"""What a precision costs in quality: perplexity and greedy agreement on held-out text.

Each precision of the target scores the same token stream teacher-forced
(chunks of `chunk` tokens, each position conditioned on the true prefix of
its chunk). Reported per precision: perplexity, and top-1 agreement with the
reference precisions' argmax at every position (how often greedy decoding
would pick the same next token). fp32 is the natural reference for the
offline pair: its weights are the q4_k_m values dequantized exactly.
"""

from __future__ import annotations

import math
import sysconfig
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
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Score each precision in turn (one model in memory at a time); one row each.

    Every row has perplexity, its difference to the first precision, and top-1
    agreement with each precision.
    """
    scores = []
    for precision, load in loaders.items():
        model = load()
        scores.append(score(model, precision, ids, chunk, progress))
        del model
    reference = scores[0]
    return [
        {
            "precision": s.precision,
            "positions": len(s.nll),
            "perplexity": s.perplexity,
            "perplexity_delta": s.perplexity - reference.perplexity,
            **{f"agreement_vs_{o.precision}": s.agreement(o) for o in scores},
        }
        for s in scores
    ]


def format_quality(rows: list[dict[str, Any]]) -> str:
    names = [r["precision"] for r in rows]
    widths = [max(12, len(n) + 8) for n in names]
    header = f"{'precision':<12}{'positions':>10}{'ppl':>9}{'d ppl':>9}" + "".join(
        f"{'agree ' + n:>{w}}" for n, w in zip(names, widths)
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['precision']:<12}{r['positions']:>10}{r['perplexity']:>9.4f}{r['perplexity_delta']:>+9.4f}"
            + "".join(f"{r['agreement_vs_' + n]:>{w}.4f}" for n, w in zip(names, widths))
        )
    return "\n".join(lines)
