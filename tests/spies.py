"""Spies on the draft side of SSD, so tests can observe what a setting did:
the speculations each cache build prepared (budget and fan-out kind in the
number of cached outcomes per acceptance length, Saguaro C in their q' rows)
and which branch decoder built them. Each wraps the real code and records;
nothing is replaced."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

import ssd.saguaro.builder as builder_module
import ssd.saguaro.speculator as speculator_module
from ssd.config import SamplingConfig
from ssd.saguaro.branches import BRANCH_DECODERS
from ssd.saguaro.cache import Proposal
from ssd.sampling import Q_DTYPE
from ssd.verify import draft_law

# How far, relative to q', a cached q' row's law (ssd.verify.draft_law) may lie
# from q' recomputed in float64: fresh forwards' rounding, plus the bfloat16 the
# rows are drawn from and shipped in (ssd.sampling.as_drawn: half an ulp, and as
# much again from dividing by the rounded row's sum). Plain q lies > 1e-3 away
# (the tests' power checks).
QPRIME_TOL = 1e-9 + torch.finfo(Q_DTYPE).eps


@dataclass
class Build:
    """One cache build: the outcome being verified and what was prepared for it."""

    committed: list[int]
    drafted: list[int]
    sampling: SamplingConfig
    entries: dict[tuple[int, int], Proposal]

    def per_k(self, big_k: int) -> list[int]:
        """Cached outcomes per acceptance length k = 0..K."""
        counts = Counter(k for k, _ in self.entries)
        return [counts[k] for k in range(big_k + 1)]


def record_builds(monkeypatch: pytest.MonkeyPatch) -> list[Build]:
    """Every cache the speculator builds from now on (in this process), in order."""
    builds: list[Build] = []
    real = speculator_module.build_caches

    def spy(jobs):
        results = real(jobs)
        for job, entries in zip(jobs, results):
            if not isinstance(entries, Exception):
                builds.append(Build(list(job.committed), list(job.drafted), job.sampling, entries))
        return results

    monkeypatch.setattr(speculator_module, "build_caches", spy)
    return builds


def count_decoder_starts(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Branch-decoder runs by kind ("tree", "batched") from now on."""
    starts: Counter = Counter()
    for kind, cls in BRANCH_DECODERS.items():
        name = "open" if hasattr(cls, "open") else "start"  # the tree's builds open a step to run with other rows'

        def start(self, *args, _real=getattr(cls, name), _kind=kind, **kwargs):
            starts[_kind] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, start)
    return starts


@torch.no_grad()
def saguaro_errors(draft: torch.nn.Module, build: Build, c: float, fanout: list[int]) -> list[float]:
    """Largest relative deviation, per cached speculation, of its q rows' law from q' recomputed here.

    Row j of the speculation for outcome (k, t) is the draft's distribution
    after committed + drafted[:k] + [t] + its own first j tokens (one fresh
    forward, temperature 1), with the top-F_j tokens scaled by c and the row
    renormalised (F_j: the fan-out at acceptance length j when the speculation
    is verified).
    """
    assert build.sampling.temperature == 1.0 and not build.sampling.top_k and build.sampling.top_p == 1.0
    errors = []
    for (k, t), speculation in build.entries.items():
        context = build.committed + build.drafted[:k] + [t]
        worst = 0.0
        for j, row in enumerate(speculation.q):
            ids = torch.tensor([context + speculation.tokens[:j]])
            q = torch.softmax(draft(input_ids=ids).logits[0, -1].double(), -1)
            top = torch.topk(q, fanout[j]).indices
            want = q.clone()
            want[top] *= c
            want /= want.sum()
            relative = (draft_law(row[None])[0] - want).abs() / want.clamp(min=1e-300)  # c = 0 zeroes q' entries
            worst = max(worst, float(relative.max()))
        errors.append(worst)
    return errors


class WorkClock:
    """A clock that ticks with the work done, not with time: each forward of a
    model advances it by that model's weight times the tokens it embeds (or
    once per forward, per_call=True). Installed as `time` in a timing module,
    a measured cost becomes an exact count of work, so a test can say which
    forwards a probe timed, and a probe that times the wrong ones fails."""

    def __init__(self, weights: dict[torch.nn.Module, float], per_call: bool = False) -> None:
        self.now = 0.0
        self.calls: Counter = Counter()  # model -> forwards so far
        self._handles = [
            model.get_input_embeddings().register_forward_hook(self._tick(model, weight, per_call))
            for model, weight in weights.items()
        ]

    def _tick(self, model: torch.nn.Module, weight: float, per_call: bool):
        def hook(module, args, output) -> None:
            self.now += weight * (1 if per_call else args[0].numel())
            self.calls[model] += 1

        return hook

    def perf_counter(self) -> float:
        return self.now

    def install(self, monkeypatch: pytest.MonkeyPatch, module) -> None:
        """Replace `module.time` with this clock for the test."""
        monkeypatch.setattr(module, "time", self)

    def __enter__(self) -> "WorkClock":
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:  # the models are session fixtures: leave them unhooked
            handle.remove()


def slow_draft_counting_cuts(monkeypatch: pytest.MonkeyPatch, step_s: float = 0.004) -> list[bool]:
    """Every branch step of the draft's builds `step_s` slower (so that the target's
    outcome arrives mid-build and anytime builds get cut); returns what each anytime
    stop check answered, in order."""
    answers: list[bool] = []
    real_draw, real_call = builder_module._Grower._draw, speculator_module._Cut.__call__

    def slow_draw(self, *args):
        time.sleep(step_s)
        return real_draw(self, *args)

    def seen_call(self):
        answers.append(real_call(self))
        return answers[-1]

    monkeypatch.setattr(builder_module._Grower, "_draw", slow_draw)
    monkeypatch.setattr(speculator_module._Cut, "__call__", seen_call)
    return answers
