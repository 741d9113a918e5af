"""Continuous batching: rows that run together behave exactly as each runs alone.

Greedy rows equal the same request alone (a batch of one) and AR token for
token; sampled rows equal the same request run alone (same seed) and follow the
target's exact law (chi-square per row, with a power check); rows join,
leave, fail and prefill in chunks without touching the others.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import pytest
import torch

import ssd.engine.batch as batch_module
from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, Engine, SDEngine
from ssd.factory import LoadedPair, make_engine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.models import backend
from ssd.models.kv import KVSequence, forward_rows, kv_bytes_per_token
from ssd.verify import verify
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import SMALL, small_models

GREEDY = SamplingConfig(temperature=0.0)


def request(prompt, n=20, sampling=GREEDY, k=None, stop=(), **kw) -> GenerationRequest:
    speculation = SpeculationConfig(mode="sd", k=k) if k else None
    return GenerationRequest(prompt, sampling, GenerationConfig(max_new_tokens=n, stop=list(stop)), speculation, **kw)


def run_batch(engine, requests, admit_at: dict[int, list] | None = None, after_step: Callable | None = None):
    """Admit `requests` (and admit_at[step] later), step until every row left; results by request."""
    results = {}
    for r in requests:
        engine.admit(r)
    step = 0
    while engine.rows or (admit_at and any(s >= step for s in admit_at)):
        for r in (admit_at or {}).get(step, []):
            engine.admit(r)
        for finished in engine.step():
            results[id(finished.request)] = finished
        step += 1
        if after_step:
            after_step(step)
    return [results[id(r)] for r in [*requests, *(x for rs in (admit_at or {}).values() for x in rs)]]


def ok(finished):
    assert finished.error is None, finished.error
    return finished.result


def fresh(r: GenerationRequest) -> GenerationRequest:
    """The same request without callbacks, to run again alone."""
    return dataclasses.replace(r, on_tokens=None, cancelled=None)


# --- the batched forward ---------------------------------------------------------------

@pytest.mark.parametrize("fast", [True, False], ids=["packed", "per-row"])
def test_batched_forward_matches_each_row_alone(tiny_models, fast):
    """Ragged rows, each with its own cache already holding a different prefix,
    in one forward: logits per row equal the single-row forward (fp64)."""
    target, _ = tiny_models
    rng = random.Random(0)
    prefixes = [[rng.randrange(16) for _ in range(n)] for n in (3, 0, 11, 5)]
    new = [[rng.randrange(16) for _ in range(n)] for n in (1, 90, 5, 66)]  # 90, 66 > ROW_LIMIT: causal path
    last_only = [False, True, False, False]
    together, alone = [KVSequence(target, fast) for _ in new], [KVSequence(target, fast) for _ in new]
    for kv_a, kv_b, prefix in zip(together, alone, prefixes):
        if prefix:
            kv_a.forward(prefix)
            kv_b.forward(prefix)
    for _ in range(2):  # then a second, decode-sized round on the same caches
        outs = forward_rows(together, new, last_only)
        for out, kv, ids, flag in zip(outs, alone, new, last_only):
            torch.testing.assert_close(out, kv.forward(ids, last_only=flag), rtol=0, atol=1e-12)
        new, last_only = [[1], [2, 3], [4, 5, 6, 7], [8]], [False] * 4
    assert [kv.tokens for kv in together] == [kv.tokens for kv in alone]


# --- greedy: every row is its request alone ----------------------------------------------

def greedy_rows(tokenizer, target):
    reference = AREngine(target, tokenizer).generate(request([1, 2, 3], 40))
    stop = reference.text[5:7]  # completes inside a round
    return [
        request([1, 2, 3], 40, stop=[stop], k=4),
        request([5], 17, k=2),
        request([7, 7, 7, 7, 0, 1, 9, 12, 15], 30, k=6),
        request([3, 1, 4, 1, 5, 9, 2, 6] * 9, 25, k=3),  # 72 tokens: prefilled in chunks of 16
        request([11, 4], 1, k=5),
    ]


def test_greedy_sd_batch_equals_each_request_alone(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    rows = greedy_rows(tiny_tokenizer, target)
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(prefill_chunk=16))
    batched = [ok(f) for f in run_batch(engine, rows)]
    assert batched[0].finish_reason == "stop" and batched[1].finish_reason == "length"
    for r, out in zip(rows, batched):
        sd = SDEngine(target, draft, tiny_tokenizer).generate(fresh(r))
        ar = AREngine(target, tiny_tokenizer).generate(dataclasses.replace(fresh(r), speculation=None))
        assert out.token_ids == sd.token_ids == ar.token_ids
        assert (out.text, out.finish_reason) == (sd.text, sd.finish_reason)
        assert out.stats.k == r.speculation.k and out.stats.mode == "sd"
        assert len(out.stats.drafted_at) <= r.speculation.k and out.stats.new_tokens == len(out.token_ids)
    assert sum(out.stats.accepted for out in batched) < sum(out.stats.drafted for out in batched)  # rejections ran


def test_greedy_ar_batch_equals_each_request_alone(tiny_models, tiny_tokenizer):
    target, _ = tiny_models
    rows = [dataclasses.replace(r, speculation=None) for r in greedy_rows(tiny_tokenizer, target)]
    engine = AREngine(target, tiny_tokenizer, BatchingConfig(prefill_chunk=16))
    for r, finished in zip(rows, run_batch(engine, rows)):
        out, alone = ok(finished), AREngine(target, tiny_tokenizer).generate(fresh(r))
        assert (out.token_ids, out.finish_reason) == (alone.token_ids, alone.finish_reason)
        assert out.stats.rounds == len(out.token_ids) - 1 and out.stats.mode == "ar"


# --- sampled: each row is its request run alone (same seed) -------------------------------

SAMPLED = [
    (SamplingConfig(temperature=1.0, seed=1), 3),
    (SamplingConfig(temperature=0.6, seed=2), 4),
    (SamplingConfig(temperature=1.0, top_k=4, seed=3), 2),
    (SamplingConfig(temperature=0.9, top_p=0.8, seed=4), 5),
]


def sampled_rows():
    prompts = [[1, 2, 3], [9], [4, 4, 8, 15, 0], [2, 7]]
    return [request(p, 24, s, k) for p, (s, k) in zip(prompts, SAMPLED)]


def test_sampled_rows_equal_each_request_alone(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer)
    rows = sampled_rows()
    batched = [ok(f).token_ids for f in run_batch(engine, rows)]
    assert batched == [engine.generate(fresh(r)).token_ids for r in rows]
    assert len(set(map(tuple, batched))) == len(rows)


def test_swapped_generators_are_caught(tiny_models, tiny_tokenizer):
    """Power of the test above: rows drawing from each other's generator differ from alone."""
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer)
    rows = sampled_rows()
    for r in rows:
        engine.admit(r)
    first, second = engine.scheduler.rows[0].state, engine.scheduler.rows[1].state
    first.gen, second.gen = second.gen, first.gen
    results = {}
    while engine.rows:
        results.update((id(f.request), ok(f).token_ids) for f in engine.step())
    assert results[id(rows[0])] != engine.generate(fresh(rows[0])).token_ids


# --- sampled: each row follows the target's exact law ------------------------------------
# The model and positions of tests/test_distribution.py: K = 3, the prefill's
# token, then the first round's three drafted depths and its bonus token.
# Rows of different prompts and settings run in one batch.

CHI_K = 3
CHI_TOKENS = CHI_K + 2
CHI_POSITIONS = [1, 2, 3, 4]
CHI_ROWS = [
    ([0, 1, 2], SamplingConfig(temperature=0.6)),
    ([3, 1], SamplingConfig(temperature=1.0, top_k=2)),
    ([2, 2, 0, 1, 3], SamplingConfig(temperature=1.0, top_p=0.8)),
]
CHI_SAMPLES = 300
CHI_BROKEN_SAMPLES = 120


@pytest.fixture(scope="module")
def chi_pair():
    return small_models()


def chi_draws(pair, samples: int) -> list[list[tuple[int, ...]]]:
    """Per row, tokens at CHI_POSITIONS of `samples` batches, each batch every row with its own seed."""
    target, draft = pair
    engine = SDEngine(target, draft, TinyTokenizer(SMALL.vocab_size), SpeculationConfig(mode="sd", k=CHI_K))
    draws: list[list[tuple[int, ...]]] = [[] for _ in CHI_ROWS]
    for seed in range(samples):
        rows = [
            request(prompt, CHI_TOKENS, dataclasses.replace(sampling, seed=seed * len(CHI_ROWS) + i))
            for i, (prompt, sampling) in enumerate(CHI_ROWS)
        ]
        for i, finished in enumerate(run_batch(engine, rows)):
            draws[i].append(tuple(ok(finished).token_ids[p] for p in CHI_POSITIONS))
    return draws


def chi_pvalues(pair, draws) -> list[float]:
    return [
        chi_square_pvalue(samples, exact_marginal(pair[0], prompt, CHI_TOKENS, sampling, CHI_POSITIONS))
        for samples, (prompt, sampling) in zip(draws, CHI_ROWS)
    ]


def test_each_row_matches_the_target_law(chi_pair):
    pvalues = chi_pvalues(chi_pair, chi_draws(chi_pair, CHI_SAMPLES))
    for (prompt, sampling), pvalue in zip(CHI_ROWS, pvalues):
        report_pvalue("batched sd", f"{prompt} {sampling}", "exact", CHI_SAMPLES, pvalue)
    assert min(pvalues) > ALPHA, f"a row deviates from the target's law: {pvalues}"


def rotate_scored_rows(forward):
    """A packing bug: verified rows receive the next row's target logits (where shapes allow)."""

    def broken(rows, ids, last_only=False, prompt=None):
        outs = forward(rows, ids, last_only, prompt)
        flags = [last_only] * len(rows) if isinstance(last_only, bool) else last_only
        if len(outs) > 1 and not any(flags) and len({o.shape for o in outs}) == 1:
            outs = outs[1:] + outs[:1]
        return outs

    return broken


def test_the_law_test_catches_rows_verified_with_another_rows_logits(chi_pair, monkeypatch):
    monkeypatch.setattr(batch_module, "forward_rows", rotate_scored_rows(backend.forward_rows))
    pvalues = chi_pvalues(chi_pair, chi_draws(chi_pair, CHI_BROKEN_SAMPLES))
    for (prompt, sampling), pvalue in zip(CHI_ROWS, pvalues):
        report_pvalue("batched sd", f"{prompt} {sampling}", "rotated logits", CHI_BROKEN_SAMPLES, pvalue)
    assert max(pvalues) < ALPHA, f"rotated logits went undetected: {pvalues}"


# --- joining, leaving, failing -------------------------------------------------------------

def test_rows_joining_and_leaving_mid_run_do_not_change_the_others(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer)
    sampling = SamplingConfig(temperature=1.0)
    cancelled_rounds: list[list[int]] = []
    stays = request([1, 2, 3], 30, dataclasses.replace(sampling, seed=7), k=3)
    leaves = request([4, 5], 30, dataclasses.replace(sampling, seed=8), k=2,
                     on_tokens=cancelled_rounds.append, cancelled=lambda: len(cancelled_rounds) >= 3)
    joins = request([6, 7, 8], 30, dataclasses.replace(sampling, seed=9), k=4)
    out_stays, out_leaves, out_joins = run_batch(engine, [stays, leaves], admit_at={3: [joins]})
    assert ok(out_stays).token_ids == engine.generate(fresh(stays)).token_ids
    assert ok(out_joins).token_ids == engine.generate(fresh(joins)).token_ids
    left = ok(out_leaves)
    assert left.finish_reason == "aborted" and len(cancelled_rounds) == 3
    assert left.token_ids == [t for r in cancelled_rounds for t in r]
    assert left.token_ids == engine.generate(fresh(leaves)).token_ids[: len(left.token_ids)]


def test_a_failing_row_leaves_alone(tiny_models, tiny_tokenizer):
    """Its own failure (its callback, its verification) ends that row only."""
    target, draft = tiny_models
    sampling = SamplingConfig(temperature=1.0)

    def verifier(drafted, q, p, gen, greedy=False):
        if gen.initial_seed() == 13:
            raise ValueError("bad q")
        return verify(drafted, q, p, gen, greedy)

    def explode(tokens):
        raise RuntimeError("client went away")

    engine = SDEngine(target, draft, tiny_tokenizer, verifier=verifier)
    healthy = [request([1, 2, 3], 20, dataclasses.replace(sampling, seed=s), k=3) for s in (1, 2)]
    bad_q = request([4, 5], 20, dataclasses.replace(sampling, seed=13), k=3)
    bad_callback = request([6], 20, dataclasses.replace(sampling, seed=3), k=3, on_tokens=explode)
    results = run_batch(engine, [healthy[0], bad_q, bad_callback, healthy[1]])
    assert isinstance(results[1].error, ValueError) and results[1].result is None
    assert isinstance(results[2].error, RuntimeError)
    for r, finished in zip(healthy, (results[0], results[3])):
        assert ok(finished).token_ids == engine.generate(r).token_ids
    with pytest.raises(ValueError, match="bad q"):
        engine.generate(fresh(bad_q))


# --- prefill and limits ------------------------------------------------------------------

@pytest.mark.parametrize("engine_kind", ["ar", "sd"])
def test_chunked_prefill_equals_unchunked(tiny_models, tiny_tokenizer, engine_kind):
    target, draft = tiny_models
    long = request([(5 * i + 3) % 16 for i in range(100)], 20, k=4 if engine_kind == "sd" else None)
    short = request([1, 2, 3], 20, k=4 if engine_kind == "sd" else None)

    def make(chunk):
        batching = BatchingConfig(prefill_chunk=chunk)
        if engine_kind == "ar":
            return AREngine(target, tiny_tokenizer, batching)
        return SDEngine(target, draft, tiny_tokenizer, batching=batching)

    whole = make(512).generate(fresh(long)).token_ids
    steps, first_emit = [0], {}
    long.on_tokens = lambda tokens: first_emit.setdefault("long", steps[0])
    short.on_tokens = lambda tokens: first_emit.setdefault("short", steps[0])
    out_long, out_short = run_batch(make(8), [long, short], after_step=lambda step: steps.__setitem__(0, step))
    assert ok(out_long).token_ids == whole
    assert ok(out_short).token_ids == make(512).generate(fresh(short)).token_ids
    # 100 tokens in chunks of 8 take 13 steps; the short row decodes meanwhile.
    assert first_emit == {"short": 0, "long": 12}


def test_a_step_feeds_the_target_at_most_max_batched_tokens(tiny_models, tiny_tokenizer, monkeypatch):
    target, draft = tiny_models
    fed: list[int] = []

    def counting(rows, ids, last_only=False, prompt=None):
        if rows and rows[0].model is target:
            fed.append(sum(map(len, ids)))
        return backend.forward_rows(rows, ids, last_only, prompt)

    monkeypatch.setattr(batch_module, "forward_rows", counting)
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(max_batched_tokens=24, prefill_chunk=16))
    rows = [request([i % 16] * 40, 12, k=4) for i in range(3)]
    outs = run_batch(engine, rows)
    assert max(fed) <= 24 and max(fed) >= 20
    for r, finished in zip(rows, outs):
        assert ok(finished).token_ids == SDEngine(target, draft, tiny_tokenizer).generate(fresh(r)).token_ids


def test_can_admit_enforces_rows_and_kv_memory(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(max_rows=2))
    for i in range(2):
        assert engine.can_admit(request([1, 2], 10))
        engine.admit(request([1, 2], 10))
    assert not engine.can_admit(request([1, 2], 10))
    with pytest.raises(RuntimeError, match="full"):
        engine.admit(request([1, 2], 10))

    per_token = kv_bytes_per_token(target) + kv_bytes_per_token(draft)
    assert per_token == 2 * (2 * 2 * 2 * 8 * 8)  # models: layers * (k, v) * kv heads * head dim * fp64
    need = (3 + 20 + 4) * per_token  # prompt + max_new_tokens + K
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(kv_memory_mb=2.5 * need / 2**20))
    for _ in range(2):
        assert engine.can_admit(request([1, 2, 3], 20))
        engine.admit(request([1, 2, 3], 20))
    assert not engine.can_admit(request([1, 2, 3], 20))
    assert engine.can_admit(request([1], 4))  # a smaller request still fits
    with pytest.raises(RuntimeError, match="check can_admit"):
        engine.admit(request([1, 2, 3], 20))
    engine.step()  # every row prefills and moves on; none leaves
    assert engine.rows == 2 and not engine.can_admit(request([1, 2, 3], 20))

    # Rounds of K + 1 tokens must leave a token of max_batched_tokens for prefill.
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(max_batched_tokens=13, prefill_chunk=4))
    for _ in range(2):
        assert engine.can_admit(request([1, 2, 3], 20, k=4))
        engine.admit(request([1, 2, 3], 20, k=4))
    assert not engine.can_admit(request([1, 2, 3], 20, k=4)) and engine.can_admit(request([1, 2, 3], 20, k=1))
    assert engine.can_admit(request([1], 5, k=20))  # never fits: admit says why
    with pytest.raises(ValueError, match="tokens per round"):
        engine.admit(request([1], 5, k=20))


def test_requests_that_never_fit_or_bring_another_mode_are_refused(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, batching=BatchingConfig(kv_memory_mb=0.01))
    huge = request([1] * 10, 200)
    assert engine.can_admit(huge)  # so the worker hands back admit's error instead of queueing forever
    with pytest.raises(ValueError, match="KV cache"):
        engine.admit(huge)
    ssd_request = GenerationRequest([1, 2], GREEDY, speculation=SpeculationConfig(mode="ssd"))
    with pytest.raises(ValueError, match="speculation.mode 'ssd' sent to the sd engine"):
        SDEngine(target, draft, tiny_tokenizer).admit(ssd_request)
    with pytest.raises(ValueError, match="sent to the ar engine"):
        AREngine(target, tiny_tokenizer).admit(request([1, 2], 5, k=3))


def test_make_engine_builds_the_one_engine_of_each_mode(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    pair = LoadedPair(target, draft, tiny_tokenizer)
    batching = BatchingConfig(max_rows=3)
    defaults = SpeculationConfig(mode="ar", k=5, k_policy={2: 1})  # any mode's settings: make_engine sets the mode
    ar = make_engine("ar", pair, defaults, batching)
    sd = make_engine("sd", pair, defaults)
    assert isinstance(ar, AREngine) and ar.batching.max_rows == 3
    assert isinstance(sd, SDEngine) and sd.generate(request([1, 2], 8)).stats.k == 5
    assert sd.speculation.k_policy == {2: 1}  # the defaults arrive whole, K policy included
    # ... and the policy drafts: alone, K 2 (the policy's), not k 5 (it was dropped once).
    stats = make_engine("sd", pair, SpeculationConfig(k=5, k_policy={1: 2})).generate(request([1, 2], 9)).stats
    assert len(stats.drafted_at) == 2, stats.drafted_at
    ssd = make_engine("ssd", pair, dataclasses.replace(defaults, k=3))  # its exactness: tests/test_batch_ssd.py
    try:
        out = ssd.generate(request([1, 2], 8))  # no speculation of its own: the factory's K=3 SSD applies
    finally:
        ssd.close()
    assert ssd.mode == "ssd" and isinstance(ssd, Engine)
    assert out.token_ids == ar.generate(request([1, 2], 8)).token_ids
    assert out.stats.mode == "ssd" and out.stats.k == 3 and out.stats.spec.lookups > 0, out.stats.summary()
    with pytest.raises(ValueError, match="draft"):
        make_engine("sd", LoadedPair(target, None, tiny_tokenizer), defaults)


def test_k_policy_sets_the_draft_length_by_batch_size(tiny_models, tiny_tokenizer):
    """{1: 3, 3: 0}: alone a row drafts 3; three rows together run plain target
    steps (K 0) until one leaves, then draft again; output stays AR's."""
    target, draft = tiny_models
    policy = SpeculationConfig(mode="sd", k=5, k_policy={1: 3, 3: 0})
    drafted_per_step: list[list[int]] = []
    engine = SDEngine(target, draft, tiny_tokenizer)
    rows = [dataclasses.replace(request(p, n), speculation=policy) for p, n in [([1, 2, 3], 30), ([5], 8), ([7, 7], 8)]]

    def record(step):
        drafted_per_step.append([r.chain.k for r in engine.scheduler.rows if r.chain is not None])

    outs = [ok(f) for f in run_batch(engine, rows, after_step=record)]
    for r, out in zip(rows, outs):
        ar = AREngine(target, tiny_tokenizer).generate(dataclasses.replace(fresh(r), speculation=None))
        assert out.token_ids == ar.token_ids
    assert outs[1].stats.drafted == outs[2].stats.drafted == 0  # they only ran beside two others
    assert [0, 0, 0] in drafted_per_step and [3] in drafted_per_step and outs[0].stats.drafted > 0
    assert all(set(ks) <= {0, 3} for ks in drafted_per_step)
    assert SpeculationConfig(k=5, k_policy={1: 3, 3: 0}).k_for(2) == 3
    with pytest.raises(ValueError, match="k_policy"):
        SpeculationConfig(k_policy={2: 65})
