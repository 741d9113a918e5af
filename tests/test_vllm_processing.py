"""vLLM's repetition_penalty, bad_words and min_tokens are part of the target's law, exactly, in every mode.

Model and modes as in test_processing: one layer, fp64, a 6-token vocabulary,
the draft the target plus 10 % weight noise, K = 3; AR, SD (the draft drafts
under the same processing) and SSD (the speculator unprocessed).

- repetition_penalty R: the law is checked against transformers'
  RepetitionPenaltyLogitsProcessor (an independent reference) on the prompt
  plus every prefix the enumeration reaches. Greedy: AR == SD == SSD, and
  the output differs from the unpenalised one. Sampled (T = 1): the joint of
  tokens 1-4 of 5, chi-square as in test_distribution (tests/stats.py).
  Power: `ignoring_drafts` (rows penalise the prompt and the committed tokens
  only, not the drafts before them) fails the same test in SD.
- allowed_token_ids {0, 2, 3, 4}: greedy and sampled as above; its -inf is static, the term
  logit_bias takes, whose break test_processing's chi-square catches.
- bad_words (as token id sequences): "5 5" (the likeliest pair) and "1": the law bans 1
  everywhere and 5 right after a 5. Greedy: AR == SD == SSD, free of them; sampled: as for
  the penalty. Power: `ignoring_drafts` (matched against committed tokens only).
- min_tokens M with an EOS: EOS is banned until M tokens are out, so no
  output ends before M; after that EOS ends it. Sampled: the joint of tokens
  1-4 with the end as a cell value, against the law enumerated with EOS
  banned at positions < M (about 12 % of the outputs end early). Power:
  `min_tokens_ignores_drafts` (the ban counts committed tokens only, so a
  verification row past M still bans EOS) fails.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.output import OutputTracker
from ssd.engine.processing import LogitsProcessor
from ssd.engine.request import GenerationRequest, Processing
from ssd.models import TinyTokenizer
from ssd.saguaro.target import SSDEngine
from ssd.sampling import probs_from_logits
from tests.stats import ALPHA, chi_square_pvalue, report_pvalue
from tests.test_processing import K, N_TOKENS, POSITIONS, PROMPT, SMALL, V, ignoring_drafts, pair  # noqa: F401

R = 2.0
REPETITION = Processing(repetition_penalty=R)
BAD = ((5, 5), (1,))  # vLLM's bad_words as token ids: no 5 right after a 5 (the likeliest pair), never a 1
BAD_WORDS = Processing(bad_words=BAD)
EOS = 5  # the model's likeliest token: greedy decoding ends at once without min_tokens
M = 3  # min_tokens: EOS banned at generated positions 0..2, a round's drafts cross the line
END = -1  # a cell's value at positions past the end
SAMPLES = 800
SAMPLED = SamplingConfig(temperature=1.0)


def engine(mode: str, pair, eos: int | None = None):
    target, draft = pair
    tok = TinyTokenizer(V, eos_token_id=eos)
    if mode == "ar":
        return AREngine(target, tok)
    spec = SpeculationConfig(mode=mode, k=K)
    return SDEngine(target, draft, tok, spec) if mode == "sd" else SSDEngine.in_process(target, draft, tok, spec)


def generate(eng, sampling, max_new, processing=None, min_tokens=0, prompt=PROMPT, **generation_fields):
    generation = GenerationConfig(max_new_tokens=max_new, min_tokens=min_tokens, **generation_fields)
    return eng.generate(GenerationRequest(prompt, sampling, generation, processing=processing))


# --- the reference laws ----------------------------------------------------------------------


def hf_penalised(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """transformers' repetition penalty over the prompt and the generated prefix."""
    ids = torch.tensor([PROMPT + prefix])
    return RepetitionPenaltyLogitsProcessor(R)(ids, logits[None].clone())[0]


def bad_words_banned(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    out = logits.clone()
    for word in BAD:
        if len(prefix) >= len(word) - 1 and prefix[len(prefix) - len(word) + 1:] == list(word[:-1]):
            out[word[-1]] = float("-inf")
    return out


def eos_banned(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    out = logits.clone()
    if len(prefix) < M:
        out[EOS] = float("-inf")
    return out


@torch.no_grad()
def exact_joint(model, process, ends: bool) -> dict[tuple[int, ...], float]:
    """P(tokens at POSITIONS) with `process(logits, prefix)` applied; with `ends`, EOS ends the
    sequence and the positions after it read END."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def cell(seq: list[int]) -> tuple[int, ...]:
        return tuple(seq[i] if i < len(seq) else END for i in POSITIONS)

    def walk(prefix: list[int], mass: float) -> None:
        logits = model(input_ids=torch.tensor([PROMPT + prefix])).logits[0, -1].to(torch.float64)
        probs = probs_from_logits(process(logits, prefix), SAMPLED)
        for token, p in enumerate(probs.tolist()):
            if p <= 0:
                continue
            seq = prefix + [token]
            if len(seq) == N_TOKENS or (ends and token == EOS):
                out[cell(seq)] += mass * p
            else:
                walk(seq, mass * p)

    walk([], 1.0)
    return dict(out)


def draws(eng, processing=None, min_tokens=0, samples: int = SAMPLES) -> list[tuple[int, ...]]:
    out = []
    for seed in range(samples):
        result = generate(eng, dataclasses.replace(SAMPLED, seed=seed), N_TOKENS, processing, min_tokens)
        ids = result.token_ids
        assert len(ids) == N_TOKENS or (ids[-1] == EOS and result.finish_reason == "eos" and len(ids) > M), result
        out.append(tuple(ids[i] if i < len(ids) else END for i in POSITIONS))
    return out


def run(mode, pair, eos=None, **kw):
    eng = engine(mode, pair, eos)
    try:
        return draws(eng, **kw)
    finally:
        eng.close()


# --- breaks -----------------------------------------------------------------------------------


def min_tokens_ignores_drafts(monkeypatch) -> None:
    original = LogitsProcessor.bias

    def bias(self, vocab):
        out = original(self, vocab)
        if self.counts.total() < self.min_tokens:
            out.add[EOS] = float("-inf")
        return out

    monkeypatch.setattr(LogitsProcessor, "bias", bias)


# --- repetition_penalty ---------------------------------------------------------------------


def test_the_penalty_is_transformers_over_the_prompt_and_the_output():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(V, generator=gen, dtype=torch.float64) * 3
        generated = torch.randint(0, V, (3,), generator=gen).tolist()
        processor = LogitsProcessor(REPETITION, prompt_ids=PROMPT)
        processor.commit(generated[:2])
        processor.push(generated[2])
        got = processor.bias(V).apply(logits)
        torch.testing.assert_close(got, hf_penalised(logits, generated), rtol=0, atol=0)


# --- bad_words --------------------------------------------------------------------------------


def test_a_bad_words_last_token_is_banned_where_the_output_sets_it_up():
    processor = LogitsProcessor(BAD_WORDS)
    banned = lambda: {t for t in range(V) if processor.bias(V).forbids(t)}  # noqa: E731
    assert banned() == {1}
    processor.commit([5])
    assert banned() == {1, 5}
    processor.push(3)
    assert banned() == {1}
    processor.reset()
    processor.commit([2, 5])
    assert banned() == {1, 5}


# --- repetition_penalty, bad_words, allowed_token_ids: greedy, the law, power ---------------------


@dataclass(frozen=True)
class Law:
    spec: Processing
    process: Callable[[torch.Tensor, list[int]], torch.Tensor]  # the reference law's processing of logits
    prompts: list[list[int]]  # prompts whose greedy output the processing changes
    holds: Callable[[list[int]], bool]  # what any output under it satisfies
    reads_drafts: str | None  # the LogitsProcessor method a break hides the drafts from (None: static)


ALLOWED = (0, 2, 3, 4)  # not 5, the likeliest token, nor 1


def allowed_only(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    return logits.masked_fill(~torch.isin(torch.arange(V), torch.tensor(ALLOWED)), float("-inf"))


def no_bad_word(ids: list[int]) -> bool:
    return 1 not in ids and all(ids[i : i + 2] != [5, 5] for i in range(len(ids) - 1))


LAWS = {
    "repetition_penalty": Law(REPETITION, hf_penalised, [[5, 5, 2, 1], [3], [2, 4]], lambda ids: True, "_repeated"),
    "bad_words": Law(BAD_WORDS, bad_words_banned, [PROMPT, [5, 5, 2, 1], [3]], no_bad_word, "_bad_words_banned"),
    # A static -inf, the additive term logit_bias takes too: its break is test_processing's.
    "allowed_token_ids": Law(Processing(allowed_token_ids=ALLOWED), allowed_only, [PROMPT, [3]],
                             lambda ids: set(ids) <= set(ALLOWED), None),
}


@pytest.mark.parametrize("name", LAWS)
def test_greedy_with_the_processing_is_ar_with_it_in_every_mode(pair, name):
    law, greedy = LAWS[name], SamplingConfig(temperature=0.0)
    for prompt in law.prompts:
        reference = generate(engine("ar", pair), greedy, 24, law.spec, prompt=prompt).token_ids
        assert law.holds(reference) and reference != generate(engine("ar", pair), greedy, 24, prompt=prompt).token_ids
        assert generate(engine("sd", pair), greedy, 24, law.spec, prompt=prompt).token_ids == reference
        with engine("ssd", pair) as ssd:
            assert generate(ssd, greedy, 24, law.spec, prompt=prompt).token_ids == reference


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("name", LAWS)
def test_sampled_output_follows_the_processed_law(pair, name, mode):
    law = LAWS[name]
    samples = run(mode, pair, processing=law.spec)
    pvalue = chi_square_pvalue(samples, exact_joint(pair[0], law.process, ends=False))
    report_pvalue(name, "T=1", mode, len(samples), pvalue)
    assert pvalue > ALPHA, pvalue


@pytest.mark.parametrize("name", [name for name, law in LAWS.items() if law.reads_drafts])
def test_the_chi_square_sees_processing_that_ignores_the_drafts(pair, monkeypatch, name):
    law = LAWS[name]
    expected = exact_joint(pair[0], law.process, ends=False)
    ignoring_drafts(monkeypatch, law.reads_drafts)
    samples = run("sd", pair, processing=law.spec)
    pvalue = chi_square_pvalue(samples, expected)
    report_pvalue(name, "T=1", f"{law.reads_drafts} ignores the drafts", len(samples), pvalue)
    assert pvalue < ALPHA, pvalue


# --- min_tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("end", ["eos", "stop_token_ids"])
def test_min_tokens_holds_the_end_back_and_greedy_stays_ar(pair, mode, end):
    """Greedy decoding ends at once (token EOS is the likeliest first token), as the model's EOS
    or as vLLM's stop_token_ids; min_tokens makes the output that long at least, free of that
    token before it, and every mode gives AR's tokens."""
    greedy = SamplingConfig(temperature=0.0)
    eos, fields = (EOS, {}) if end == "eos" else (None, {"stop_token_ids": [EOS]})
    free = generate(engine("ar", pair, eos), greedy, 24, **fields)
    assert free.finish_reason == ("eos" if end == "eos" else "stop") and free.token_ids[-1] == EOS
    assert len(free.token_ids) <= M, free.token_ids
    for min_tokens in (M, 8):
        reference = generate(engine("ar", pair, eos), greedy, 24, min_tokens=min_tokens, **fields)
        assert len(reference.token_ids) > min_tokens and EOS not in reference.token_ids[:min_tokens]
        eng = engine(mode, pair, eos)
        try:
            assert generate(eng, greedy, 24, min_tokens=min_tokens, **fields).token_ids == reference.token_ids
        finally:
            eng.close()


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_sampled_output_follows_the_law_with_eos_held_back(pair, mode):
    expected = exact_joint(pair[0], eos_banned, ends=True)
    samples = run(mode, pair, EOS, min_tokens=M)
    ended = sum(s[-1] == END for s in samples) / len(samples)
    assert 0.05 <= ended <= 0.95, ended  # EOS ends rows after M, and rows also run to the end
    pvalue = chi_square_pvalue(samples, expected)
    report_pvalue("min_tokens", f"M={M} T=1", mode, len(samples), pvalue)
    assert pvalue > ALPHA, pvalue


def test_the_chi_square_sees_min_tokens_that_ignore_the_drafts(pair, monkeypatch):
    expected = exact_joint(pair[0], eos_banned, ends=True)
    min_tokens_ignores_drafts(monkeypatch)
    samples = run("sd", pair, EOS, min_tokens=M)
    pvalue = chi_square_pvalue(samples, expected)
    report_pvalue("min_tokens", f"M={M} T=1", "min_tokens_ignores_drafts", len(samples), pvalue)
    assert pvalue < ALPHA, pvalue


def test_no_stop_string_ends_the_output_within_min_tokens():
    """vLLM's rule: a stop string counts only when it ends past the first min_tokens tokens'
    text; one that straddles that line counts."""
    tok = TinyTokenizer(V)  # ids 0-5 are "abcdef"

    def ended_at(stop: list[str], tokens: list[int], min_tokens: int) -> tuple[int, str]:
        out = OutputTracker(tok, GenerationConfig(max_new_tokens=20, stop=stop, min_tokens=min_tokens), set())
        return len(out.add(tokens)), out.text()

    tokens = [0, 1, 0, 1, 2, 0, 1]  # "ababcab"
    assert ended_at(["ab"], tokens, 0) == (2, "")
    assert ended_at(["ab"], tokens, 3) == (4, "ab")  # "ab" at 0 is held; "ab" at 2 ends past token 3
    assert ended_at(["ab"], tokens, 4) == (7, "ababc")
    assert ended_at(["bc"], tokens, 4) == (5, "aba")
    assert ended_at(["ab"], tokens, 7) == (7, "ababcab")  # min_tokens reached at the end: nothing past it


def test_a_stop_token_ends_the_output_and_stays_in_it_and_a_stop_string_can_stay_too():
    tok = TinyTokenizer(V)
    tokens = [0, 1, 0, 1, 2, 0, 1]  # "ababcab"
    out = OutputTracker(tok, GenerationConfig(max_new_tokens=20, stop_token_ids=[2]), set())
    assert out.add(tokens) == [0, 1, 0, 1, 2] and out.finish_reason == "stop" and out.text() == "ababc"
    out = OutputTracker(tok, GenerationConfig(max_new_tokens=20, stop=["bc", "ab"], include_stop_str_in_output=True),
                        set())
    assert out.add(tokens) == [0, 1] and out.text() == "ab"
    out = OutputTracker(tok, GenerationConfig(max_new_tokens=20, stop=["bc"], include_stop_str_in_output=True,
                                              min_tokens=1), set())
    assert out.add(tokens) == [0, 1, 0, 1, 2] and out.text() == "ababc"
