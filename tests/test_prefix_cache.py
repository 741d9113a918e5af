"""Prefix caching across requests (ssd.engine.prefix): a later prompt that starts as an earlier
one did takes its whole prompt chunks, and its output is what it would be without the cache.

Greedy and seeded-sampled outputs with the cache equal a fresh engine's, tokens and
logprobs bit for bit, in AR, SD and SSD, on torch and on llama.cpp's Q4_K_M kernels; the
sampled law holds on a hit (chi-square); a cache that served another prompt's keys, or
positions a decode step computed, fails those checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssd.models.backend import kv_bytes_per_token
from ssd.config import BatchingConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.prefix import (
    CachedPrefix, PrefixCache, chunk_end, chunk_ends, common_chunks, shared_chunks, whole_chunks,
)
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer
from ssd.models.kv import KVSequence
from ssd.saguaro.target import SSDEngine
from tests.exact import exact_marginal
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_distribution import SMALL, small_models

CHUNK = 8
FIRST = [(7 * i + 3) % 16 for i in range(21)]  # the tiny models' 16-token vocabulary


# --- the bookkeeping -------------------------------------------------------------------

def test_chunks_end_after_their_size_or_at_an_end_of_turn_token():
    assert list(chunk_ends(list(range(21)), 8)) == [8, 16]
    ids = [1, 1, 9, 1, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1]
    # 9 ends a chunk once it holds 8 // 4 = 2 tokens: not at 0-2 (a 3-token chunk would do), then at 7
    assert chunk_end(ids, 0, 8, {9}) == 3 and chunk_end([9, 9], 0, 8, {9}) == 2 and chunk_end([9], 0, 8, {9}) is None
    assert list(chunk_ends(ids, 8, {9})) == [3, 8, 16, 19]
    assert whole_chunks(ids, 20, 8, {9}) == 19 and whole_chunks(ids, 18, 8, {9}) == 16
    assert whole_chunks(list(range(21)), 21, 8) == 16 and whole_chunks(list(range(7)), 7, 8) == 0
    assert whole_chunks(list(range(16)), 16, 8) == 16
    assert common_chunks(ids, ids[:8] + [5] * 12, 8, {9}) == 8  # a prefix shares its chunks


def test_shared_chunks_count_whole_chunks_and_leave_the_last_token():
    tokens = list(range(16))
    assert common_chunks(tokens, list(range(30)), 8) == 16
    assert common_chunks(tokens, list(range(30)), 8, limit=15) == 8
    assert common_chunks(tokens, [*range(12), 99, *range(13, 30)], 8) == 8  # chunk 2 differs at 12
    assert shared_chunks(tokens, list(range(16)), 8) == 8  # the prompt's last token stays to feed
    assert shared_chunks(tokens, list(range(17)), 8) == 16
    assert shared_chunks(tokens, [99, *range(1, 30)], 8) == 0


def test_the_cache_finds_the_longest_match_the_newest_among_equals():
    cache = PrefixCache(4, token_bytes=10)
    old, new, longer = (CachedPrefix(tuple(t), target=name) for t, name in
                        (((1, 2, 3, 4), "old"), ((1, 2, 3, 4), "new"), ((1, 2, 3, 4, 5, 6, 7, 8), "longer")))
    for entry in (old, new, longer):
        cache.put(entry)
    assert len(cache) == 3 and cache.nbytes == 160  # 16 positions held
    assert cache.find([9, 9, 9, 9, 9]) is None
    assert cache.find([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (longer, 8)
    cache.remove(longer)
    assert cache.find([1, 2, 3, 4, 5, 6, 7, 8, 9]) == (new, 4)
    assert cache.pop_oldest(spare=old) is new and cache.pop_oldest(spare=old) is None
    assert cache.pop_oldest() is old and cache.pop_oldest() is None
    with pytest.raises(ValueError, match="whole chunks"):
        cache.put(CachedPrefix((1, 2), target="short"))
    with pytest.raises(ValueError, match="whole chunks"):
        cache.put(CachedPrefix((1, 2, 3, 4, 5, 6), target="past a chunk's end"))


# --- engines: the output is what it is without the cache ---------------------------------

def _request(prompt, sampling=SamplingConfig(temperature=0.0), n=10, **kw):
    return GenerationRequest(list(prompt), sampling, GenerationConfig(max_new_tokens=n), logprobs=0, **kw)


def _outcome(result):
    return result.token_ids, [t.logprob for t in result.logprobs]


def _engine(mode, target, draft, tok, batching):
    if mode == "ar":
        return AREngine(target, tok, batching)
    if mode == "sd":
        return SDEngine(target, draft, tok, SpeculationConfig(mode="sd", k=3), batching=batching)
    return SSDEngine.in_process(target, draft, tok, SpeculationConfig(mode="ssd", k=3), batching=batching)


SECOND = [(5 * i + 1) % 16 for i in range(19)]
EXTRA = [1, 2, 3, 4, 5]


def _fresh(mode, target, draft, tok, prompt, sampling, chunk=CHUNK, n=10):
    """`prompt`'s outcome on a fresh engine without the cache."""
    engine = _engine(mode, target, draft, tok, BatchingConfig(prefill_chunk=chunk, prefix_cache=False))
    try:
        return _outcome(engine.generate(_request(prompt, sampling, n)))
    finally:
        getattr(engine, "close", lambda: None)()


def _chats(mode, target, draft, tok, sampling, chats=(FIRST, SECOND), chunk=CHUNK, n=10, turns=3, engine=None,
           warm=False):
    """Chats taking turns on one engine with the cache, each prompt the chat's last prompt, its
    output and a new message; per turn (prompt, outcome, cached prompt tokens, fresh outcome).
    `warm`: the engine's idle work runs out between turns (the reply prefilled)."""
    engine = engine or _engine(mode, target, draft, tok, BatchingConfig(prefill_chunk=chunk))
    prompts, out = [list(c) for c in chats], []
    try:
        for turn in range(turns):
            for chat in range(len(prompts)):
                seeded = dataclasses.replace(sampling, seed=10 * turn + chat)
                result = engine.generate(_request(prompts[chat], seeded, n))
                while warm and engine.warm():
                    pass
                want = _fresh(mode, target, draft, tok, prompts[chat], seeded, chunk, n)
                out.append((prompts[chat], _outcome(result), result.stats.cached_prompt_tokens, want))
                prompts[chat] = prompts[chat] + result.token_ids + [(t + turn) % 16 for t in EXTRA]
    finally:
        getattr(engine, "close", lambda: None)()
    return out


def _same(mode, got, want) -> bool:
    if mode == "ssd":  # its hits (timing) set how many rows a verification scores: fp64 apart by ulps
        return got[0] == want[0] and got[1] == pytest.approx(want[1], rel=0, abs=1e-12)
    return got == want


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=5)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_chats_taking_turns_equal_each_turn_alone(tiny_models, tiny_tokenizer, mode, sampling):
    """Two chats take turns on one engine: each later turn starts from its own chat's last
    prompt's whole chunks (asserted), and every turn's tokens and logprobs equal that prompt's on
    a fresh engine without the cache, bit for bit (SSD's logprobs to 1e-12: they move by ulps
    between two fresh runs too). Power: a cache that matched prompts by length alone hands one
    chat the other's keys and values, and fails it."""
    target, draft = tiny_models
    if mode == "ssd" and not sampling.greedy:  # SSD's draws follow its hits, which timing moves: coupled
        sampling = dataclasses.replace(sampling, coupling="gumbel")  # sampling makes a seed one output
    turns = _chats(mode, target, draft, tiny_tokenizer, sampling)
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert _same(mode, got, want), f"turn {i // 2} of chat {i % 2}"
        last = turns[i - 2][0] if i >= 2 else []
        assert cached == whole_chunks(last, len(last), CHUNK) and (i < 2 or cached > 0)


def test_a_cache_that_matched_by_length_alone_fails_the_check(tiny_models, tiny_tokenizer, monkeypatch):
    import ssd.engine.prefix as prefix

    monkeypatch.setattr(prefix, "shared_chunks", lambda tokens, prompt, chunk, stops=(): prefix.common_chunks(
        tokens, tokens, chunk, stops, limit=len(prompt) - 1))
    target, draft = tiny_models
    turns = _chats("ar", target, draft, tiny_tokenizer, SamplingConfig(temperature=0.0))
    assert not all(_same("ar", got, want) for _, got, _, want in turns)


# --- sampled: a hit's output follows the target's law -----------------------------------

LAW_PROMPTS = ([0, 1, 2, 3, 0, 1, 2], [3, 3, 1, 0, 2, 2, 1])  # 6 positions in whole chunks of 2 each
LAW_SAMPLING = SamplingConfig(temperature=1.0)
LAW_TOKENS, LAW_POSITIONS = 5, [1, 2, 3, 4]  # the prefill's token, then a first round of K = 3 and its bonus


def _law_pvalues(samples: int, hits: bool = True, mode: str = "sd") -> list[float]:
    """SD or SSD (K = 3) on the 4-token model, the two prompts in turn on one engine with the
    cache (chunks of 2): every request after the first two takes 6 cached positions (asserted)."""
    target, draft = small_models()
    engine = _engine(mode, target, draft, TinyTokenizer(SMALL.vocab_size), BatchingConfig(prefill_chunk=2))
    draws: list[list[tuple[int, ...]]] = [[], []]
    try:
        for seed in range(samples):
            for i, prompt in enumerate(LAW_PROMPTS):
                sampling = dataclasses.replace(LAW_SAMPLING, seed=2 * seed + i)
                request = GenerationRequest(list(prompt), sampling, GenerationConfig(max_new_tokens=LAW_TOKENS))
                result = engine.generate(request)
                assert result.stats.cached_prompt_tokens == 6 or not (seed and hits)
                draws[i].append(tuple(result.token_ids[p] for p in LAW_POSITIONS))
    finally:
        getattr(engine, "close", lambda: None)()
    return [chi_square_pvalue(d, exact_marginal(target, prompt, LAW_TOKENS, LAW_SAMPLING, LAW_POSITIONS))
            for d, prompt in zip(draws, LAW_PROMPTS)]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_output_on_a_hit_follows_the_target_law(mode, monkeypatch):
    """SSD: every request after the first two also starts its draft from a kept cache (asserted)."""
    from ssd.saguaro.speculator import Speculator

    reused, original = [], Speculator._reused
    monkeypatch.setattr(Speculator, "_reused", lambda self, prompt, branches: reused.append(
        original(self, prompt, branches)) or reused[-1])
    pvalues = _law_pvalues(300, mode=mode)
    assert mode == "sd" or sum(kv is not None for kv in reused) == 2 * 300 - 2
    for prompt, pvalue in zip(LAW_PROMPTS, pvalues):
        report_pvalue(f"{mode}, prefix cache hit", f"{prompt} T=1", "exact", 300, pvalue)
    assert min(pvalues) > ALPHA, pvalues


def test_the_law_test_catches_a_cache_that_serves_another_prompts_keys(monkeypatch):
    """Matched by length alone, the second prompt takes the first's entry every time (the
    first finds none: an entry holding another prompt's keys is never kept again)."""
    import ssd.engine.prefix as prefix

    monkeypatch.setattr(prefix, "shared_chunks", lambda tokens, prompt, chunk, stops=(): prefix.common_chunks(
        tokens, tokens, chunk, stops, limit=len(prompt) - 1))
    pvalues = _law_pvalues(150, hits=False)
    for prompt, pvalue in zip(LAW_PROMPTS, pvalues):
        report_pvalue("sd, prefix cache hit", f"{prompt} T=1", "the other prompt's keys", 150, pvalue)
    assert pvalues[1] < ALPHA, pvalues


# --- what the cache holds, and what it gives up ------------------------------------------

def test_cached_prefixes_give_way_to_a_new_rows_memory(tiny_models, tiny_tokenizer):
    """Entries count against batching.kv_memory_mb and the oldest go when a new row needs the
    room: with room for one request and one entry, a third prompt drops the first's entry."""
    target, _ = tiny_models
    per_token = kv_bytes_per_token(target)
    need = (len(FIRST) + 10) * per_token  # what a request of FIRST with 10 new tokens reserves
    engine = AREngine(target, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK,
                                                             kv_memory_mb=(need + 8 * per_token) / 2**20))
    first = engine.generate(_request(FIRST))
    assert len(engine.kv.prefix) == 1 and engine.kv.prefix.nbytes == 16 * per_token
    engine.generate(_request(SECOND))  # its row needs the room the first's entry holds: dropped
    assert len(engine.kv.prefix) == 1
    again = engine.generate(_request(FIRST))
    assert again.stats.cached_prompt_tokens == 0 and _outcome(again) == _outcome(first)


def test_prompt_logprobs_requests_score_their_whole_prompt(tiny_models, tiny_tokenizer):
    target, _ = tiny_models
    engine = AREngine(target, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK))
    engine.generate(_request(FIRST))
    scored = engine.generate(_request(FIRST, prompt_logprobs=0))
    assert scored.stats.cached_prompt_tokens == 0 and len(scored.prompt_logprobs) == len(FIRST) - 1
    assert engine.generate(_request(FIRST)).stats.cached_prompt_tokens == 16  # it left its chunks


def test_the_cache_can_be_turned_off(tiny_models, tiny_tokenizer):
    target, _ = tiny_models
    engine = AREngine(target, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK, prefix_cache=False))
    engine.generate(_request(FIRST))
    assert engine.generate(_request(FIRST)).stats.cached_prompt_tokens == 0


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_idle_work_prefills_the_reply_as_the_next_turn_would(tiny_models, tiny_tokenizer, mode):
    """Between turns the engine prefills each finished chat's prompt rest and reply in whole
    chunks (`warm`): the next turn takes them too, and still equals a fresh run, bit for bit."""
    target, draft = tiny_models
    turns = _chats(mode, target, draft, tiny_tokenizer, SamplingConfig(temperature=0.0), n=20, warm=True)
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert _same(mode, got, want), f"turn {i // 2} of chat {i % 2}"
        if i >= 2:
            last, (ids, _) = turns[i - 2][0], turns[i - 2][1]
            held = last + ids
            assert cached == whole_chunks(held, len(held), CHUNK) > whole_chunks(last, len(last), CHUNK)


def test_idle_work_stops_at_the_memory_limit_and_never_runs_beside_rows(tiny_models, tiny_tokenizer):
    target, _ = tiny_models
    per_token = kv_bytes_per_token(target)
    need = (len(FIRST) + 20) * per_token
    engine = AREngine(target, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK, kv_memory_mb=need / 2**20))
    engine.generate(_request(FIRST, n=20))  # leaves 16 positions and 25 pending
    assert engine.warm() and engine.warm() and engine.kv.prefix.nbytes == 32 * per_token
    assert not engine.warm()  # a third chunk would pass kv_memory_mb (41 tokens' worth)
    engine.admit(_request(SECOND))
    assert not engine.warm()  # rows run: no idle work


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_reply_that_ends_its_turn_is_served_whole(tiny_models, mode):
    """A chunk also ends after an end-of-turn token (the model's EOS), so a reply that ended with
    one is prefilled to its end while idle, and the next turn takes all of it (asserted where
    that chunk holds a quarter of prefill_chunk); every turn still equals a fresh run."""
    target, draft = tiny_models
    plain = TinyTokenizer(16)
    end = AREngine(target, plain).generate(_request(FIRST, n=6)).token_ids[3]  # the reply's 4th token ends it
    tok = TinyTokenizer(16, eos_token_id=end)
    turns = _chats(mode, target, draft, tok, SamplingConfig(temperature=0.0), n=20, warm=True)
    whole_turns = 0
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert _same(mode, got, want), f"turn {i // 2} of chat {i % 2}"
        if i >= 2:
            held = turns[i - 2][0] + turns[i - 2][1][0]
            assert cached == whole_chunks(held, len(held), CHUNK, {end})
            whole_turns += held[-1] == end and cached == len(held)
    assert whole_turns > 0


def test_a_reply_cut_short_is_prefilled_as_its_template_will_close_it(tiny_models):
    """Cut by max_tokens, a reply gets the end-of-turn token that closed the prompt's earlier
    messages appended while idle: a next prompt that closes it so is served to that token; one
    that goes on otherwise shares nothing past the reply, and both equal fresh runs."""
    target, _ = tiny_models
    end = 15
    tok = TinyTokenizer(16, eos_token_id=end)
    prompt = [t % 15 for t in FIRST] + [end, 4, 5]  # an earlier message closed by `end`
    engine = AREngine(target, tok, BatchingConfig(prefill_chunk=CHUNK))
    reply = engine.generate(_request(prompt, n=12)).token_ids
    assert end not in reply and len(reply) == 12  # cut by max_tokens
    while engine.warm():
        pass
    entry = engine.kv.prefix.warmable() or next(iter(engine.kv.prefix._entries.values()))
    assert entry.tokens[-1] == end and len(entry.tokens) == len(prompt) + len(reply) + 1
    for closing, served in (([end], len(prompt) + len(reply) + 1), ([7], whole_chunks(prompt + reply, 36, CHUNK, {end}))):
        turn = prompt + reply + closing + [1, 2, 3]
        result = engine.generate(_request(turn, n=6))
        assert result.stats.cached_prompt_tokens == served
        alone = AREngine(target, tok, BatchingConfig(prefill_chunk=CHUNK, prefix_cache=False))
        assert _outcome(result) == _outcome(alone.generate(_request(turn, n=6)))
        engine = AREngine(target, tok, BatchingConfig(prefill_chunk=CHUNK))  # the same first turn again
        engine.generate(_request(prompt, n=12))
        while engine.warm():
            pass


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_chats_under_one_system_prompt_copy_it_and_keep_their_own(tiny_models, tiny_tokenizer, mode):
    """Two chats whose prompts share their first 16 positions (a system prompt): the second
    gets a copy of those from the first's entry, which stays, so each chat's next turn takes
    its own whole last prompt; every turn equals a fresh run."""
    target, draft = tiny_models
    system = FIRST[:16]
    chats = (system + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], system + [9, 8, 7, 6, 5, 4, 3, 2, 1])
    turns = _chats(mode, target, draft, tiny_tokenizer, SamplingConfig(temperature=0.0), chats, n=6, turns=2)
    assert all(_same(mode, got, want) for _, got, _, want in turns)
    assert [cached for _, _, cached, _ in turns] == [0, 16, 24, 24]  # turn 2: each its own last prompt's
    engine = _engine(mode, target, draft, tiny_tokenizer, BatchingConfig(prefill_chunk=CHUNK))
    first = engine.generate(_request(chats[0], n=6))
    engine.generate(_request(chats[1], n=6))
    assert len(engine.kv.prefix) == 2  # the first's entry stayed
    again = engine.generate(_request(chats[0] + first.token_ids + [1, 2], n=6))
    assert again.stats.cached_prompt_tokens == 24  # not the 16 the second chat's entry shares


def test_a_chat_is_routed_to_the_replica_that_holds_it_while_the_load_stays_near_even():
    """Replicas: the prompt goes to the replica whose recent text shares >= ROUTE_MIN_PREFIX of its
    tokens if that one runs at most ROUTE_SLACK more rows than the roomiest; else by room."""
    from ssd.cluster.replicas import ROUTE_MIN_PREFIX, ROUTE_SLACK, route_order
    from ssd.engine.prefix import common_prefix

    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1
    held = ROUTE_MIN_PREFIX
    assert route_order([0, 1, 2], {0: 0, 1: 1, 2: 1}, {2: held}) == [2, 0, 1]
    assert route_order([0, 1, 2], {0: 0, 1: 1, 2: 1}, {1: held, 2: held + 1}) == [2, 0, 1]
    assert route_order([0, 1], {0: 0, 1: ROUTE_SLACK + 1}, {1: 10 * held}) == [0, 1]  # too busy: by room
    assert route_order([0, 1], {0: 0, 1: 0}, {1: held - 1}) == [0, 1]  # too little shared
    assert route_order([], {}, {}) == []


def test_a_replica_mid_step_is_passed_over_only_for_one_no_busier_than_ROUTE_SLACK_above_it():
    """Replicas admit between steps: a prompt skips one mid-step for another, but waits a step
    (an empty order) rather than pile onto one running more than ROUTE_SLACK rows above it."""
    from ssd.cluster.replicas import ROUTE_MIN_PREFIX, ROUTE_SLACK, route_order

    assert route_order([0, 1], {0: 1, 1: 1}, {}, stepping=[0]) == [1]
    assert route_order([0, 1], {0: 1, 1: 1 + ROUTE_SLACK}, {}, stepping=[0]) == [1]
    assert route_order([0, 1], {0: 1, 1: 2 + ROUTE_SLACK}, {}, stepping=[0]) == []  # wait for 0's step
    assert route_order([0, 1, 2], {0: 0, 1: 1, 2: 5}, {}, stepping=[0]) == [1]
    assert route_order([0, 1], {0: 0, 1: 0}, {}, stepping=[0, 1]) == []
    assert route_order([0, 1], {0: 0, 1: 3}, {}, stepping=[1]) == [0]  # a busier one mid-step: no bound
    assert route_order([0, 1], {0: 0, 1: 1}, {1: ROUTE_MIN_PREFIX}, stepping=[1]) == []  # the holder: its step


# --- SSD's draft side ----------------------------------------------------------------------------


def test_the_draft_starts_a_prompt_from_a_released_cache_that_shares_its_start(tiny_models):
    """The speculator's prefill takes the kept cache sharing the prompt's longest start, rolled
    back to it, and feeds the rest: its next-token logits are a fresh prefill's. A cache kept
    past a divergence (no roll back) feeds the wrong keys and fails this."""
    import torch

    from ssd.saguaro import protocol
    from ssd.saguaro.speculator import KEPT_SEQUENCES, Speculator
    from ssd.transport.inprocess import inprocess_pair

    _, draft = tiny_models
    _, draft_end = inprocess_pair()
    speculator = Speculator(draft, draft_end)  # its handlers called directly, no thread
    sampling, speculation = SamplingConfig(temperature=0.0), SpeculationConfig(mode="ssd", k=3)

    def prefill(seq: int, prompt: list[int], reuse: bool = True) -> KVSequence:
        speculator._prefill(protocol.prefill(seq, prompt, sampling, speculation, reuse=reuse))
        return speculator.sequences[seq].kv

    def fresh_logits(prompt: list[int]) -> torch.Tensor:
        kv = KVSequence(draft)
        kv.forward(prompt[:-1])
        return kv.forward(prompt[-1:])

    first = prefill(1, FIRST)
    first.forward([5, 6])  # as rounds feed it: positions past the prompt
    speculator._release(protocol.release(1))
    assert speculator.kept == [(speculation.fanout.ceiling, first)]
    for seq, prompt in ((2, FIRST + EXTRA), (3, FIRST[:9] + EXTRA)):  # a next turn; a prompt that parts at 9
        kv = prefill(seq, prompt)
        assert kv is first and kv.tokens == prompt[:-1] and not speculator.kept
        assert torch.allclose(kv.forward(prompt[-1:]), fresh_logits(prompt), rtol=0, atol=1e-12)
        kv.rollback(len(prompt) - 1)
        speculator._release(protocol.release(seq))
    other = prefill(4, [(t + 1) % 16 for t in FIRST])  # shares no first token: a cache of its own
    assert other is not first and other.length == len(FIRST) - 1 and len(speculator.kept) == 1
    for seq in range(5, 6 + KEPT_SEQUENCES):
        prefill(seq, [seq % 16, 1, 2])
        speculator._release(protocol.release(seq))
    assert len(speculator.kept) == KEPT_SEQUENCES and all(kv is not first for _, kv in speculator.kept)
    unkept = prefill(20, FIRST, reuse=False)  # the engine's cache off: never kept
    speculator._release(protocol.release(20))
    assert all(kv is not unkept for _, kv in speculator.kept)


def test_ssd_drafts_a_chats_next_turn_from_its_last_turns_cache(tiny_models, tiny_tokenizer, monkeypatch):
    """Through the engine: each later turn's draft prefill starts from its chat's last cache
    (the whole last prompt at least), and every turn still equals a fresh engine's."""
    from ssd.saguaro.speculator import Speculator

    reused, original = [], Speculator._reused

    def spy(self, prompt, branches):
        kv = original(self, prompt, branches)
        reused.append((list(prompt), 0 if kv is None else kv.length))
        return kv

    monkeypatch.setattr(Speculator, "_reused", spy)
    target, draft = tiny_models
    turns = _chats("ssd", target, draft, tiny_tokenizer, SamplingConfig(temperature=0.0))
    for i, (prompt, got, _, want) in enumerate(turns):
        assert _same("ssd", got, want), f"turn {i // 2} of chat {i % 2}"
    assert [p for p, _ in reused] == [prompt for prompt, *_ in turns]  # fresh engines keep nothing
    for i in range(2, len(turns)):
        assert reused[i][1] >= len(turns[i - 2][0]) - 1, f"turn {i // 2} of chat {i % 2}"
