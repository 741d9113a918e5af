"""SSD through the in-process channel: greedy == AR, and the protocol's behaviour."""

import dataclasses
import time

import pytest
import torch

import ssd.saguaro.speculator as speculator_module
from ssd.config import GLUES, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from ssd.models import build_tiny_model
from ssd.saguaro.builder import guessed_outcomes
from ssd.verify import verify
from tests.conftest import TINY
from tests.spies import QPRIME_TOL, count_decoder_starts, record_builds, saguaro_errors, slow_draft_counting_cuts

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 0, 1, 9, 12, 15]]


def ssd_spec(k=4, budget=8, kind="geometric", anytime=False, **kw) -> SpeculationConfig:
    """Builds that run to their budget and a cache of the draft's entries only, so that
    the tests can see each setting take effect; test_ssd_greedy_equals_ar_adaptive
    runs the defaults (an anytime build, free n-gram entries)."""
    kw.setdefault("ngram_candidates", False)
    return SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(kind=kind, budget=budget, anytime=anytime), **kw)


def ar_ids(target, tokenizer, prompt, n):
    return AREngine(target, tokenizer).generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=n))).token_ids


@pytest.fixture(scope="module")
def references(tiny_models, tiny_tokenizer):
    return {tuple(p): ar_ids(tiny_models[0], tiny_tokenizer, p, 40) for p in PROMPTS}


@pytest.mark.parametrize("k, budget", [(1, 1), (2, 3), (3, 8), (4, 8), (4, 16), (6, 4), (8, 24)])
@pytest.mark.parametrize("kind", ["uniform", "geometric"])
@pytest.mark.parametrize("glue", GLUES)
def test_ssd_greedy_equals_ar(tiny_models, tiny_tokenizer, references, k, budget, kind, glue, monkeypatch):
    target, draft = tiny_models
    builds = record_builds(monkeypatch)
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec(k, budget, kind, glue=glue)) as ssd:
        for prompt in PROMPTS:
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == references[tuple(prompt)]
            assert out.stats.spec.lookups > 0 and len(out.stats.drafted_at) == k  # K tokens drafted, no more
    # The settings took effect: every cache held `budget` outcomes, prepared for a K-token speculation
    # (K - 1 after a bonus branch's hit when the glue is folded).
    assert builds and all(len(b.entries) == budget for b in builds)
    lengths = {len(b.drafted) for b in builds}
    assert lengths == {k} if glue != "fold" or k == 1 else k in lengths and lengths <= {k, k - 1}


@pytest.mark.parametrize("k, budget, glue", [(1, 2, "fold"), (3, 4, "fold"), (4, 8, "reuse"), (6, 4, "full")])
def test_ssd_greedy_equals_ar_adaptive(tiny_models, tiny_tokenizer, references, k, budget, glue, monkeypatch):
    """The defaults: anytime builds (slowed here so that the target's outcome
    arrives mid-build and cuts them) and free n-gram entries; greedy output is AR's,
    builds were cut, and the n-gram entries served hits."""
    target, draft = tiny_models
    cuts = slow_draft_counting_cuts(monkeypatch)
    spec = SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(budget=budget), glue=glue)
    assert spec.fanout.anytime and spec.ngram_candidates
    ngram_hits = 0
    with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
        for prompt in PROMPTS:
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == references[tuple(prompt)]
            ngram_hits += out.stats.spec.ngram_hits
    assert ngram_hits > 0
    if k > 1:  # K = 1: one branch step, nothing to cut
        assert any(cuts)


@pytest.mark.parametrize("backup", ["neural", "lookup", "ngram", "random"])
@pytest.mark.parametrize("decoder", ["tree", "batched"])
def test_ssd_greedy_equals_ar_with_every_backup_and_decoder(
    tiny_models, tiny_tokenizer, references, backup, decoder, monkeypatch
):
    target, draft = tiny_models
    starts = count_decoder_starts(monkeypatch)
    spec = ssd_spec(4, 4, backup=backup, branch_decoder=decoder)
    served = set()
    with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
        for prompt in PROMPTS:
            out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == references[tuple(prompt)]
            # Every miss (the first round always is one) was served by the chosen backup
            # (lookup: its n-gram match, or the neural chain without one).
            s = out.stats.spec
            assert s.rounds_after_miss >= 1 and sum(s.backups.values()) == s.rounds_after_miss
            served |= set(s.backups)
    assert served == ({"ngram", "neural"} if backup == "lookup" else {backup})
    assert set(starts) == {decoder}  # every cache was built by the chosen decoder


def test_both_branch_decoders_give_identical_sampled_output(tiny_models, tiny_tokenizer, monkeypatch):
    target, draft = tiny_models
    sampling = SamplingConfig(temperature=1.0, seed=11)
    outs = []
    for decoder in ("tree", "batched"):
        starts = count_decoder_starts(monkeypatch)
        spec = ssd_spec(3, 8, branch_decoder=decoder, glue="reuse")  # "fold" needs the tree decoder
        with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
            out = ssd.generate(GenerationRequest([1, 2], sampling, GenerationConfig(max_new_tokens=30)))
        outs.append(out.token_ids)
        assert set(starts) == {decoder} and out.stats.spec.hits > 0  # two decoders really ran, and mattered
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind, k, budget", [("uniform", 3, 10), ("geometric", 3, 10), ("uniform", 2, 5)])
def test_budget_and_kind_set_the_cached_outcomes(tiny_models, tiny_tokenizer, monkeypatch, kind, k, budget):
    """The budget is the number of outcomes each cache holds; the kind spreads them over k."""
    target, draft = tiny_models
    builds = record_builds(monkeypatch)
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec(k, budget, kind)) as ssd:
        ssd.generate(GenerationRequest([1, 2, 3], SamplingConfig(temperature=1.0, seed=5), GenerationConfig(max_new_tokens=40)))
    assert len(builds) > 5 and all(len(b.entries) == budget for b in builds)
    builds = [b for b in builds if len(b.drafted) == k]  # not those after a bonus branch's hit (glue "fold")
    if kind == "uniform":  # as even as whole numbers allow, the remainder to the lowest k
        for b in builds:
            counts = b.per_k(k)
            assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    else:  # the first schedule, from the priors a = 0.7, r = 1: F_k ~ P(k)^(1/2)
        a, r = 0.7, 1.0
        pmf = [(1 - a) * a**i for i in range(k)] + [a**k]
        weights = [p ** (1 / (1 + r)) for p in pmf]
        first = builds[0].per_k(k)
        assert all(abs(f - budget * w / sum(weights)) < 1 for f, w in zip(first, weights))
        assert first[k] > first[k - 1]  # not the uniform spread, whose remainder goes to the lowest k


@pytest.mark.parametrize("c", [0.5, 0.0, 1.0])
def test_saguaro_c_rescales_the_cached_q_rows(tiny_models, tiny_tokenizer, monkeypatch, c):
    """Each cached speculation carries q': the draft's q with its top-F_j tokens
    scaled by C, recomputed here from fresh draft forwards (C = 1: plain q)."""
    target, draft = tiny_models
    k, budget, fanout = 3, 10, [3, 3, 2, 2]  # uniform: 10 over 4 lengths, the remainder to the lowest
    builds = record_builds(monkeypatch)
    spec = ssd_spec(k, budget, "uniform", saguaro_c=c)
    with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
        ssd.generate(GenerationRequest([1, 2, 3], SamplingConfig(temperature=1.0, seed=7), GenerationConfig(max_new_tokens=12)))
    assert builds
    for build in builds[:3]:  # the rows are bfloat16, the draws' own law (ssd.sampling.as_drawn)
        assert max(saguaro_errors(draft, build, c, fanout)) < QPRIME_TOL
    if c != 1.0:  # the check has power: plain q is far from q'
        assert min(saguaro_errors(draft, builds[0], 1.0, fanout)) > 1e-3


@pytest.mark.parametrize("glue, tokens", [("reuse", 4.5), ("fold", 3.5)])
def test_perfect_draft_hits_the_cache_almost_always(tiny_models, tiny_tokenizer, references, glue, tokens):
    """Every round accepts all K drafts and hits a bonus branch: K + 1 tokens a
    round, or K with the folded glue, whose bonus branches draft K - 1 (the
    last round is cut short)."""
    target, _ = tiny_models
    with SSDEngine.in_process(target, target, tiny_tokenizer, ssd_spec(4, 8, glue=glue)) as ssd:
        out = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40)))
    assert out.token_ids == references[(1, 2, 3)]
    s = out.stats.spec
    assert s.hit_rate == 1.0
    assert tokens < s.tokens_per_round_after_hit <= tokens + 1


def test_full_fanout_never_misses(tiny_models, tiny_tokenizer):
    """With a budget covering every token at every k, every outcome is cached."""
    target, draft = tiny_models
    spec = ssd_spec(2, 3 * TINY.vocab_size, kind="uniform")
    with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
        out = ssd.generate(GenerationRequest([1, 2, 3], SamplingConfig(temperature=1.0, seed=2), GenerationConfig(max_new_tokens=30)))
    assert out.stats.spec.hit_rate == 1.0 and out.stats.spec.rounds_after_miss == 1


def test_a_run_the_k_policy_kept_off_the_draft_is_named_ar(tiny_models, tiny_tokenizer, references):
    """K 0 at every batch size (as the start-up plan sets where AR is faster): SSD asked, AR ran,
    and the line says so, with none of SSD's figures (no acceptance or hit rate of 0/0)."""
    target, draft = tiny_models
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec(k_policy={1: 0})) as ssd:
        out = ssd.generate(GenerationRequest(PROMPTS[0], GREEDY, GenerationConfig(max_new_tokens=20)))
    assert out.token_ids == references[tuple(PROMPTS[0])][:20]
    s = out.stats
    assert (s.mode, s.ran, s.drafted) == ("ssd", "ar", 0) and s.rounds > 0
    line = s.summary()
    assert line.startswith("ar (ssd asked, nothing drafted) [") and "acceptance" not in line and "hit rate" not in line
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec()) as ssd:
        spoken = ssd.generate(GenerationRequest(PROMPTS[0], GREEDY, GenerationConfig(max_new_tokens=20))).stats
    assert spoken.ran == "ssd" and spoken.summary().startswith("ssd [") and "hit rate" in spoken.summary()


def test_metrics_by_k_and_timings(tiny_models, tiny_tokenizer):
    target, draft = tiny_models
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec(4, 8)) as ssd:
        s = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=60))).stats
    spec = s.spec
    assert spec.lookups == s.rounds - 1  # the first round has no cache to look in
    assert sum(spec.lookups_by_k.values()) == spec.lookups and sum(spec.hits_by_k.values()) == spec.hits
    assert 0 < spec.hit_rate < 1
    assert spec.rounds_after_hit + spec.rounds_after_miss == s.rounds
    assert spec.verify_s > 0 and spec.build_s > 0 and spec.backup_s > 0 and spec.wait_s > 0
    assert "hit rate" in s.summary()


# Far above a tiny-model forward (~1 ms) and a light cache build (~10 ms; 40 ms
# measured with both cores busy elsewhere), so each timer's share is
# unmistakable under load.
VERIFY_DELAY_S, DRAFT_DELAY_S = 0.1, 0.05


def test_timings_land_where_the_time_is_spent(tiny_models, tiny_tokenizer, monkeypatch):
    """A slowed verification shows in verify_s (and not wait_s); a slowed draft
    (cache build and backup) shows in build_s, backup_s and the target's wait_s
    (and not verify_s). Lower bounds come from sleeping; in each cross check a
    sleep faces a few tiny-model forwards (a margin of ~10x unloaded, ~3x with
    both cores busy elsewhere)."""
    target, draft = tiny_models
    gen = GenerationConfig(max_new_tokens=16)

    def slow_verify(*args, **kwargs):
        time.sleep(VERIFY_DELAY_S)
        return verify(*args, **kwargs)

    # A light draft (2 branches, n-gram backup): its work hides inside the verification.
    light = ssd_spec(4, 2, backup="ngram")
    with SSDEngine.in_process(target, draft, tiny_tokenizer, light, verifier=slow_verify) as ssd:
        s = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, gen)).stats
    spec = s.spec
    assert spec.verify_s >= s.rounds * VERIFY_DELAY_S
    assert spec.verify_hit_s >= spec.rounds_after_hit * VERIFY_DELAY_S
    assert spec.rounds_after_hit > 0 and s.target_s >= spec.verify_s
    assert spec.wait_s < spec.verify_s / 2  # the draft built its cache while the target verified

    real_build, real_backup = speculator_module.build_caches, speculator_module.make_backup

    def slow_build(*args, **kwargs):
        time.sleep(DRAFT_DELAY_S)
        return real_build(*args, **kwargs)

    class SlowBackup:
        def __init__(self, inner):
            self.inner, self.kind = inner, inner.kind

        def propose(self, *args, **kwargs):
            time.sleep(DRAFT_DELAY_S)
            return self.inner.propose(*args, **kwargs)

    monkeypatch.setattr(speculator_module, "build_caches", slow_build)
    monkeypatch.setattr(speculator_module, "make_backup", lambda *a, **kw: SlowBackup(real_backup(*a, **kw)))
    with SSDEngine.in_process(target, draft, tiny_tokenizer, ssd_spec(4, 8)) as ssd:
        s = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=30))).stats
    spec = s.spec
    assert spec.rounds_after_miss > 0
    assert spec.backup_s >= spec.rounds_after_miss * DRAFT_DELAY_S
    # Each reply but the first reports the build before it; each waits for that build.
    assert spec.build_s >= (s.rounds - 1) * DRAFT_DELAY_S
    assert spec.wait_s + spec.verify_s >= 0.8 * (s.rounds - 1 + spec.rounds_after_miss) * DRAFT_DELAY_S
    assert spec.verify_s < spec.wait_s / 2


def test_end_conditions_inside_a_cached_round(tiny_models, tiny_tokenizer, references):
    target, _ = tiny_models
    reference = references[(1, 2, 3)]
    with SSDEngine.in_process(target, target, tiny_tokenizer, ssd_spec(4, 8)) as ssd:
        for n in (1, 2, 7, 13):
            out = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=n)))
            assert out.token_ids == reference[:n] and out.finish_reason == "length"
        text = tiny_tokenizer.decode(reference)
        out = ssd.generate(GenerationRequest([1, 2, 3], GREEDY, GenerationConfig(max_new_tokens=40, stop=[text[8:10]])))
        assert out.finish_reason == "stop" and out.text == text[: text.find(text[8:10])]


def test_failing_draft_does_not_lose_the_request(tiny_models, tiny_tokenizer, references):
    """The draft raises on its first round (its vocabulary is too small for the
    prompt); the target finishes alone with exactly the AR output."""
    target, _ = tiny_models
    broken = build_tiny_model(dataclasses.replace(TINY, vocab_size=8), torch.float64)
    prompt = PROMPTS[2]  # holds ids >= 8
    with SSDEngine.in_process(target, broken, tiny_tokenizer, ssd_spec(2, 2)) as ssd:
        out = ssd.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40)))
        assert out.token_ids == references[tuple(prompt)]
        assert out.stats.spec.degraded_rounds == out.stats.rounds
        assert not ssd.link_up


def test_guessed_outcomes_exclude_the_drafted_token_only_where_a_rejection_happened():
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [2.0, 1.0, 3.0]])
    drafted = [0, 1]  # K = 2: positions 0 and 1 exclude their drafted token, the bonus none
    guesses = guessed_outcomes(logits, drafted, [5, 1, 5])
    assert guesses == [(0, 1), (0, 2), (1, 2), (2, 2), (2, 0), (2, 1)]


def test_a_link_attached_mid_request_is_adopted_at_the_next_round(tiny_models, tiny_tokenizer, references):
    """The target runs alone (no link), a speculator arrives after round 5 (as a
    healed draft does); from the next round on the request speculates again,
    with the speculator prefilled from the sequence so far: output unchanged."""
    import threading

    from ssd.saguaro.speculator import Speculator
    from ssd.transport import inprocess_pair

    target, draft = tiny_models
    engine = SSDEngine(target, tiny_tokenizer, ssd_spec())
    target_end, draft_end = inprocess_pair()
    serving = threading.Thread(target=Speculator(draft, draft_end).serve, daemon=True)
    rounds = []

    def attach_after_five_rounds(tokens):
        rounds.append(tokens)
        if len(rounds) == 5:
            serving.start()
            engine.attach(target_end)

    prompt = PROMPTS[0]
    out = engine.generate(GenerationRequest(prompt, GREEDY, GenerationConfig(max_new_tokens=40),
                                            on_tokens=attach_after_five_rounds))
    assert out.token_ids == references[tuple(prompt)]
    assert out.stats.spec.degraded_rounds == 4 and out.stats.spec.hits > 0, out.stats.summary()
    engine.stop_draft()
    serving.join(timeout=10)
    assert not serving.is_alive()  # stop_draft told the speculator to stop


def per_row_guesses(logits, drafted, fanout):
    """One top-k per acceptance length, the drafted token masked out (the plain reading of the rule)."""
    out = []
    for k, f in enumerate(fanout):
        if f <= 0:
            continue
        row = logits[k].clone()
        if k < len(drafted):
            row[drafted[k]] = float("-inf")
        out += [(k, int(t)) for t in torch.topk(row, min(f, row.shape[-1] - (k < len(drafted)))).indices]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_guessed_outcomes_take_one_topk_for_all_rows_with_the_same_result(seed):
    g = torch.Generator().manual_seed(seed)
    k, vocab = int(torch.randint(0, 5, (), generator=g)), 12
    logits = torch.randn(k + 1, vocab, generator=g)
    drafted = torch.randint(vocab, (k,), generator=g).tolist()
    fanout = torch.randint(0, vocab + 2, (k + 1,), generator=g).tolist()
    assert guessed_outcomes(logits, drafted, fanout) == per_row_guesses(logits, drafted, fanout)


# Seconds the speculator's end holds each of the five pongs back: the median (0.05) stands
# apart from the mean (0.206), the fastest and the slowest, so a round trip that is a
# constant or another statistic, or that skips the pongs, misses the window below.
PONG_DELAYS = (0.35, 0.01, 0.05, 0.6, 0.02)


class DelayedPongs:
    """A Channel end that sleeps PONG_DELAYS[i] before sending its i-th pong and counts them."""

    def __init__(self, inner) -> None:
        self.inner, self.pongs = inner, 0

    def send(self, message) -> None:
        from ssd.saguaro import protocol

        if message.op == protocol.PONG:
            time.sleep(PONG_DELAYS[self.pongs])
            self.pongs += 1
        self.inner.send(message)

    def __getattr__(self, name):  # recv, pending, close: the wrapped end's
        return getattr(self.inner, name)


def test_the_link_s_round_trip_is_timed_by_ping_pong_and_the_link_still_serves(tiny_models, tiny_tokenizer, references):
    """The cluster times its link at every (re)link before SSD uses it (the plan adds it to
    every round): the median of `times` ping-pongs, each timed, and a request after them
    runs as usual, to its last token."""
    import threading

    from ssd.saguaro import protocol
    from ssd.saguaro.speculator import Speculator
    from ssd.transport import inprocess_pair

    target, draft = tiny_models
    target_end, draft_end = inprocess_pair()
    draft_end = DelayedPongs(draft_end)
    threading.Thread(target=Speculator(draft, draft_end).serve, daemon=True).start()
    seconds = protocol.round_trip_s(target_end, times=5)
    assert draft_end.pongs == 5
    assert sorted(PONG_DELAYS)[2] <= seconds < 0.15  # the median's delay, plus less than 0.1 s of overhead
    with SSDEngine(target, tiny_tokenizer, ssd_spec(), channel=target_end) as ssd:
        out = ssd.generate(GenerationRequest(PROMPTS[0], GREEDY, GenerationConfig(max_new_tokens=20)))
    assert out.token_ids == references[tuple(PROMPTS[0])][:20] and out.stats.spec.hits > 0
