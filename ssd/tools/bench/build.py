"""What SSD's cache build costs against the verification it hides behind, on this host.

All on the loaded pair, one intra-op thread per role (as each role runs in
SSD), after a 200-token context, every probe timed round-robin (each pass
times every probe once; medians), so a host that speeds up or slows down
touches all of them alike (ssd.saguaro.costs.round_robin):
- verify(K): the target's forward of K + 1 tokens;
- build(K, B) per glue (ssd.config.GLUES): "full" is the build before the
  draft reused its own work (a glue pass over t* and K drafts, then K tree
  steps), "reuse" a one-token glue, "fold" K forwards in all;
- rows: b rows' builds at once (ssd.saguaro.builder.build_caches: one packed
  forward per step) against one row's;
- tree steps: one tree step over B branches against a chain step (a
  one-token forward) and the weights-read floor (the draft's weight bytes
  over this host's measured read bandwidth).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ssd import hardware
from ssd.saguaro.costs import CostSettings, build_probe, forward_probe, round_robin
from ssd.config import SamplingConfig
from ssd.models.kv import KVSequence
from ssd.saguaro.branches import TreeBranchDecoder
from ssd.saguaro.builder import BuildJob, build_caches
from ssd.saguaro.cache import DraftWork
from ssd.saguaro.fanout import uniform_fanout

PREFIX = 200


@dataclass
class BuildBench:
    verify_ms: dict[int, float] = field(default_factory=dict)
    build_ms: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    rows_ms: dict[int, float] = field(default_factory=dict)  # b rows built at once
    chain_step_ms: float = 0.0
    tree_step_ms: dict[int, float] = field(default_factory=dict)
    floor_ms: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def ratio(self, glue: str, k: int, budget: int) -> float:
        """build / verify: above 1 the target waits for the draft every round."""
        return self.build_ms[glue][(k, budget)] / self.verify_ms[k]

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta, "verify_ms": self.verify_ms,
            "build_ms": {g: [{"k": k, "budget": b, "ms": v} for (k, b), v in rows.items()] for g, rows in self.build_ms.items()},
            "rows_ms": self.rows_ms, "chain_step_ms": self.chain_step_ms, "tree_step_ms": self.tree_step_ms,
            "floor_ms": self.floor_ms,
        }


def measure(target: torch.nn.Module, draft: torch.nn.Module, ks=(2, 3, 4), budgets=(4, 8), glues=("full", "reuse", "fold"),
            rows=(1, 2, 4), branches=(1, 2, 4, 8, 16), repeats: int = 5, tick: Callable[[], None] = lambda: None) -> BuildBench:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = BuildBench(meta={"machine": hardware.describe(), "threads": 1, "prefix": PREFIX, "repeats": repeats})
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(min(target.config.vocab_size, draft.config.vocab_size), (PREFIX,), generator=gen).tolist()
        tkv, dkv = KVSequence(target), KVSequence(draft)
        tkv.forward(prefix, last_only=True)
        dkv.forward(prefix, last_only=True)
        probes: dict[Any, Any] = {("verify", k): forward_probe(tkv, prefix, k + 1, gen) for k in ks}
        settings = CostSettings(ks=tuple(ks), budgets=tuple(budgets))
        decoder = TreeBranchDecoder()
        for glue in glues:
            glued = dataclasses.replace(settings, glue=glue)
            for k in ks:
                for b in budgets:
                    probes[(glue, k, b)] = build_probe(dkv, decoder, prefix, k, b, draft.config.vocab_size, glued, gen)
        probes[("chain",)] = forward_probe(dkv, prefix, 1, gen)
        for b in branches:
            probes[("tree", b)] = _tree_step_probe(dkv, prefix, b, gen)
        for b in rows:
            probes[("rows", b)] = _rows_probe(draft, prefix, b, k=3, budget=4, gen=gen)
        timed = {key: 1e3 * s for key, s in round_robin(probes, repeats, tick).items()}
        out.verify_ms = {k: timed[("verify", k)] for k in ks}
        out.build_ms = {g: {(k, b): timed[(g, k, b)] for k in ks for b in budgets} for g in glues}
        out.chain_step_ms = timed[("chain",)]
        out.tree_step_ms = {b: timed[("tree", b)] for b in branches}
        out.rows_ms = {b: timed[("rows", b)] for b in rows}
        out.floor_ms = 1e3 * weight_bytes(draft) / read_bandwidth()
        return out
    finally:
        torch.set_num_threads(threads)


def _tree_step_probe(kv: KVSequence, prefix: list[int], b: int, gen: torch.Generator):
    """One tree step over b branches (their first tokens already in the cache)."""
    vocab = kv.model.config.vocab_size
    firsts = torch.randint(vocab, (b,), generator=gen).tolist()
    nexts = torch.randint(vocab, (b,), generator=gen).tolist()
    prefixes = [len(prefix) - (i % 4) for i in range(b)]
    decoder = TreeBranchDecoder()

    def reset() -> None:
        decoder.finish()
        kv.rollback(min(kv.length, len(prefix)))
        if kv.length < len(prefix):
            kv.forward(prefix[kv.length :])
        decoder.start(kv, prefixes, firsts)

    return lambda: (decoder.step(nexts), hardware.sync(kv.model.device)), reset


def _rows_probe(draft: torch.nn.Module, prefix: list[int], b: int, k: int, budget: int, gen: torch.Generator):
    """b rows' folded builds at once, each row after a backup chain of k drafts."""
    vocab = draft.config.vocab_size
    kvs = [KVSequence(draft) for _ in range(b)]
    drafted = [torch.randint(vocab, (k,), generator=gen).tolist() for _ in range(b)]
    logits = [list(torch.randn(k, vocab, generator=gen)) for _ in range(b)]
    fanout = uniform_fanout(k, budget, caps=[vocab - 1] * k + [vocab])

    def reset() -> None:
        for kv, d in zip(kvs, drafted):
            sequence = prefix + d
            kv.trim_to_prefix_of(sequence)
            if kv.length < len(sequence) - 1:
                kv.forward(sequence[kv.length : -1])

    def run() -> None:
        jobs = [BuildJob(kv, TreeBranchDecoder(), prefix, d, fanout, SamplingConfig(), torch.Generator(),
                         work=DraftWork(list(rows)), depth=k, glue="fold") for kv, d, rows in zip(kvs, drafted, logits)]
        for result in build_caches(jobs):
            if isinstance(result, Exception):
                raise result
        hardware.sync(draft.device)

    return run, reset


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token forward reads: every parameter and buffer, plus
    int8 layers' packed weights (one byte each, outside parameters), minus the
    embedding table (a step reads one row of it; tied heads read it whole)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for module in model.modules():
        if hasattr(module, "_packed") and hasattr(module, "in_features"):
            total += module.in_features * module.out_features
    embed = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is embed
    return total if tied else total - embed.numel() * embed.element_size()


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second one thread reads (a sum over a buffer larger than any cache)."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - started)
    return buf.numel() * 4 / statistics.median(times[1:])


def format_bench(bench: BuildBench) -> str:
    lines = [f"machine: {bench.meta['machine']}; one thread per role; medians of {bench.meta['repeats']}"]
    glues = list(bench.build_ms)
    lines.append("K  B  verify ms | " + " | ".join(f"{g} build ms (x verify)" for g in glues))
    for (k, b) in bench.build_ms[glues[0]]:
        cells = " | ".join(f"{bench.build_ms[g][(k, b)]:7.1f} ({bench.ratio(g, k, b):.2f}x)" for g in glues)
        lines.append(f"{k}  {b}  {bench.verify_ms[k]:8.1f} | {cells}")
    one = bench.rows_ms.get(1)
    if one:
        lines.append("rows built at once (fold, K=3, B=4 each): " + ", ".join(
            f"b={b}: {ms:.0f} ms ({ms / one:.2f}x one row, {b} rows alone: {b:.0f}x)" for b, ms in bench.rows_ms.items()))
    lines.append(f"chain step {bench.chain_step_ms:.1f} ms; weights-read floor {bench.floor_ms:.1f} ms; tree step: " + ", ".join(
        f"B={b}: {ms:.1f} ms ({ms / bench.chain_step_ms:.2f}x)" for b, ms in bench.tree_step_ms.items()))
    return "\n".join(lines)
