"""Mixed batches drawn at random: every row equals AR alone, whatever runs beside it.

The other exactness tests pin one feature each. Here each trial draws an
engine and a few waves of requests that combine them, and checks every row
against AR alone (a fresh engine, no prefix cache):
- the engine: rows, token budget, prompt chunk, prefix cache on or off; for SD
  and SSD, K, backup, Saguaro's C and prompt lookup per request; for SSD, fan-out
  kind and budget, anytime builds, free n-gram entries, glue, branch decoder;
- the requests: prompts that share stems (the prefix cache and shared prefills
  serve them), greedy or coupled sampling (temperature, top-k, top-p, min-p),
  logit bias, penalties, allowed tokens, bad words, max and min tokens, stop
  tokens and strings, logprobs, prompt logprobs, predicted outputs, arrivals on
  later steps, cancellations, and the engine's idle warm-up between waves.
Coupled sampling gives AR's tokens in every mode for a seed (test_coupling), so
each row must equal AR alone in tokens, finish reason, text and logprobs: to
1e-9 on the fp64 torch pair, bit for bit on llama.cpp's Q4_K_M kernels (AR
alone prefilling in the same prompt chunks, which fix those keys and values).
A cancelled row's tokens are the start of AR's.

Power: a speculative round that scores every drafted position with the first
position's penalties and bias (the per-position state not advanced along the
draft) fails the same trials.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

import ssd.engine.processing as processing_module
from ssd.config import (
    BatchingConfig, FanoutConfig, GenerationConfig, PromptLookupConfig, SamplingConfig, SpeculationConfig,
)
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest, Processing
from ssd.models import TinyTokenizer
from ssd.saguaro.target import SSDEngine
from ssd.sampling import Bias
from tests.conftest import TINY

try:  # the llama.cpp trials' models (Q4_K_M, each layout this host runs), and their autouse fixture
    from tests.test_llamacpp import k_quant_files, k_quant_pair, short_prompts_on_the_plain_twin  # noqa: F401
    HAVE_LLAMA_CPP = True
except pytest.skip.Exception:  # llama_cpp or gguf missing: the torch trials still run
    HAVE_LLAMA_CPP = False

SEEDS = range(6)
LLAMA_SEEDS = range(6)
MODES = ["ar", "sd", "ssd"]


# --- drawing a trial ---------------------------------------------------------------------

def draw_sampling(rng: random.Random) -> SamplingConfig:
    if rng.random() < 0.4:
        return SamplingConfig(temperature=0.0)
    return SamplingConfig(temperature=rng.choice([0.5, 0.7, 1.0, 1.3]), top_k=rng.choice([0, 0, 3, 5]),
                          top_p=rng.choice([1.0, 1.0, 0.8, 0.95]), min_p=rng.choice([0.0, 0.0, 0.05]),
                          seed=rng.randrange(1000), coupling="gumbel")


def draw_processing(rng: random.Random, vocab: int) -> Processing | None:
    if rng.random() < 0.5:
        return None
    kw = {}
    if rng.random() < 0.4:
        kw["logit_bias"] = tuple((rng.randrange(vocab), rng.uniform(-4, 4)) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.8, 1.2, 1.5])
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = tuple(sorted(rng.sample(range(vocab), rng.randint(2, 8))))
    if rng.random() < 0.2:
        kw["bad_words"] = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 2))) for _ in range(2))
    return Processing(**kw)


def draw_generation(rng: random.Random, tokenizer, vocab: int) -> GenerationConfig:
    n = rng.randint(1, 30)
    kw = {"max_new_tokens": n, "min_tokens": rng.choice([0, 0, min(n, 3)]), "ignore_eos": rng.random() < 0.2}
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(vocab)]
    if rng.random() < 0.2:
        kw["stop"] = [s for s in [tokenizer.decode([rng.randrange(2, vocab)])] if s]
    return GenerationConfig(**kw)


def draw_speculation(rng: random.Random, mode: str) -> SpeculationConfig | None:
    if mode == "ar":
        return None
    kw = {"mode": mode, "k": rng.randint(1, 6), "saguaro_c": rng.choice([1.0, 1.0, 0.5]),
          "backup": rng.choice(["neural", "neural", "lookup", "ngram", "random"]),
          "prompt_lookup": PromptLookupConfig(max_tokens=rng.choice([None, 0, 3]))}
    if mode == "ssd":
        kw |= {"fanout": FanoutConfig(kind=rng.choice(["geometric", "uniform"]), budget=rng.randint(1, 12),
                                      anytime=rng.random() < 0.5),
               "ngram_candidates": rng.random() < 0.5, "glue": rng.choice(["fold", "reuse", "full"]),
               "branch_decoder": rng.choice(["tree", "batched"])}
    return SpeculationConfig(**kw)


@dataclasses.dataclass
class Arrival:
    request: GenerationRequest
    step: int
    rounds: list[list[int]]  # what its on_tokens saw


def draw_wave(rng: random.Random, spec_rng: random.Random, mode: str, stems: list[list[int]], tokenizer,
              vocab: int) -> list[Arrival]:
    wave = []
    for _ in range(rng.randint(1, 6)):
        prompt = (rng.choice(stems) if rng.random() < 0.7 else []) + [rng.randrange(vocab)
                                                                       for _ in range(rng.randint(1, 10))]
        rounds: list[list[int]] = []
        cancel_after = rng.randint(1, 5) if rng.random() < 0.15 else None
        prediction = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] if rng.random() < 0.2 else None
        request = GenerationRequest(
            prompt, draw_sampling(rng), draw_generation(rng, tokenizer, vocab), draw_speculation(spec_rng, mode),
            on_tokens=rounds.append,
            cancelled=lambda rounds=rounds, n=cancel_after: n is not None and len(rounds) >= n,
            logprobs=rng.choice([None, None, 0, 2]), prompt_logprobs=rng.choice([None, None, None, 0, 1]),
            processing=draw_processing(rng, vocab), prediction=prediction)
        wave.append(Arrival(request, rng.choice([0, 0, 0, 1, 2, 5]), rounds))
    return wave


def make_engine(mode: str, target, draft, tokenizer, rng: random.Random, spec_rng: random.Random):
    batching = BatchingConfig(max_rows=rng.randint(1, 6), max_batched_tokens=rng.choice([16, 64, 2048]),
                              prefill_chunk=rng.choice([4, 8, 8, 16]), prefix_cache=rng.random() < 0.8)
    if mode == "ssd":
        return SSDEngine.in_process(target, draft, tokenizer, draw_speculation(spec_rng, "ssd"), batching)
    if mode == "sd":
        return SDEngine(target, draft, tokenizer, draw_speculation(spec_rng, "sd"), batching)
    return AREngine(target, tokenizer, batching)


# --- running and checking one ----------------------------------------------------------------

def run_wave(engine, wave: list[Arrival]) -> dict[int, object]:
    """Admit each arrival at its step (in order, as rows and budget allow), step until all left."""
    finished, step, queue = {}, 0, []
    later = sorted(wave, key=lambda a: a.step)
    while engine.rows or later or queue:
        while later and later[0].step <= step:
            queue.append(later.pop(0).request)
        while queue and engine.can_admit(queue[0]):
            engine.admit(queue.pop(0))
        for done in engine.step():
            finished[id(done.request)] = done
        step += 1
    return finished


def assert_as_alone(request: GenerationRequest, got, want, tol: float) -> None:
    if got.finish_reason == "aborted":
        assert got.token_ids == want.token_ids[: len(got.token_ids)], "a cancelled row parted from AR"
        return
    assert (got.token_ids, got.finish_reason, got.text) == (want.token_ids, want.finish_reason, want.text)
    for name in ("logprobs", "prompt_logprobs"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert (mine is None) == (theirs is None) and len(mine or ()) == len(theirs or ()), name
        for a, b in zip(mine or (), theirs or ()):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top], (name, a, b)
            assert abs(a.logprob - b.logprob) <= tol, (name, a, b)


def trial(seed: int, mode: str, target, draft, tokenizer, vocab: int, tol: float, seen: Counter) -> None:
    """One engine, one to three waves of requests, each row checked against AR alone."""
    rng, spec_rng = random.Random(seed), random.Random(-1 - seed)  # a seed's requests: the same in every mode
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(2)]
    engine = make_engine(mode, target, draft, tokenizer, rng, spec_rng)
    alone = AREngine(target, tokenizer, BatchingConfig(prefix_cache=False, prefill_chunk=engine.batching.prefill_chunk,
                                                       max_batched_tokens=engine.batching.max_batched_tokens))
    try:
        for _ in range(rng.choice([1, 2, 2, 3])):
            wave = draw_wave(rng, spec_rng, mode, stems, tokenizer, vocab)
            finished = run_wave(engine, wave)
            while rng.random() < 0.5 and engine.warm():
                pass
            for arrival in wave:
                done = finished[id(arrival.request)]
                assert done.error is None, done.error
                plain = dataclasses.replace(arrival.request, on_tokens=None, cancelled=None, speculation=None)
                assert_as_alone(arrival.request, done.result, alone.generate(plain), tol)
                stats = done.result.stats
                seen.update(rows=1, cached=stats.cached_prompt_tokens > 0, accepted=stats.accepted,
                            aborted=done.result.finish_reason == "aborted", hits=stats.spec.hits,
                            misses=stats.spec.lookups - stats.spec.hits)
    finally:
        engine.close()


def run_trials(seeds, mode: str, target, draft, tokenizer, vocab: int, tol: float) -> Counter:
    seen: Counter = Counter()
    for seed in seeds:
        try:
            trial(seed, mode, target, draft, tokenizer, vocab, tol, seen)
        except AssertionError as exc:
            raise AssertionError(f"trial seed {seed}, {mode}: {exc}") from exc
    return seen


def assert_covered(seen: Counter, mode: str) -> None:
    """The trials reached what they are meant to mix: cached prefixes, cancellations, speculation."""
    assert seen["cached"] > 0 and seen["aborted"] > 0, seen
    if mode != "ar":
        assert seen["accepted"] > 0, seen
    if mode == "ssd":
        assert seen["hits"] > 0 and seen["misses"] > 0, seen


# --- the tests ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_random_mixed_batches_equal_ar_alone(tiny_models, tiny_tokenizer, mode):
    target, draft = tiny_models
    assert_covered(run_trials(SEEDS, mode, target, draft, tiny_tokenizer, TINY.vocab_size, 1e-9), mode)


def first_rows_only(real):
    def rows(self, drafted, vocab):
        return Bias.stack([real(self, drafted, vocab)[0]] * (len(drafted) + 1))

    return rows


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_trials_catch_drafted_positions_scored_with_the_first_positions_penalties(
        tiny_models, tiny_tokenizer, monkeypatch, mode):
    target, draft = tiny_models
    real = processing_module.LogitsProcessor.rows
    monkeypatch.setattr(processing_module.LogitsProcessor, "rows", first_rows_only(real))
    with pytest.raises(AssertionError, match="trial seed"):
        run_trials(SEEDS, mode, target, draft, tiny_tokenizer, TINY.vocab_size, 1e-9)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="needs llama_cpp and gguf")
@pytest.mark.parametrize("mode", MODES)
def test_random_mixed_batches_on_llama_cpp_equal_ar_alone_bit_for_bit(k_quant_pair, mode):
    target, draft = k_quant_pair
    vocab = target.vocab_size
    assert_covered(run_trials(LLAMA_SEEDS, mode, target, draft, TinyTokenizer(vocab), vocab, 0.0), mode)


