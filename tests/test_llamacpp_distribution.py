"""Sampled AR, SD and SSD on the llama.cpp backend draw exactly the target's law: chi-square.

Two weight variants (the `models` fixture), K = 2 on both:
- f32: a random Qwen2 with an 8-token vocabulary and one layer, its q/k/v
  biases and norm weights re-drawn (test_llamacpp._model), exported to GGUF
  F32 and run by llama.cpp (ssd.models.llamacpp); the draft is the same
  model with 20 % relative weight noise, exported the same way. The
  expected law is the torch model's, enumerated exactly (tests/exact.py):
  llama.cpp's logits match torch's to ~1e-6 relative (asserted on the
  prompt within test_llamacpp's REL_TOL), far below what a chi-square test
  of a few thousand draws can see.
- q4_k_m: the same family 256 wide (K-quants take rows of 256; init 0.1, the
  draft's noise 10 %), quantized to Q4_K_M and loaded as this host loads the
  real pair: llama.cpp's repacked layouts where they run, prompt chunks on
  the plain layouts (LlamaCppModel.plain_twin; a 16-token prompt, and every
  draw asserts its prompts ran there). No torch model computes these
  weights, so the law is llama.cpp's own: AR on the target, one token a
  forward, enumerated depth first (exact_marginal_stepwise). The breaks
  below run on f32 only: the samplers are the same code on every weight
  type; the wrong laws run on both. Chi-square as in test_distribution (tests/stats.py):
cells with an expected count below 5 pooled into one, alpha 0.001, fixed
seeds 0..samples - 1, one engine per path running the seeded requests as
rows of one batch (each row draws what it would alone: asserted on the
first seeds of every draw). Each generation records the tokens every round emitted, so a
test asserts where its tested tokens came from.

Paths (measured shares in parentheses):
- AR, T = 1: the joint of tokens 0-2 of 3; 1500 seeds.
- SD, T = 1 and T = 0.9 with top-p 0.9: the joint of tokens 1-3 of 4, round
  1's drafted depths 1-2 and its correction or bonus; 1200 seeds. Round 1
  ends at each acceptance length 0, 1, 2 in >= 5 % of the seeds (asserted;
  T = 1: 26, 19, 55 %), so a rejection at depth 1, accept-then-reject at
  depth 2 and the bonus all occur.
- SSD cache hits, T = 0.8 with top-k 4: budget (K + 1) * V caches every
  outcome, so every lookup hits (asserted); the joint of tokens 4-6 of 7,
  none from the prefill or round 1 (which has no cache; asserted), slots
  0..K each >= 5 % of them (39, 33, 28 %); 600 seeds. The draft builds its
  cache with llama.cpp branches (LlamaCppBranches).
- SSD's neural backup on misses, T = 1: the cache is always empty
  (build_caches patched to build nothing), so every round is a backup round
  (asserted: no hits); tokens 1-3 of 4, slots 0..K each >= 5 % (53, 28,
  19 %); 600 seeds.
- SSD with Saguaro sampling, c = 0.5, T = 1 with top-k 4, budget K + 1: hits
  and misses (neural backup) interleave (asserted; hit rate ~0.5); tokens 4-6
  of 7, none from round 1; 600 seeds. Top-k keeps llama.cpp's enumeration
  of the q4_k_m law at 4^6 leaves. Broken: cache_draws_reversed.

Power, on every path:
- the same draws against a wrong law must fail the same test (p < alpha)
  at the same sample size: the target at 1.25 x the temperature (hotter, so
  a top-p nucleus only grows and no sample falls outside the support: the
  shape of the law decides; measured p 3e-11 on the SSD hit path, < 1e-16 on
  the others), and the draft model's law (p < 1e-180).
- the same pipeline on llama.cpp with one sampling step broken must fail,
  on fewer seeds (fewer only make detection harder): SD verifying with
  `correction_from_p` (a rejection's correction drawn from p, not the
  residual; 400 seeds, p ~ 1e-12), the SSD cache with `cache_draws_reversed`
  (cached tokens at depth >= 2 drawn from q's reversed ranks, shipped with
  q; 200 seeds, p ~ 1e-95), the neural backup with `neural_draws_flat`
  (drafts at depth >= 2 drawn uniformly over q's support; 300 seeds,
  p ~ 1e-58), the breaks of test_distribution and test_ssd_distribution.
  AR has no second sampler to break: its power is the wrong laws'.
The exact paths measured p 0.13-0.94 (f32) and 0.03-0.66 (q4_k_m). On q4_k_m
the hotter target is closer to the true law, so the hit path runs 1200 seeds
and Saguaro's 1500 there (on 600, their wrong laws measured only p 4e-4 and
5e-3); the file runs in ~100 s on one core.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

import ssd.saguaro.speculator as speculator_module  # noqa: E402
from ssd.config import (  # noqa: E402
    BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig,
)
from ssd.engine import AREngine, SDEngine  # noqa: E402
from ssd.engine.request import GenerationRequest  # noqa: E402
from ssd.models import TinyTokenizer  # noqa: E402
from ssd.models.gguf_export import export_gguf  # noqa: E402
from ssd.models.llamacpp import LlamaCppContext, LlamaCppModel, LlamaCppSequence, repack_probe  # noqa: E402
from tests.test_llamacpp import short_prompts_on_the_plain_twin  # noqa: E402,F401 - autouse
from ssd.saguaro.target import SSDEngine  # noqa: E402
from ssd.verify import verify  # noqa: E402
from tests.exact import exact_marginal, exact_marginal_stepwise  # noqa: E402
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue  # noqa: E402
from tests.test_distribution import correction_from_p, run_rows  # noqa: E402
from tests.test_llamacpp import REL_TOL, _model, _quantized  # noqa: E402
from tests.test_ssd_distribution import cache_draws_reversed, neural_draws_flat  # noqa: E402

V = 8
# initializer_range 0.4: next-token laws peaked enough for power, flat enough
# that the whole cells carry most of the mass (measured: >= 85 %).
CFG = TinyModelConfig(vocab_size=V, num_hidden_layers=1, initializer_range=0.4, seed=4)
NOISE = 0.2  # the draft: every acceptance length of a round is common
PROMPT = [0, 1, 2]
K = 2
# The wrong law: the target at temperature x this. Hotter, never colder: a
# colder top-p nucleus drops tokens, and a sample outside the support fails
# outright instead of by the shape of the law.
WRONG_TEMPERATURE = 1.25
TOKENIZER = TinyTokenizer(V)
# Q4_K_M: K-quants take rows of 256; the smaller init keeps the laws' shape at that width
# (first-token acceptance 0.47-0.87, top probability 0.3-0.83 after four prompts).
Q4_CFG = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, initializer_range=0.1)
Q4_NOISE = 0.1
Q4_PROMPT = [(3 * i + 1) % V for i in range(16)]  # longer than a repacked target's invariant ubatch: a prompt chunk


@dataclass(frozen=True)
class Window:
    """Which generated tokens a test reads, out of how many."""

    n_tokens: int
    positions: tuple[int, ...]


@dataclass
class Draws:
    samples: list[tuple[int, ...]] = field(default_factory=list)  # tokens at the window, one tuple per seed
    first_round: Counter = field(default_factory=Counter)  # tokens round 1 emitted - 1 (its accepted drafts) -> seeds
    slots: Counter = field(default_factory=Counter)  # slot of each tested token in its round -> count
    from_round_1: int = 0  # tested tokens the prefill or round 1 emitted
    hits: int = 0
    lookups: int = 0
    prompts_apart: int = 0  # prompt chunks the target ran on its plain layouts (LlamaCppModel.plain_twin)


@dataclass(frozen=True)
class Path:
    engine: Callable  # (target, draft, verifier) -> an engine
    sampling: SamplingConfig
    window: Window
    samples: int
    broken: Callable | None = None  # breaks this path alone: (monkeypatch) -> verifier or None
    broken_samples: int = 0  # seeds for the broken run
    always_miss: bool = False  # the draft's cache never holds anything: every round a backup round
    interleaved: bool = False  # hits and misses both (a budget below the outcomes)

    @property
    def broken_name(self) -> str:
        return self.broken.__name__ if self.broken else ""


def ssd_spec(budget: int, saguaro_c: float = 1.0) -> SpeculationConfig:
    # Builds to their budget and the draft's entries only: each path isolated, and a row
    # draws what it would alone (an anytime build's cut depends on timing).
    fanout = FanoutConfig(budget=budget, anytime=False)
    return SpeculationConfig(mode="ssd", k=K, fanout=fanout, backup="neural", ngram_candidates=False,
                             saguaro_c=saguaro_c)


# The seeds of a draw run as rows of one batch, ROWS at a time; every row owns
# its streams, so it draws what it would alone: the first ALONE seeds of every
# draw, broken ones included, run again one at a time and must give the same tokens.
ROWS = 16
ALONE = 12
BATCH = BatchingConfig(max_rows=ROWS)


def sd_engine(target, draft, verifier=verify):
    return SDEngine(target, draft, TOKENIZER, SpeculationConfig(mode="sd", k=K), BATCH, verifier=verifier)


def ssd_engine(budget: int, saguaro_c: float = 1.0):
    return lambda target, draft, verifier=verify: SSDEngine.in_process(
        target, draft, TOKENIZER, ssd_spec(budget, saguaro_c), BATCH, verifier=verifier)


def breaks_verifier(verifier):
    """Verification broken: the engine is built with `verifier`."""
    def apply(monkeypatch):
        return verifier
    apply.__name__ = verifier.__name__
    return apply


def breaks_draft(patch):
    """The draft side broken: `patch(monkeypatch)` (a test_ssd_distribution break)."""
    def apply(monkeypatch):
        patch(monkeypatch)
        return None
    apply.__name__ = patch.__name__
    return apply


T1 = SamplingConfig(temperature=1.0)
FIRST_ROUND = Window(K + 2, (1, 2, 3))  # round 1's slots 0..K
LATE = Window(2 * K + 3, (K + 2, K + 3, K + 4))  # past round 1, which ends by token K + 1


def ar_engine(target, draft, verifier=verify):
    return AREngine(target, TOKENIZER, BATCH)


PATHS = {  # seeds measured to fit the file in ~40 s on one core with p-value margins of many orders
    "ar t1.0": Path(ar_engine, T1, Window(3, (0, 1, 2)), 1500),
    "sd t1.0": Path(sd_engine, T1, FIRST_ROUND, 1200, breaks_verifier(correction_from_p), 400),
    "sd t0.9 top-p 0.9": Path(sd_engine, SamplingConfig(temperature=0.9, top_p=0.9), FIRST_ROUND, 1200,
                              breaks_verifier(correction_from_p), 400),
    "ssd-hit t0.8 top-k 4": Path(ssd_engine((K + 1) * V), SamplingConfig(temperature=0.8, top_k=4), LATE, 600,
                                 breaks_draft(cache_draws_reversed), 200),
    "ssd-neural-backup t1.0": Path(ssd_engine((K + 1) * V), T1, FIRST_ROUND, 600, breaks_draft(neural_draws_flat),
                                   300, always_miss=True),
    # top-k 4: llama.cpp's law of tokens 4-6 is enumerated one forward a prefix (4^6 leaves, not 8^6)
    "ssd-saguaro-c0.5 t1.0 top-k 4": Path(ssd_engine(K + 1, saguaro_c=0.5), SamplingConfig(temperature=1.0, top_k=4),
                                          LATE, 600,
                                  breaks_draft(cache_draws_reversed), 200, interleaved=True),
}


def report(models: Models, name: str, variant: str, samples: int, p: float) -> None:
    """One row of the p-value table (path, setting, variant, seeds, p)."""
    path, setting = name.split(" ", 1)
    report_pvalue(f"llama.cpp {models.name} {path.replace('-', ' ')}", setting, variant, samples, p)


@dataclass(frozen=True)
class Models:
    """A variant's llama.cpp pair, its prompt, and where its exact laws come from."""

    name: str
    target: LlamaCppModel
    draft: LlamaCppModel
    prompt: list[int]
    law_models: dict[str, object]  # role -> a torch model (exact_marginal) or the LlamaCppModel itself
    seeds: dict[str, int] = field(default_factory=dict)  # a path's seeds where its own (power) need more

    def law(self, role: str, sampling: SamplingConfig, window: Window) -> dict[tuple[int, ...], float]:
        key = (self.name, role, dataclasses.astuple(sampling), window)
        if key not in _EXACT:
            model, n, positions = self.law_models[role], window.n_tokens, list(window.positions)
            if isinstance(model, LlamaCppModel):
                _EXACT[key] = exact_marginal_stepwise(llamacpp_next_logits(model, self.prompt), n, sampling, positions)
            else:
                _EXACT[key] = exact_marginal(model, self.prompt, n, sampling, positions)
        return _EXACT[key]


def llamacpp_next_logits(model: LlamaCppModel, prompt: list[int]) -> Callable[[list[int]], torch.Tensor]:
    """AR on `model`: the prompt's prefill, then one forward per token (rolled back to the
    parent between siblings of exact_marginal_stepwise's depth-first walk)."""
    sequence = LlamaCppSequence(model)

    def next_logits(prefix: list[int]) -> torch.Tensor:
        full = prompt + prefix
        sequence.trim_to_prefix_of(full)
        return sequence.catch_up(full)

    return next_logits


def f32_models(directory) -> Models:
    """F32 GGUF exports of the torch pair; the law is the torch target's."""
    target, draft = _model(CFG), _model(dataclasses.replace(CFG, noise=NOISE))
    lm_target = LlamaCppModel(export_gguf(target, directory / "target.gguf"))
    lm_draft = LlamaCppModel(export_gguf(draft, directory / "draft.gguf"))
    with torch.no_grad():
        want = target(torch.tensor([PROMPT])).logits[0]
    got = LlamaCppSequence(lm_target).forward(PROMPT)
    assert ((got - want).abs().max() / want.abs().max()).item() < REL_TOL  # the same law
    return Models("f32", lm_target, lm_draft, PROMPT, {"target": target, "draft": draft})


def q4_models(directory) -> Models:
    """The pair quantized to Q4_K_M, loaded as this host runs the real pair: repacked
    layouts where they run, prompt chunks on the plain layouts. The law is llama.cpp's
    own, enumerated through AR on the target (no torch model computes these weights)."""
    files = []
    for name, cfg in (("target", Q4_CFG), ("draft", dataclasses.replace(Q4_CFG, noise=Q4_NOISE))):
        f32 = export_gguf(_model(cfg), directory / f"{name}-f32.gguf")
        files.append(_quantized(f32, directory / f"{name}-q4.gguf", "LLAMA_FTYPE_MOSTLY_Q4_K_M", repacked=False).path)
    repacked = repack_probe(files[0])["runs"]
    target, draft = (LlamaCppModel(f, use_extra_bufts=repacked, plain_prefill=repacked) for f in files)
    assert target.precision == "gguf q4_k_m" and target.repacked == repacked
    # The wrong laws (the target hotter) are closer to these laws: on 600 seeds the hit path
    # measured p 4e-4 and Saguaro's 5e-3, too near or past alpha.
    return Models("q4_k_m", target, draft, Q4_PROMPT, {"target": target, "draft": draft},
                  seeds={"ssd-hit t0.8 top-k 4": 1200, "ssd-saguaro-c0.5 t1.0 top-k 4": 1500})


@pytest.fixture(scope="module", params=["f32", "q4_k_m"])
def models(tmp_path_factory, request) -> Models:
    directory = tmp_path_factory.mktemp("gguf")
    return f32_models(directory) if request.param == "f32" else q4_models(directory)


def draw(models, path: Path, monkeypatch: pytest.MonkeyPatch | None = None, samples: int | None = None) -> Draws:
    """The path's generations on llama.cpp, seeds 0..samples - 1; broken when a monkeypatch is given."""
    with pytest.MonkeyPatch.context() as own:
        verifier = path.broken(monkeypatch) if monkeypatch is not None else None
        if path.always_miss:
            own.setattr(speculator_module, "build_caches", lambda jobs: [{} for _ in jobs])
        apart = spy_prompts_apart(own)
        engine = path.engine(models.target, models.draft, verifier or verify)
        draws = Draws()
        generation = GenerationConfig(max_new_tokens=path.window.n_tokens)
        n = samples or path.samples
        every_rounds: list[list[list[int]]] = [[] for _ in range(n)]  # per seed: the prefill's token, then each round's
        requests = [GenerationRequest(models.prompt, dataclasses.replace(path.sampling, seed=seed), generation,
                                      on_tokens=every_rounds[seed].append) for seed in range(n)]
        try:
            outs = run_rows(engine, requests)
            for request, out in zip(requests[:ALONE], outs):
                alone = engine.generate(dataclasses.replace(request, on_tokens=None))
                assert alone.token_ids == out.token_ids, f"seed {request.sampling.seed}: a row drew other tokens"
            for out, rounds in zip(outs, every_rounds):
                assert out.token_ids == [t for r in rounds for t in r]
                draws.samples.append(tuple(out.token_ids[i] for i in path.window.positions))
                if len(rounds) > 1:
                    draws.first_round[len(rounds[1]) - 1] += 1
                origin = [(r, slot) for r, tokens in enumerate(rounds) for slot in range(len(tokens))]
                for position in path.window.positions:
                    round_index, slot = origin[position]
                    draws.from_round_1 += round_index <= 1
                    draws.slots[slot] += 1
                spec = getattr(out.stats, "spec", None)
                if spec is not None:
                    draws.hits, draws.lookups = draws.hits + spec.hits, draws.lookups + spec.lookups
            draws.prompts_apart = apart[0]
        finally:
            if isinstance(engine, SSDEngine):
                engine.close()
    return draws


def spy_prompts_apart(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the prompt chunks run on a plain twin (LlamaCppContext._prompt_chunk_apart)."""
    calls = [0]
    original = LlamaCppContext._prompt_chunk_apart

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaCppContext, "_prompt_chunk_apart", counted)
    return calls


_DRAWS: dict[str, Draws] = {}
_EXACT: dict[tuple, dict] = {}


def exact_draws(models: Models, name: str) -> Draws:
    """The exact pipeline's draws, once per module and variant: the power tests reuse them."""
    key = f"{models.name} {name}"
    if key not in _DRAWS:
        _DRAWS[key] = draw(models, PATHS[name], samples=models.seeds.get(name))
    return _DRAWS[key]


def wrong_laws(models: Models, path: Path) -> dict[str, dict]:
    hotter = dataclasses.replace(path.sampling, temperature=path.sampling.temperature * WRONG_TEMPERATURE)
    return {f"target at T = {hotter.temperature:.3g}": models.law("target", hotter, path.window),
            "draft model": models.law("draft", path.sampling, path.window)}


def assert_paths_exercised(models: Models, name: str, path: Path, draws: Draws) -> None:
    """Where the tested tokens came from: every verification outcome, the path's own source;
    the prompts ran on the plain layouts where the variant loads them there."""
    n = len(draws.samples)
    if models.target.plain_twin is not None:
        assert draws.prompts_apart >= len(draws.samples), "the prompts did not run on the plain layouts"
    if name.startswith("ar"):
        return
    print(f"\n{name}: round-1 acceptance lengths {dict(sorted(draws.first_round.items()))}, "
          f"slots {dict(sorted(draws.slots.items()))}, {draws.hits} hits / {draws.lookups} lookups")
    if name.startswith("sd"):
        shares = {k: draws.first_round[k] / n for k in range(K + 1)}
        assert min(shares.values()) >= 0.05, f"round-1 acceptance lengths too rare: {shares}"
    if name.startswith("ssd"):
        total = sum(draws.slots.values())
        shares = {slot: draws.slots[slot] / total for slot in range(K + 1)}
        assert min(shares.values()) >= 0.05, f"slots too rare: {shares}"
        assert draws.lookups > 0
        if path.always_miss:
            assert draws.hits == 0  # every round a backup round
        elif path.interleaved:
            assert 0 < draws.hits < draws.lookups  # hit and backup rounds both
            assert draws.from_round_1 == 0
        else:
            assert draws.hits == draws.lookups  # every round after the first hit
            assert draws.from_round_1 == 0  # so every tested token comes from a hit round


@pytest.mark.parametrize("name", PATHS)
def test_llamacpp_sampling_matches_target(models, name):
    path = PATHS[name]
    draws = exact_draws(models, name)
    assert_paths_exercised(models, name, path, draws)
    p = chi_square_pvalue(draws.samples, models.law("target", path.sampling, path.window))
    report(models, name, "exact", len(draws.samples), p)
    assert p > ALPHA, f"llama.cpp {name}: p = {p:.2e}"


@pytest.mark.parametrize("name", PATHS)
def test_the_test_rejects_a_wrong_law(models, name):
    path = PATHS[name]
    draws = exact_draws(models, name)
    for law_name, law in wrong_laws(models, path).items():
        p = chi_square_pvalue(draws.samples, law)
        report(models, name, f"against {law_name}", len(draws.samples), p)
        assert p < ALPHA, f"llama.cpp {name}: {law_name} went undetected: p = {p:.2e}"


BROKEN = [name for name, path in PATHS.items() if path.broken is not None]


@pytest.mark.parametrize("models", ["f32"], indirect=True)  # the samplers are the same code on every weight type
@pytest.mark.parametrize("name", BROKEN)
def test_the_test_rejects_a_broken_sampler(models, monkeypatch, name):
    path = PATHS[name]
    draws = draw(models, path, monkeypatch, path.broken_samples)
    assert_paths_exercised(models, name, path, draws)
    p = chi_square_pvalue(draws.samples, models.law("target", path.sampling, path.window))
    report(models, name, path.broken_name, len(draws.samples), p)
    assert p < ALPHA, f"llama.cpp {name}: the broken sampler went undetected: p = {p:.2e}"
