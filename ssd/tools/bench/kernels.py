"""What extra rows cost on the CPU: ssd's GGUF kernels against llama.cpp, on the same GGUF file.

For each model and thread count, forwards of 1, 2, 4, 8 and 16 tokens after a
prefix in the KV cache, the two backends interleaved (a round of every row
count on one, then on the other, repeated; each round opens with an untimed
forward), median ms per forward and steps
(x the same backend's one-token forward). Also whether each backend's rows are
bit-identical alone and together: the logits of a 16-token forward against the
same positions fed one token at a time (what the engines' exactness needs).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import torch

from ssd import hardware
from ssd.config import ModelConfig
from ssd.models import load_model
from ssd.models.backend import ops_of

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16)
BACKENDS = {"kernels": dict(backend="torch", quantization="gguf"), "llama.cpp": dict(backend="llamacpp")}


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    backend: str
    threads: int
    rows: int
    ms: float
    steps: float


def load(name: str, backend: str) -> Any:
    return load_model(ModelConfig(name=name, **BACKENDS[backend]))


def sequence(model: Any):
    ops = ops_of(model)
    return ops.new_sequence(ops.sequence_source(model, rows=1, max_tokens=64, kv_tokens=2048), 0)


def timed_forwards(seq, prefix: list[int], tokens: list[int], repeats: int) -> dict[int, list[float]]:
    """Seconds of each forward of `n` tokens (n in ROWS) after `prefix`, rolled back each time."""
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for _ in range(repeats):
        seq.forward(tokens[:1])  # untimed: the other backend's round left the caches and threads cold
        seq.rollback(len(prefix))
        for n in ROWS:
            started = time.perf_counter()
            seq.forward(tokens[:n])
            times[n].append(time.perf_counter() - started)
            seq.rollback(len(prefix))
    return times


def rows_invariant(seq, prefix: list[int], tokens: list[int]) -> bool:
    together = seq.forward(tokens)
    seq.rollback(len(prefix))
    alone = torch.cat([seq.forward([t]) for t in tokens])
    seq.rollback(len(prefix))
    return torch.equal(together, alone)


def measure(names: list[str], threads: list[int], prefix_len: int, repeats: int,
            progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    rows, invariant = [], {}
    for name in names:
        models = {backend: load(name, backend) for backend in BACKENDS}
        model = models["kernels"]
        vocab = ops_of(model).vocab_size(model)
        prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
        tokens = torch.randint(0, vocab, (max(ROWS),), generator=gen).tolist()
        for count in threads:
            seqs = {}
            torch.set_num_threads(count)  # both follow it: the kernels' pool and llama.cpp's contexts
            for backend, model in models.items():
                seqs[backend] = sequence(model)
                seqs[backend].forward(prefix)
            times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in ROWS} for b in models}
            for round_ in range(repeats):  # interleaved: one round per backend, in turn
                for backend, seq in seqs.items():
                    for n, t in timed_forwards(seq, prefix, tokens, 1).items():
                        times[backend][n] += t
                progress(f"{name}, {count} thread(s): round {round_ + 1}/{repeats}")
            for backend, seq in seqs.items():
                step = statistics.median(times[backend][1])
                for n in ROWS:
                    ms = statistics.median(times[backend][n])
                    rows.append(Row(name, backend, count, n, ms * 1e3, ms / step))
                invariant[f"{name} {backend} {count}t"] = rows_invariant(seq, prefix, tokens)
    return {"host": hardware.summary(), "uptime": hardware.uptime(), "prefix": prefix_len, "repeats": repeats,
            "rows": [dataclasses.asdict(r) for r in rows], "rows_bit_identical_alone_and_together": invariant}


def table(report: dict[str, Any]) -> str:
    lines = [f"host: {report['host']}", f"load: {report['uptime']}",
             f"forward of n tokens after {report['prefix']} cached, median of {report['repeats']}, ms (steps)", ""]
    keys = sorted({(r["model"], r["threads"]) for r in report["rows"]})
    backends = list(BACKENDS)
    lines.append("| model | threads | rows | " + " | ".join(backends) + " |")
    lines.append("|---|---|---|" + "---|" * len(backends))
    for model, threads in keys:
        for n in ROWS:
            cells = []
            for backend in backends:
                match = [r for r in report["rows"] if (r["model"], r["threads"], r["rows"], r["backend"]) ==
                         (model, threads, n, backend)]
                cells.append(f"{match[0]['ms']:.1f} ({match[0]['steps']:.2f})" if match else "-")
            lines.append(f"| {model} | {threads} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "rows bit-identical alone and together (16 tokens vs one at a time):"]
    lines += [f"  {key}: {value}" for key, value in report["rows_bit_identical_alone_and_together"].items()]
    return "\n".join(lines)
