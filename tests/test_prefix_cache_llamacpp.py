"""Prefix caching on llama.cpp's Q4_K_M kernels, whose keys and values depend on how a position
was computed (a prompt chunk's whole ubatches, a decode step's invariant ones): two chats taking
turns, in AR, SD and SSD, give each turn's tokens and logprobs bit for bit as a fresh engine
without the cache does, in every layout this host runs; a cache that also served the positions
decode steps computed (as llama.cpp's server's cache_prompt does) fails that check where
prompts and decode steps run different layouts."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from ssd.config import BatchingConfig, SamplingConfig  # noqa: E402
from ssd.engine import AREngine  # noqa: E402
from ssd.engine.kv_manager import KVManager  # noqa: E402
from ssd.engine.prefix import CachedPrefix, PrefixCache, whole_chunks  # noqa: E402
from ssd.models.llamacpp import LlamaCppModel  # noqa: E402
from ssd.models.tokenizer import eos_token_ids  # noqa: E402
from ssd.models import TinyTokenizer  # noqa: E402
from tests.test_llamacpp import (  # noqa: E402,F401 - fixtures (the last autouse)
    CFG, LONG, k_quant_files, k_quant_pair, short_prompts_on_the_plain_twin,
)
from tests.batches import run_together  # noqa: E402
from tests.test_prefix_cache import _chats, _engine, _fresh, _outcome, _request  # noqa: E402

CHUNK = 16
CHATS = (LONG, [(3 * i + 1) % CFG.vocab_size for i in range(37)])
TOK = TinyTokenizer(CFG.vocab_size)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_chats_taking_turns_equal_each_turn_alone_bit_for_bit(k_quant_pair, mode):
    target, draft = k_quant_pair
    turns = _chats(mode, target, draft, TOK, SamplingConfig(temperature=0.0), CHATS, CHUNK, n=12)
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert got == want, f"turn {i // 2} of chat {i % 2}"
        last = turns[i - 2][0] if i >= 2 else []
        assert cached == whole_chunks(last, len(last), CHUNK, eos_token_ids(TOK, target)) and (i < 2 or cached > 0)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_replies_prefilled_between_turns_equal_fresh_runs_bit_for_bit(k_quant_pair, mode):
    """The engine's idle work prefills each reply as the next turn's prompt chunks would be:
    the next turn takes them, and its tokens and logprobs equal a fresh run's, bit for bit."""
    target, draft = k_quant_pair
    turns = _chats(mode, target, draft, TOK, SamplingConfig(temperature=0.0), CHATS, CHUNK, n=24, warm=True)
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert got == want, f"turn {i // 2} of chat {i % 2}"
        if i >= 2:
            last, (ids, _) = turns[i - 2][0], turns[i - 2][1]
            held, stops = last + ids, eos_token_ids(TOK, target)
            assert cached == whole_chunks(held, len(held), CHUNK, stops) > whole_chunks(last, len(last), CHUNK, stops)


def test_serving_the_positions_decode_steps_computed_fails_the_check(k_quant_pair, monkeypatch):
    """The premise of whole prompt chunks: a cache that kept all a row held, its output too, and
    served any common prefix, changes later turns' logprobs where prompts run on the plain
    layouts and decode steps on the repacked ones (the real pair's setting on an AMD EPYC host;
    8.7e-2 here). The cache holds BF16 values: in the probe's F16 ones this tiny model's
    differences happen to round away. In the repacked layout alone its decode steps and chunks
    agree (0.0)."""
    target, _ = k_quant_pair
    monkeypatch.setattr(LlamaCppModel, "kv_type", property(lambda self: "bf16"))

    def keep_all(self, row):
        if row.error is not None or self.prefix is None:  # the fresh engines keep nothing
            return False
        self.prefix.put(CachedPrefix(tuple(row.target.tokens), row.target, row.draft))
        return True

    monkeypatch.setattr(KVManager, "_keep", keep_all)
    engine = AREngine(target, TOK, BatchingConfig(prefill_chunk=CHUNK))
    engine.kv.prefix = PrefixCache(1)
    turns = _chats("ar", target, None, TOK, SamplingConfig(temperature=0.0), CHATS, CHUNK, n=12, engine=engine)
    assert all(cached > len(last) for (last, *_), (_, _, cached, _) in zip(turns, turns[2:]))  # the outputs too
    apart = max(abs(a - b) for _, (_, got), _, (_, want) in turns for a, b in zip(got, want))
    print(f"\nlogprobs apart by {apart:.2e} ({'repacked' if target.repacked else 'plain'})")
    if target.plain_twin is not None:
        assert apart > 0


def test_cached_prefixes_give_their_slots_to_new_rows(k_quant_pair):
    """A context has batching.max_rows slots: entries hold the slots no row needs, and the
    oldest goes when a new row needs one. Two slots: A and B cached, C drops A's entry; B's
    next turn still takes its own, A's does not, and both equal fresh runs."""
    target, _ = k_quant_pair
    engine = AREngine(target, TOK, BatchingConfig(prefill_chunk=CHUNK, max_rows=2))
    third = [(7 * i + 2) % CFG.vocab_size for i in range(35)]
    outputs = [engine.generate(_request(p, n=6)).token_ids for p in (*CHATS, third)]
    assert len(engine.kv.prefix) == 2
    for chat, cached in ((1, 32), (0, 0)):
        prompt = [*CHATS[chat], *outputs[chat], 1, 2, 3]
        result = engine.generate(_request(prompt, n=6))
        assert result.stats.cached_prompt_tokens == cached
        assert _outcome(result) == _fresh("ar", target, None, TOK, prompt, SamplingConfig(temperature=0.0), CHUNK, 6)


def test_replies_that_end_their_turn_are_served_whole_bit_for_bit(k_quant_pair):
    """Chunks that end at an end-of-turn token (the reply's last) on Q4_K_M: a short chunk runs
    in the invariant ubatches, a fresh prefill computes it the same, and the next turn, taking
    all of the last prompt and reply, equals a fresh run bit for bit."""
    target, draft = k_quant_pair
    end = AREngine(target, TOK).generate(_request(CHATS[0], n=6)).token_ids[3]
    tok = TinyTokenizer(CFG.vocab_size, eos_token_id=end)
    stops = eos_token_ids(tok, target)
    turns = _chats("sd", target, draft, tok, SamplingConfig(temperature=0.0), CHATS, CHUNK, n=24, warm=True)
    whole_turns = 0
    for i, (prompt, got, cached, want) in enumerate(turns):
        assert got == want, f"turn {i // 2} of chat {i % 2}"
        if i >= 2:
            held = turns[i - 2][0] + turns[i - 2][1][0]
            assert cached == whole_chunks(held, len(held), CHUNK, stops)
            whole_turns += held[-1] == end and cached == len(held)
    assert whole_turns > 0


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_chats_under_one_system_prompt_copy_its_slot_bit_for_bit(k_quant_pair, mode):
    """A second chat under the same 32-token system prompt gets a copy of the first's slot
    (LlamaCppContext.copy), whose entry stays for its own next turn; every turn equals a fresh
    run bit for bit."""
    target, draft = k_quant_pair
    system = LONG[:32]
    chats = (system + LONG[32:] + [1, 2], system + [9, 8, 7, 6, 5, 4, 3, 2, 1])
    turns = _chats(mode, target, draft, TOK, SamplingConfig(temperature=0.0), chats, CHUNK, n=8, turns=2)
    assert all(got == want for _, got, _, want in turns)
    assert [cached for _, _, cached, _ in turns] == [0, 32, 32, 32]


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_long_and_short_chunks_on_their_layouts_equal_fresh_runs(k_quant_files, monkeypatch, mode):
    """The shipped PLAIN_PREFILL_MIN where prompts run on the plain twin: chunks of 64 move
    there, the shorter ends of prompts and replies run in place; chats taking turns with idle
    prefill still equal fresh runs bit for bit, and both kinds of chunk ran (asserted)."""
    from ssd.models import llamacpp
    from tests.test_llamacpp import PLAIN_PREFILL_MIN, repack_probe

    if not repack_probe(k_quant_files[0])["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    monkeypatch.setattr(llamacpp, "PLAIN_PREFILL_MIN", PLAIN_PREFILL_MIN)
    target, draft = (llamacpp.LlamaCppModel(f, use_extra_bufts=True, plain_prefill=True) for f in k_quant_files)
    moved, in_place = [], []
    real_apart, real_call = llamacpp.LlamaCppContext._prompt_chunk_apart, llamacpp.LlamaCppContext._decode_call
    monkeypatch.setattr(llamacpp.LlamaCppContext, "_prompt_chunk_apart",
                        lambda self, piece: moved.append(len(piece[3])) or real_apart(self, piece))
    monkeypatch.setattr(llamacpp.LlamaCppContext, "_decode_call", lambda self, pieces: in_place.append(
        sum(len(p[3]) for p in pieces)) or real_call(self, pieces))
    chats = ([(5 * i + 3) % CFG.vocab_size for i in range(150)], [(3 * i + 1) % CFG.vocab_size for i in range(140)])
    turns = _chats(mode, target, draft, TOK, SamplingConfig(temperature=0.0), chats, 64, n=24, warm=True)
    assert all(got == want for _, got, _, want in turns)
    assert any(cached for _, _, cached, _ in turns)
    assert max(moved) == 64 and any(PLAIN_PREFILL_MIN > n > target.invariant_options()["n_ubatch"] for n in in_place)


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_rows_admitted_together_copy_one_prefill_bit_for_bit(k_quant_pair, mode):
    """Three samples of one prompt and a request under its system prompt, admitted together
    (ssd.engine.kv_manager `follow`): the first row prefills, the others copy its slot's 32 shared
    positions, and each row's tokens and logprobs equal its request's alone on a fresh
    engine without the cache, bit for bit (seeded T = 1 in AR; SSD's draws follow its
    hits: greedy there)."""
    target, draft = k_quant_pair
    prompts = [LONG[:40], LONG[:40], LONG[:40], LONG[:32] + [9, 8, 7, 6, 5, 4, 3]]
    sampling = SamplingConfig(temperature=0.0) if mode != "ar" else SamplingConfig(temperature=1.0)
    engine = _engine(mode, target, draft, TOK, BatchingConfig(prefill_chunk=CHUNK, max_rows=4))
    requests = [_request(p, dataclasses.replace(sampling, seed=i), 8) for i, p in enumerate(prompts)]
    try:
        results = run_together(engine, requests)
    finally:
        getattr(engine, "close", lambda: None)()
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 32, 32, 32]
    for request, result in zip(requests, results):
        assert _outcome(result) == _fresh(mode, target, draft, TOK, request.prompt_ids, request.sampling, CHUNK, 8)
