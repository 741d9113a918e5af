"""Rows admitted together prefill their shared prompt chunks once (ssd.engine.kv_manager `leader`,
`_follow`): `n` samples of one prompt, or requests under one system prompt, wait for the
first row's chunks and copy them, and each row's output is what it is on its own.

Greedy and seeded-sampled outputs equal each request's alone on a fresh engine without the
cache, in AR, SD and SSD: the tokens, and the logprobs to 1e-9 (on torch a packed forward's
row count moves fp32 matmuls by ulps, shared prefill or not; on llama.cpp's kernels they are
bit for bit: test_prefix_cache_llamacpp); the prompt tokens fed are counted; the sampled law
holds for copied rows (chi-square); a copy of another prompt's chunks fails both checks.
"""

from __future__ import annotations

import dataclasses

import pytest

import ssd.engine.kv_manager as kv_module
from ssd.config import BatchingConfig, SamplingConfig
from ssd.models import TinyTokenizer
from tests.batches import run_together
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import SMALL, small_models
from tests.test_prefix_cache import CHUNK, FIRST, LAW_POSITIONS, LAW_SAMPLING, LAW_TOKENS, _engine, _fresh, \
    _outcome, _request

SYSTEM = FIRST[:16]  # two whole chunks of 8
OTHER = SYSTEM + [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 2]  # another request under the same system prompt


def _same(got, want) -> bool:
    """The same tokens, logprobs within 1e-9 (a batch's row count moves fp32 matmuls by ulps)."""
    return got[0] == want[0] and got[1] == pytest.approx(want[1], rel=0, abs=1e-9)


class FedTokens:
    """Counts the prompt-chunk tokens the target's packed forwards take."""

    def __init__(self, monkeypatch, engine) -> None:
        self.tokens = 0
        score = engine._score

        def counted(jobs):
            self.tokens += sum(len(ids) for _, ids, prefill in jobs if prefill)
            return score(jobs)

        monkeypatch.setattr(engine, "_score", counted)


def _samples(mode, target, draft, tok, sampling, prompts, monkeypatch, chunk=CHUNK, n=8):
    """`prompts` admitted together on one engine with the cache: each one's (outcome, cached
    prompt tokens, fresh outcome), and the prompt tokens the target was fed."""
    engine = _engine(mode, target, draft, tok, BatchingConfig(prefill_chunk=chunk))
    fed = FedTokens(monkeypatch, engine)
    try:
        requests = [_request(p, dataclasses.replace(sampling, seed=i), n) for i, p in enumerate(prompts)]
        results = run_together(engine, requests)
    finally:
        getattr(engine, "close", lambda: None)()
    rows = [(_outcome(result), result.stats.cached_prompt_tokens,
             _fresh(mode, target, draft, tok, r.prompt_ids, r.sampling, chunk, n))
            for r, result in zip(requests, results)]
    return rows, fed.tokens


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=5)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_samples_of_one_prompt_prefill_it_once(tiny_models, tiny_tokenizer, mode, sampling, monkeypatch):
    """Three samples of FIRST (21 tokens: whole chunks end at 8 and 16) and a request under its
    system prompt: the first row prefills, the others copy its 16 shared positions."""
    target, draft = tiny_models
    if mode == "ssd" and not sampling.greedy:  # SSD's draws follow its hits, which timing moves: coupled
        sampling = dataclasses.replace(sampling, coupling="gumbel")  # sampling makes a seed one output
    rows, fed = _samples(mode, target, draft, tiny_tokenizer, sampling, [FIRST, FIRST, FIRST, OTHER], monkeypatch)
    for i, (got, _, want) in enumerate(rows):
        assert _same(got, want), f"row {i}"
    assert [cached for _, cached, _ in rows] == [0, 16, 16, 16]
    assert fed == len(FIRST) + 2 * (len(FIRST) - 16) + (len(OTHER) - 16)


def test_without_the_cache_every_row_prefills_its_whole_prompt(tiny_models, tiny_tokenizer, monkeypatch):
    target, _ = tiny_models
    engine = _engine("ar", target, None, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK, prefix_cache=False))
    fed = FedTokens(monkeypatch, engine)
    results = run_together(engine, [_request(FIRST), _request(FIRST)])
    assert fed.tokens == 2 * len(FIRST) and [r.stats.cached_prompt_tokens for r in results] == [0, 0]
    assert results[0].token_ids == results[1].token_ids


def test_a_later_row_copies_a_decoding_rows_chunks_at_once(tiny_models, tiny_tokenizer, monkeypatch):
    """A row admitted while another with its prompt decodes copies the chunks before its first step."""
    target, _ = tiny_models
    engine = _engine("ar", target, None, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK))
    engine.admit(_request(FIRST, n=20))
    while not engine.scheduler.rows[0].decoding:
        engine.step()
    fed = FedTokens(monkeypatch, engine)
    second = _request(FIRST, dataclasses.replace(SamplingConfig(temperature=1.0), seed=3), n=6)
    engine.admit(second)
    left = engine.step()
    assert fed.tokens == len(FIRST) - 16 and engine.scheduler.rows[1].decoding
    while engine.rows:
        left += engine.step()
    result = next(f.result for f in left if f.request is second)
    assert result.stats.cached_prompt_tokens == 16
    assert _same(_outcome(result), _fresh("ar", target, None, tiny_tokenizer, FIRST, second.sampling, n=6))


@pytest.mark.parametrize("gone", ["cancelled", "failed"])
def test_a_leader_that_leaves_leaves_its_followers_to_prefill(tiny_models, tiny_tokenizer, gone):
    target, _ = tiny_models
    engine = _engine("ar", target, None, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK))
    leader, follower = _request(FIRST), _request(FIRST)
    if gone == "cancelled":
        leader = dataclasses.replace(leader, cancelled=lambda: True)
    engine.admit(leader)
    engine.admit(follower)
    if gone == "failed":
        engine.scheduler.rows[0].error = RuntimeError("the leader's forward failed")
    left = []
    while engine.rows:
        left += engine.step()
    result = next(f.result for f in left if f.request is follower)
    assert result.stats.cached_prompt_tokens == 0
    assert _same(_outcome(result), _fresh("ar", target, None, tiny_tokenizer, FIRST, follower.sampling))


def test_copying_another_prompts_chunks_fails_the_check(tiny_models, tiny_tokenizer, monkeypatch):
    """Matched by length alone, a row copies the first row's chunks whatever its prompt."""
    monkeypatch.setattr(kv_module, "shared_chunks", lambda tokens, prompt, chunk, stops=(): 16)
    monkeypatch.setattr(kv_module, "common_chunks", lambda tokens, prompt, chunk, stops=(), limit=None: 16)
    target, draft = tiny_models
    second = [(5 * i + 1) % 16 for i in range(21)]
    rows, _ = _samples("ar", target, draft, tiny_tokenizer, SamplingConfig(temperature=0.0), [FIRST, second],
                       monkeypatch)
    assert rows[1][1] == 16 and not _same(rows[1][0], rows[1][2])


# --- sampled: a copied row's output follows the target's law -------------------------------

LAW_PROMPT = [0, 1, 2, 3, 0, 1, 2]  # 6 positions in whole chunks of 2
LAW_WRONG = [3, 3, 1, 0, 2, 2, 1]


def _law_pvalue(batches: int, leader_prompt=LAW_PROMPT, mode: str = "sd") -> float:
    """Batches of four rows (K = 3, chunks of 2) on the 4-token model: a leader, then three
    samples of LAW_PROMPT that copy its 6 positions (asserted); the three's draws pooled."""
    target, draft = small_models()
    engine = _engine(mode, target, draft, TinyTokenizer(SMALL.vocab_size), BatchingConfig(prefill_chunk=2,
                                                                                         prefix_cache=True))
    draws = []
    try:
        for batch in range(batches):
            requests = [_request(prompt, dataclasses.replace(LAW_SAMPLING, seed=4 * batch + i), LAW_TOKENS)
                        for i, prompt in enumerate([leader_prompt, LAW_PROMPT, LAW_PROMPT, LAW_PROMPT])]
            results = run_together(engine, requests)
            engine.kv.prefix = type(engine.kv.prefix)(2, engine.kv.stops, engine.kv.token_bytes)  # each batch from scratch
            for result in results[1:]:
                assert result.stats.cached_prompt_tokens == 6
                draws.append(tuple(result.token_ids[p] for p in LAW_POSITIONS))
    finally:
        getattr(engine, "close", lambda: None)()
    return chi_square_pvalue(draws, exact_marginal(target, LAW_PROMPT, LAW_TOKENS, LAW_SAMPLING, LAW_POSITIONS))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_copied_rows_sample_the_target_law(mode):
    pvalue = _law_pvalue(100, mode=mode)
    report_pvalue(f"{mode}, prefill shared by rows admitted together", f"{LAW_PROMPT} T=1", "exact", 300, pvalue)
    assert pvalue > ALPHA, pvalue


def test_the_law_test_catches_a_copy_of_another_prompts_chunks(monkeypatch):
    monkeypatch.setattr(kv_module, "shared_chunks", lambda tokens, prompt, chunk, stops=(): 6)
    monkeypatch.setattr(kv_module, "common_chunks", lambda tokens, prompt, chunk, stops=(), limit=None: 6)
    pvalue = _law_pvalue(50, leader_prompt=LAW_WRONG)
    report_pvalue("sd, prefill shared by rows admitted together", f"{LAW_PROMPT} T=1", "the other prompt's keys",
                  150, pvalue)
    assert pvalue < ALPHA, pvalue
