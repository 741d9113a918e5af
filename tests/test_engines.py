"""AR and SD engines on the tiny fp64 pair, one request at a time (a batch of one): greedy equality and end conditions."""

import dataclasses

import pytest
import torch

from ssd.config import GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import TinyTokenizer, build_tiny_model
from ssd.verify import verify
from tests.conftest import TINY

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


def ar_tokens(target, tokenizer, prompt, n, sampling=GREEDY):
    return AREngine(target, tokenizer).generate(GenerationRequest(prompt, sampling, GenerationConfig(max_new_tokens=n)))


@pytest.mark.parametrize("k", range(1, 9))
def test_sd_greedy_equals_ar(tiny_models, tiny_tokenizer, k):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=k))
    for prompt in PROMPTS:
        ar = ar_tokens(target, tiny_tokenizer, prompt, 48)
        sd = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=48)))
        assert sd.token_ids == ar.token_ids
        assert sd.stats.accepted > 0 and sd.stats.accepted < sd.stats.drafted  # both branches ran
        assert len(sd.stats.drafted_at) == k  # rounds drafted K tokens, no more


@pytest.mark.parametrize("draft_kind", ["target", "unrelated"])
def test_sd_greedy_equals_ar_at_the_extremes_of_acceptance(tiny_models, tiny_tokenizer, draft_kind):
    target, _ = tiny_models
    other = target if draft_kind == "target" else build_tiny_model(dataclasses.replace(TINY, seed=5), torch.float64)
    sd = SDEngine(target, other, tiny_tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40)))
    assert sd.token_ids == ar_tokens(target, tiny_tokenizer, [1, 2, 3], 40).token_ids
    if draft_kind == "target":
        assert sd.stats.acceptance_rate == 1.0


def test_sd_engine_is_reusable_across_requests(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))
    first = [engine.generate(GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=20))).token_ids for p in PROMPTS]
    again = [engine.generate(GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=20))).token_ids for p in PROMPTS]
    # Each request is AR's output, not merely the same (possibly wrong) output twice.
    assert first == again == [ar_tokens(target, tiny_tokenizer, p, 20).token_ids for p in PROMPTS]


def test_sampled_output_is_reproducible_per_seed(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))
    sampling = SamplingConfig(temperature=1.0, seed=42)
    a = engine.generate(GenerationRequest([1, 2], sampling, GenerationConfig(max_new_tokens=30))).token_ids
    b = engine.generate(GenerationRequest([1, 2], sampling, GenerationConfig(max_new_tokens=30))).token_ids
    c = engine.generate(GenerationRequest([1, 2], SamplingConfig(temperature=1.0, seed=43), GenerationConfig(max_new_tokens=30))).token_ids
    assert a == b and a != c


# --- end conditions under multi-token acceptance ----------------------------------
# The draft is the target itself, so every round accepts all K tokens and the
# end condition always falls inside a multi-token round.

def perfect_sd(tiny_models, tokenizer, k=4):
    target, _ = tiny_models
    return SDEngine(target, target, tokenizer, SpeculationConfig(mode="sd", k=k))


@pytest.mark.parametrize("n", [1, 2, 5, 7, 13])
def test_max_new_tokens_is_exact(tiny_models, tiny_tokenizer, n):
    ar = ar_tokens(tiny_models[0], tiny_tokenizer, [1, 2, 3], n)
    sd = perfect_sd(tiny_models, tiny_tokenizer).generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=n)))
    assert sd.token_ids == ar.token_ids and len(sd.token_ids) == n
    assert sd.finish_reason == ar.finish_reason == "length"


def test_stop_string_inside_an_accepted_round(tiny_models, tiny_tokenizer):
    reference = ar_tokens(tiny_models[0], tiny_tokenizer, [1, 2, 3], 40)
    # A two-character stop string that first completes at position 6, which
    # with K = 4 lies inside the second round (tokens 1..5 come from round 1).
    stop = reference.text[5:7]
    assert reference.text.find(stop) == 5
    out = []
    sd = perfect_sd(tiny_models, tiny_tokenizer).generate(GenerationRequest(
        [1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40, stop=[stop]), on_tokens=out.extend
    ))
    assert sd.finish_reason == "stop"
    assert sd.text == reference.text[:5]
    assert sd.token_ids == reference.token_ids[:7]  # nothing past the token that completed it
    assert out == sd.token_ids


def test_earliest_stop_string_wins(tiny_models, tiny_tokenizer):
    reference = ar_tokens(tiny_models[0], tiny_tokenizer, [1, 2, 3], 40)
    late, early = reference.text[9:11], reference.text[3:4]
    first = reference.text.find(early)
    sd = perfect_sd(tiny_models, tiny_tokenizer).generate(GenerationRequest(
        [1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40, stop=[late, early])
    ))
    assert sd.text == reference.text[:first]


def eos_at(tiny_models, tokenizer, position):
    """A tokenizer whose EOS is the greedy token at `position` (its first occurrence)."""
    ids = ar_tokens(tiny_models[0], tokenizer, [1, 2, 3], 40).token_ids
    eos = ids[position]
    return TinyTokenizer(TINY.vocab_size, eos_token_id=eos), ids, ids.index(eos)


def test_eos_inside_an_accepted_round(tiny_models, tiny_tokenizer):
    tokenizer, ids, first = eos_at(tiny_models, tiny_tokenizer, 6)
    target = tiny_models[0]
    sd = SDEngine(target, target, tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40)))
    assert sd.finish_reason == "eos"
    assert sd.token_ids == ids[: first + 1]  # EOS is the last token, nothing after it


def test_ignore_eos_runs_to_max_tokens(tiny_models, tiny_tokenizer):
    tokenizer, ids, _ = eos_at(tiny_models, tiny_tokenizer, 6)
    target = tiny_models[0]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    sd = SDEngine(target, target, tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest([1, 2, 3], GREEDY, config))
    assert sd.finish_reason == "length" and sd.token_ids == ids


def test_metrics_are_consistent(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=60)))
    s = sd.stats
    assert s.new_tokens == 60 and s.mode == "sd" and s.k == 4
    assert s.accepted == sum(s.accepted_at) and s.drafted == sum(s.drafted_at)
    # Every round adds its accepted tokens plus one (the last may be cut short).
    assert s.accepted + s.rounds + 1 >= s.new_tokens
    rates = s.acceptance_by_position
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # reaching i+1 requires accepting i
    assert 0 < s.time_to_first_token_s <= s.total_s and s.tokens_per_s > 0


def test_empty_prompt_is_refused(tiny_models, tiny_tokenizer):
    with pytest.raises(ValueError, match="prompt_ids"):
        AREngine(tiny_models[0], tiny_tokenizer).generate(GenerationRequest([], GREEDY, GenerationConfig()))


def test_cancel_stops_within_one_round(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    rounds = []
    out = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest(
        [1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=100),
        on_tokens=rounds.append, cancelled=lambda: len(rounds) >= 3,
    ))
    assert out.finish_reason == "aborted" and len(rounds) == 3
    assert out.token_ids == [t for r in rounds for t in r]


def test_every_round_times_the_target(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    config = GenerationConfig(max_new_tokens=12)
    for engine in (AREngine(target, tiny_tokenizer), SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3))):
        stats = engine.generate(GenerationRequest([1, 2, 3], GREEDY, config)).stats
        assert stats.rounds > 0 and 0 < stats.target_s < stats.total_s


def test_speculation_settings_travel_with_each_request(tiny_models, tiny_tokenizer):
    """One engine serves every K: the request's settings win over the engine's default."""
    target, draft = tiny_models
    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=4))
    for k in (1, 3, 6):
        out = engine.generate(GenerationRequest(
            [1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40), SpeculationConfig(mode="sd", k=k)
        ))
        assert out.stats.k == k and len(out.stats.drafted_at) == k  # no round drafted more than k
        assert out.token_ids == ar_tokens(target, tiny_tokenizer, [1, 2, 3], 40).token_ids
    assert engine.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=8))).stats.k == 4


def test_an_engine_refuses_a_mode_it_does_not_run(tiny_models, tiny_tokenizer):
    with pytest.raises(ValueError, match="speculation.mode 'ssd' sent to the sd engine"):
        SDEngine(*tiny_models, tiny_tokenizer, SpeculationConfig(mode="sd", k=4)).generate(
            GenerationRequest([1, 2], GREEDY, speculation=SpeculationConfig(mode="ssd"))
        )


def test_stats_total_pools_every_counter(tiny_models, tiny_tokenizer):
    """The one stats merge (server metrics, bench rows, sweeps, live ablation):
    counts add, per-position lists add by index, rates are pooled, not averaged."""
    from ssd.engine.metrics import total

    engine = SDEngine(*tiny_models, tiny_tokenizer, SpeculationConfig(mode="sd", k=4))
    runs = [engine.generate(GenerationRequest(p, GREEDY, GenerationConfig(max_new_tokens=20))).stats for p in PROMPTS]
    t = total(runs)
    assert t.requests == len(runs) and t.mode == "sd" and t.k == 4
    for name in ("new_tokens", "rounds", "drafted", "accepted", "prompt_tokens"):
        assert getattr(t, name) == sum(getattr(s, name) for s in runs)
    assert t.accepted_at == [sum(s.accepted_at[i] for s in runs if i < len(s.accepted_at)) for i in range(4)]
    assert t.acceptance_rate == sum(s.accepted for s in runs) / sum(s.drafted for s in runs)
    assert runs[0].requests == 1 and t.accepted_at is not runs[0].accepted_at  # inputs untouched


def test_sampled_q_rows_are_moved_to_the_targets_device_before_verifying(tiny_models, tiny_tokenizer, monkeypatch):
    """q rows may arrive on another device than p (over a host link they are in
    host memory, the target on a GPU). 'meta' stands in for the far side: the
    engine hands the verifier q on p's device."""
    target, draft = tiny_models
    vocab = TINY.vocab_size

    def far_drafts(chains):
        for chain in chains:
            chain.tokens = [1] * chain.k
            chain.q_rows = [torch.empty(vocab, dtype=torch.float64, device="meta")] * chain.k

    moves, verified_on = [], []

    def move(t, device):
        moves.append((t.device.type, torch.device(device).type))
        return torch.full(t.shape, 1.0 / vocab, dtype=t.dtype, device=device)  # stands in for the copy

    def recording_verify(drafted, q, p, gen, greedy=False):
        verified_on.append((q.device, p.device))
        return verify(drafted, q, p, gen, greedy)

    monkeypatch.setattr("ssd.engine.sd.draft_chains", far_drafts)
    monkeypatch.setattr("ssd.engine.rows.to_device", move)
    engine = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3), verifier=recording_verify)
    out = engine.generate(GenerationRequest([1, 2], SamplingConfig(temperature=1.0, seed=0), GenerationConfig(max_new_tokens=12)))
    assert len(out.token_ids) == 12
    assert moves and set(moves) == {("meta", "cpu")}
    assert all(q == p == torch.device("cpu") for q, p in verified_on)


@pytest.mark.parametrize("temperature", [1e-300, 1e-310])
def test_a_tiny_temperature_decodes_like_greedy(tiny_models, tiny_tokenizer, temperature):
    target, draft = tiny_models
    greedy = ar_tokens(target, tiny_tokenizer, [1, 2, 3], 30).token_ids
    sampling = SamplingConfig(temperature=temperature, seed=5)
    assert ar_tokens(target, tiny_tokenizer, [1, 2, 3], 30, sampling).token_ids == greedy
    sd = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=4)).generate(GenerationRequest([1, 2, 3], sampling, GenerationConfig(max_new_tokens=30)))
    assert sd.token_ids == greedy
