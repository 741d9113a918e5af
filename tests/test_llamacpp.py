"""The llama.cpp backend (issue 31): GGUF export, logits, invariance, rollback, greedy AR.

The engines on the llama.cpp backend (ssd.models.backend): the real AREngine
and SDEngine give torch's tokens (greedy AR, greedy SD = AR for several K,
batched rows = each alone, sampled SD = torch's sampled SD with one seed).

A tiny random Qwen2 in fp32 is written to GGUF (ssd.models.gguf_export) and
run through llama.cpp's CPU kernels (ssd.models.llamacpp). Its q/k/v biases
and norm weights are re-drawn at random first: the tiny models have zero
biases and unit norms, which would hide a wrong tensor mapping.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from ssd.config import (  # noqa: E402
    BatchingConfig, FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TinyModelConfig,
)
from ssd.engine import AREngine, SDEngine  # noqa: E402
from ssd.engine.request import GenerationRequest  # noqa: E402
from ssd.models import TinyTokenizer, build_tiny_model  # noqa: E402
from ssd.models import backend  # noqa: E402
from ssd.models.gguf_export import export_gguf  # noqa: E402
from ssd.models.llamacpp import (  # noqa: E402
    LlamaCppBranches, LlamaCppContext, LlamaCppError, LlamaCppModel, LlamaCppSequence, forward_rows, repack_probe,
)
from ssd.saguaro.branches import make_branch_decoder  # noqa: E402
from ssd.saguaro.target import SSDEngine  # noqa: E402
import ssd.models.llamacpp as llamacpp_module  # noqa: E402
from tests.batches import run_together  # noqa: E402
from tests.conftest import torch_threads  # noqa: E402

PLAIN_PREFILL_MIN = llamacpp_module.PLAIN_PREFILL_MIN  # the shipped value, before the fixture below

@pytest.fixture(autouse=True)
def short_prompts_on_the_plain_twin(monkeypatch):  # noqa: D401
    """These models' prompts are short: every prompt chunk past n_ubatch runs on the plain twin
    where there is one, as long chunks of a real prompt do (llamacpp.PLAIN_PREFILL_MIN)."""
    monkeypatch.setattr(llamacpp_module, "PLAIN_PREFILL_MIN", 1)


CFG = TinyModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, seed=3)
PROMPT = [5, 17, 3, 42, 9, 60, 1, 33]
# fp32 against fp32 with another summation order: measured max |diff| / max |logit|
# is ~2e-6 on these models (a few fp32 ulps through two layers); 2e-5 leaves
# 10x headroom and is still ~100x tighter than what an F16 export or llama.cpp's
# flash attention (F16 K/V) gives, which test_tolerance_is_tight shows.
REL_TOL = 2e-5


@torch.no_grad()
def _model(cfg: TinyModelConfig = CFG) -> torch.nn.Module:
    model = build_tiny_model(cfg, torch.float32)
    gen = torch.Generator().manual_seed(11)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        elif "norm" in name:
            param.copy_(1 + torch.randn(param.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = _model()
    path = export_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, LlamaCppModel(path)


@torch.no_grad()
def _torch_logits(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_match_torch(pair):
    model, lm = pair
    seq = LlamaCppSequence(lm)
    got = seq.forward(PROMPT)
    want = _torch_logits(model, PROMPT)
    assert got.dtype == torch.float32 and got.shape == (len(PROMPT), CFG.vocab_size)
    assert _rel(got, want) < REL_TOL
    assert seq.forward([7], last_only=True).shape == (1, CFG.vocab_size)


def test_tolerance_is_tight(pair, tmp_path):
    """The tolerance catches F16 weights and flash attention's F16 keys and values."""
    model, lm = pair
    want = _torch_logits(model, PROMPT)
    flash = LlamaCppSequence(lm, flash_attn=True).forward(PROMPT)
    assert _rel(flash, want) > 10 * REL_TOL
    f16 = LlamaCppModel(export_gguf(model, tmp_path / "f16.gguf", ftype="f16"))
    assert _rel(LlamaCppSequence(f16).forward(PROMPT), want) > 10 * REL_TOL


@pytest.mark.parametrize("flash_attn", [False, True])
def test_invariance(pair, flash_attn):
    """A token's logits alone, in a K+1-token verification, and beside another sequence: bit-identical."""
    _, lm = pair
    seq = LlamaCppSequence(lm, flash_attn=flash_attn)
    full = seq.forward(PROMPT)
    seq.rollback(0)
    alone = torch.cat([seq.forward([t]) for t in PROMPT])
    seq.rollback(3)
    verify = seq.forward(PROMPT[3:])  # 5 tokens after a 3-token prefix
    seq.rollback(3)
    verify_last = seq.forward(PROMPT[3:], last_only=True)

    ctx = LlamaCppContext(lm, n_seq=2, flash_attn=flash_attn)
    a, b = LlamaCppSequence(ctx), LlamaCppSequence(ctx)
    a.forward(PROMPT[:3])
    b.forward([2, 2, 2, 2, 2])
    batched, _ = forward_rows([a, b], [PROMPT[3:], [8]])
    single, _ = forward_rows([a, b], [[1], [9, 9, 9]])
    a.rollback(len(PROMPT))
    assert torch.equal(alone, full)
    assert torch.equal(verify, full[3:])
    assert torch.equal(verify_last, full[-1:])
    assert torch.equal(batched, full[3:])
    assert torch.equal(single, LlamaCppSequence(lm, flash_attn=flash_attn).forward(PROMPT + [1])[-1:])


def test_invariance_test_sees_differences(pair):
    """Without the single-row padding, one-token forwards differ from wider ones:
    the bit-equality above is a real check, not a comparison of a value with itself."""
    _, lm = pair
    seq = LlamaCppSequence(lm, pad_single=False)
    full = seq.forward(PROMPT)
    seq.rollback(0)
    alone = torch.cat([seq.forward([t]) for t in PROMPT])
    diff = (alone - full).abs().max().item()
    assert 0 < diff < REL_TOL * full.abs().max().item()


def test_rollback(pair):
    _, lm = pair
    seq = LlamaCppSequence(lm)
    seq.forward([4, 8, 15, 16, 23])
    seq.rollback(3)
    assert seq.length == 3 and seq.tokens == [4, 8, 15]
    got = seq.forward([42, 7])
    fresh = LlamaCppSequence(lm).forward([4, 8, 15, 42, 7])
    assert torch.equal(got, fresh[3:])
    with pytest.raises(ValueError):
        seq.rollback(6)


def test_rollback_test_sees_stale_entries(pair, monkeypatch):
    """If rollback left the old entries in llama.cpp's cache, the test above would fail."""
    _, lm = pair
    seq = LlamaCppSequence(lm)
    seq.forward([4, 8, 15, 16, 23])
    monkeypatch.setattr(seq.context, "remove", lambda s, start: None)
    seq.rollback(3)
    fresh = LlamaCppSequence(lm).forward([4, 8, 15, 42, 7])
    try:
        got = seq.forward([42, 7])
    except LlamaCppError:
        return  # llama.cpp refuses positions it already holds: caught either way
    assert not torch.equal(got, fresh[3:])


def test_greedy_ar_matches_torch(pair):
    model, lm = pair
    seq = LlamaCppSequence(lm)
    ours, theirs = list(PROMPT), list(PROMPT)
    logits = seq.forward(PROMPT, last_only=True)[-1]
    for _ in range(20):
        token = int(logits.argmax())
        ours.append(token)
        logits = seq.forward([token])[-1]
    gaps = []
    for _ in range(20):
        last = _torch_logits(model, theirs)[-1]
        top = last.topk(2).values
        gaps.append((top[0] - top[1]).item())
        theirs.append(int(last.argmax()))
    assert ours == theirs, f"top-2 gaps along torch's path: {gaps}"
    assert len(set(ours[len(PROMPT):])) > 1  # not a degenerate constant stream


def test_context_slots(pair):
    _, lm = pair
    ctx = LlamaCppContext(lm, n_seq=2)
    a, b = LlamaCppSequence(ctx), LlamaCppSequence(ctx)
    with pytest.raises(LlamaCppError):
        LlamaCppSequence(ctx)
    a.forward([1, 2, 3])
    a.close()
    c = LlamaCppSequence(ctx)  # a's slot, emptied
    assert torch.equal(c.forward([1, 2, 3]), LlamaCppSequence(lm).forward([1, 2, 3]))
    assert b.length == 0


# --- the engines on llama.cpp (ssd.models.backend) ---------------------------------

PROMPTS = [PROMPT, [2, 40, 40, 7, 61, 13], [30, 31, 9, 9, 50, 22, 11, 0, 4, 18, 27]]
N = 24
GREEDY = SamplingConfig(temperature=0.0)
TOKENIZER = TinyTokenizer(CFG.vocab_size)


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """A noisy copy of the target (TinyModelConfig.noise): it agrees often, not always."""
    model = _model(dataclasses.replace(CFG, noise=0.03))
    path = export_gguf(model, tmp_path_factory.mktemp("gguf") / "draft.gguf")
    return model, LlamaCppModel(path)


def _request(prompt, sampling=GREEDY, k=None):
    speculation = SpeculationConfig(mode="sd", k=k) if k is not None else None
    return GenerationRequest(list(prompt), sampling, GenerationConfig(max_new_tokens=N), speculation)


def _run_batch(engine, requests, what=lambda result: result.token_ids):
    """Admit every request, step until all left; token ids (or `what` of the result) per request."""
    return run_together(engine, requests, what)


def test_backend_dispatch(pair):
    model, lm = pair
    assert not backend.is_llamacpp(model) and backend.is_llamacpp(lm)
    assert backend.vocab_size(model) == backend.vocab_size(lm) == CFG.vocab_size
    assert backend.kv_bytes_per_token(lm) == backend.kv_bytes_per_token(model)  # both fp32
    assert backend.precision_of(model) == "fp32" and backend.precision_of(lm) == "gguf f32"
    assert isinstance(backend.new_sequence(lm), LlamaCppSequence)
    assert backend.sequence_source(model, 4, 64, 100) is model


def test_greedy_ar_engine_matches_torch(pair):
    model, lm = pair
    for prompt in PROMPTS:
        want = AREngine(model, TOKENIZER).generate(_request(prompt))
        got = AREngine(lm, TOKENIZER).generate(_request(prompt))
        assert got.token_ids == want.token_ids and len(got.token_ids) == N
        assert got.stats.precision == "target gguf f32"


@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_sd_engine_equals_ar(pair, draft_pair, k):
    _, lm = pair
    _, draft = draft_pair
    drafted = accepted = 0
    for prompt in PROMPTS:
        ar = AREngine(lm, TOKENIZER).generate(_request(prompt))
        sd = SDEngine(lm, draft, TOKENIZER).generate(_request(prompt, k=k))
        assert sd.token_ids == ar.token_ids
        drafted, accepted = drafted + sd.stats.drafted, accepted + sd.stats.accepted
    assert 0 < accepted < drafted  # the draft is right sometimes and wrong sometimes: verification is exercised


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_batched_rows_equal_each_alone(pair, draft_pair, mode):
    _, lm = pair
    _, draft = draft_pair

    def engine():
        return AREngine(lm, TOKENIZER) if mode == "ar" else SDEngine(lm, draft, TOKENIZER)

    k = 3 if mode == "sd" else None
    eng = engine()
    batched = _run_batch(eng, [_request(p, k=k) for p in PROMPTS])
    alone = [engine().generate(_request(p, k=k)).token_ids for p in PROMPTS]
    assert batched == alone
    # The rows shared one llama.cpp context (one llama_decode per step), and left it empty.
    assert isinstance(eng.kv.target_source, LlamaCppContext)
    assert len(eng.kv.target_source._free) == eng.kv.target_source.n_seq
    # Slots are handed back: more requests than slots run one after another on one engine.
    assert _run_batch(eng, [_request(PROMPTS[0], k=k)]) == alone[:1]


def test_sampled_sd_matches_torch(pair, draft_pair):
    """One seed, equal logits to ~1e-6: llama.cpp's sampled SD draws torch's tokens.

    Inverse-CDF sampling and the accept test are continuous in the logits, so
    the outputs agree unless a uniform draw lands within ~1e-6 of a boundary
    (chance ~1e-4 over these draws); the seeds here are fixed.
    """
    model, lm = pair
    dmodel, draft = draft_pair
    sampling = SamplingConfig(temperature=1.0, seed=5)
    for prompt in PROMPTS:
        want = SDEngine(model, dmodel, TOKENIZER).generate(_request(prompt, sampling, k=3))
        got = SDEngine(lm, draft, TOKENIZER).generate(_request(prompt, sampling, k=3))
        assert got.token_ids == want.token_ids
        assert got.stats.accepted == want.stats.accepted and got.stats.drafted == want.stats.drafted


@pytest.mark.parametrize("shared", [True, False])
def test_branches_decoded_at_once_equal_each_alone(pair, shared):
    """LlamaCppBranches: every branch (a slot holding the root's prefix) decoded
    in one llama_decode per step gives the logits of that branch decoded alone,
    token by token, after the same prefix; the root sequence is left as it was
    and the slots are handed back.

    Separate KV streams (a copy of the prefix per branch): bit for bit. One
    shared pool (backend.new_sequence's, the prefix's cells shared): within
    fp32 summation order, as the branches' attention spans cells in another
    layout; only the target's logits need bit-invariance, never the draft's
    (the target verifies against the q rows the draft actually sampled from)."""
    _, lm = pair
    context = PROMPT + [7, 8, 9, 10]
    kv = backend.new_sequence(lm, branches=6) if shared else LlamaCppSequence(lm, branches=6, shared_room=0)
    assert kv.context.shared == shared
    kv.forward(context)
    decoder = make_branch_decoder("tree", sequence=kv)
    assert isinstance(decoder, LlamaCppBranches)
    prefixes, firsts, steps = [8, 9, 9, 10, 12, 11], [3, 4, 5, 6, 7, 8], 4
    rows = [decoder.start(kv, prefixes, firsts)]
    fed = [firsts]
    for _ in range(steps - 1):
        fed.append(rows[-1].argmax(-1).tolist())
        rows.append(decoder.step(torch.tensor(fed[-1])))
    decoder.finish()
    assert kv.tokens == context and len(kv.context._free) == 6  # root untouched, slots back
    # The root's cache is intact. (Not to the bit: a one-token forward in a
    # context of 8 slots differs from one in a 2-slot context by ~1e-5,
    # branches or no branches; measured, cause not pinned down.)
    assert _rel(kv.forward([1]), LlamaCppSequence(lm).forward(context + [1])[-1:]) < REL_TOL
    together = torch.stack(rows, 1)  # [B, steps, V]
    for b, p in enumerate(prefixes):
        alone = LlamaCppSequence(lm)
        alone.forward(context[:p])
        want = torch.cat([alone.forward([fed[s][b]]) for s in range(steps)])
        if shared:
            assert _rel(together[b], want) < REL_TOL, b
        else:
            assert torch.equal(together[b], want), (b, (together[b] - want).abs().max().item())
    with pytest.raises(LlamaCppError, match="free sequence slots"):
        decoder.start(kv, [1] * 7, [0] * 7)
    assert len(kv.context._free) == 6 and not decoder.active


def _ssd(k, budget):
    return SpeculationConfig(mode="ssd", k=k, fanout=FanoutConfig(budget=budget))


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_ssd_engine_equals_ar(pair, draft_pair, k):
    """Greedy SSD with target and draft on llama.cpp (the draft building its
    cache with LlamaCppBranches) gives torch's greedy AR tokens; the cache hits."""
    model, lm = pair
    _, draft = draft_pair
    hits = rounds = 0
    for prompt in PROMPTS:
        want = AREngine(model, TOKENIZER).generate(_request(prompt))
        engine = SSDEngine.in_process(lm, draft, TOKENIZER, _ssd(k, budget=8))
        try:
            got = engine.generate(dataclasses.replace(_request(prompt), speculation=_ssd(k, budget=8)))
        finally:
            engine.close()
        assert got.token_ids == want.token_ids
        hits, rounds = hits + got.stats.spec.hits, rounds + got.stats.spec.lookups
    print(f"k={k}: {hits} hits in {rounds} lookups")
    assert 0 < hits < rounds, (hits, rounds)


def test_greedy_ssd_with_k_moving_equals_ar(pair, draft_pair, monkeypatch):
    """Adaptive K on llama.cpp: K cycling 1..4 round by round (test_adaptive_k's
    stub controller), the draft building each K's cache with LlamaCppBranches."""
    import ssd.saguaro.target as target_module
    from tests.test_adaptive_k import CYCLE, Cycling

    monkeypatch.setattr(target_module, "KController", Cycling)
    _, lm = pair
    _, draft = draft_pair
    spec = dataclasses.replace(_ssd(2, budget=6), adaptive_k=True, max_k=max(CYCLE), ngram_candidates=False,
                               fanout=FanoutConfig(budget=6, anytime=False))
    engine = SSDEngine.in_process(lm, draft, TOKENIZER, spec)
    try:
        for prompt in PROMPTS:
            got = engine.generate(dataclasses.replace(_request(prompt), speculation=spec))
            assert got.token_ids == AREngine(lm, TOKENIZER).generate(_request(prompt)).token_ids
        assert set(engine.k_control.observed) >= set(CYCLE)
    finally:
        engine.close()


def test_batched_ssd_rows_equal_ar(pair, draft_pair):
    """Three greedy SSD rows at once on llama.cpp (each draft row its own context) give AR's tokens."""
    _, lm = pair
    _, draft = draft_pair
    engine = SSDEngine.in_process(lm, draft, TOKENIZER, _ssd(3, budget=6))
    try:
        got = _run_batch(engine, [dataclasses.replace(_request(p), speculation=_ssd(3, budget=6)) for p in PROMPTS])
    finally:
        engine.close()
    assert got == [AREngine(lm, TOKENIZER).generate(_request(p)).token_ids for p in PROMPTS]


# --- which options keep a model batch-invariant -----------------------------------------------

def _quantized(path, out, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q8_0", repacked: bool | None = None):
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, ftype_name)
    assert L.llama_model_quantize(str(path).encode(), str(out).encode(), params) == 0
    return LlamaCppModel(out, use_extra_bufts=repacked)


def test_f32_weights_keep_the_options_exact_against_torch(pair):
    _, lm = pair
    assert lm.invariant_options() == {"flash_attn": False, "pad_single": True}


def test_the_invariance_probe_sees_a_single_row_forward_part(pair):
    """On F32 weights a one-row forward takes another matmul path: unpadded, the probe says
    not even one token is invariant; padded, two equal rows are, and the probe stops where
    two rows of unequal length split into ubatches of one token (measured), at the start of a
    sequence. Past 256 positions only one token is (measured; these options are fixed, not
    probed, for F32/F16 weights: docs/llamacpp.md)."""
    from ssd.models.llamacpp import invariant_tokens

    _, lm = pair
    assert invariant_tokens(lm, flash_attn=False, pad_single=False, lead=0) == 0
    assert invariant_tokens(lm, flash_attn=False, pad_single=True, lead=0) == 2
    assert invariant_tokens(lm, flash_attn=False, pad_single=True) == 1


def test_quantized_weights_get_probed_options_that_keep_sd_equal_to_ar(pair, tmp_path):
    """A Q8_0 copy of the tiny model: the options the probe picks are invariant, and greedy SD == AR."""
    from ssd.models.llamacpp import INVARIANCE_CANDIDATES, invariant_tokens

    _, lm = pair
    target = _quantized(lm.path, tmp_path / "q8.gguf")
    options = target.invariant_options()
    chosen = {key: options[key] for key in ("flash_attn", "pad_single", "kv")}
    assert chosen in INVARIANCE_CANDIDATES and options["n_ubatch"] >= 2
    assert invariant_tokens(target, **chosen) == options["n_ubatch"]
    draft = _quantized(export_gguf(_model(dataclasses.replace(CFG, noise=0.03)), tmp_path / "d.gguf"),
                       tmp_path / "dq8.gguf")
    tok = TinyTokenizer(CFG.vocab_size)
    request = GenerationRequest(PROMPT, SamplingConfig(), GenerationConfig(max_new_tokens=24))
    ar = AREngine(target, tok).generate(request).token_ids
    sd = SDEngine(target, draft, tok, SpeculationConfig(mode="sd", k=3)).generate(request)
    assert sd.token_ids == ar and 0 < sd.stats.accepted < sd.stats.drafted


def test_the_invariance_probe_logs_each_candidate_and_runs_apart_on_too_few_cores(pair, tmp_path, monkeypatch,
                                                                                  caplog):
    """Each candidate tried logs a line as it ends (seconds a candidate on the real pair). A
    caller with fewer cores than the probe's threads (a cluster actor pinned to its core, where
    llama.cpp's OpenMP threads spin a time slice a barrier) probes in a child process started
    on its cores, whose answer is the one found here; one with enough cores probes here."""
    import logging

    import ssd.models.llamacpp as lc

    _, lm = pair
    model = _quantized(lm.path, tmp_path / "q8.gguf", repacked=False)
    with caplog.at_level(logging.INFO, logger=lc.__name__):
        here = lc._first_invariant(model)
    lines = [r.getMessage() for r in caplog.records if "invariance candidate" in r.getMessage()]
    tried = [line for line in lines if "invariant up to" in line]  # the others: heartbeats of a slow candidate
    chosen = lc.INVARIANCE_CANDIDATES.index({key: here[key] for key in ("flash_attn", "pad_single", "kv")})
    assert [line.split(" {")[0].split(": ")[-1] for line in tried] == [
        f"invariance candidate {i} of {len(lc.INVARIANCE_CANDIDATES)}" for i in range(1, chosen + 2)]
    assert lc._first_invariant_apart(model) == here
    children = []
    monkeypatch.setattr(lc, "_first_invariant_apart", lambda m: children.append(m) or dict(here))
    monkeypatch.setattr(lc.os, "sched_getaffinity", lambda pid: {0})
    assert lc._invariance(model) == here and children == [model]
    monkeypatch.setattr(lc.os, "sched_getaffinity", lambda pid: set(range(lc._probe_threads())))
    assert lc._invariance(model) == here and children == [model]  # probed here


def test_repacked_layouts_are_probed_in_a_child_that_may_die(pair, tmp_path, monkeypatch):
    """Where llama.cpp's repacked kernels kill the process (SIGILL on an AVX512/AMX Xeon), the
    probe's child dies, not us: plain layouts load. Each answer is cached per file and host."""
    import signal
    import subprocess

    import ssd.models.llamacpp as lc

    _, lm = pair
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    quantized = _quantized(lm.path, tmp_path / "q8.gguf", repacked=False).path
    monkeypatch.setattr(lc, "_REPACK_CHILD", f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})")
    assert not lc.repack_probe(quantized)["runs"]
    assert not LlamaCppModel(quantized).repacked  # the cached answer
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed twice"))
    assert not lc.repack_probe(quantized)["runs"]
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.undo()
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    assert not lc.repack_probe(tmp_path / "bad.gguf")["runs"]  # the child cannot load it


def test_models_load_repacked_where_the_layouts_run(pair, tmp_path, monkeypatch):
    """Auto: a quantized file loads repacked where the probe says the layouts run, and reports
    say so; F32 weights have no repacked layout and skip the probe."""
    from ssd.models.backend import precision_of

    _, lm = pair
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    assert not lm.repacked and precision_of(lm) == "gguf f32"
    path = _quantized(lm.path, tmp_path / "q4.gguf", "LLAMA_FTYPE_MOSTLY_Q4_0", repacked=False).path
    runs = repack_probe(path)["runs"]
    model = LlamaCppModel(path)
    assert model.repacked == runs and precision_of(model) == "gguf q4_0" + ("+repack" if runs else "")
    assert not LlamaCppModel(path, use_extra_bufts=False).repacked


def test_the_layout_probe_decodes_ids_any_vocabulary_holds(pair, tmp_path, monkeypatch):
    """The probe's decodes stay below the vocabulary's size: an 8-token model's repacked layouts
    are found to run wherever a 64-token one's are (ids up to 9 made llama_decode fail: exit 4)."""
    _, lm = pair
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    wide = _quantized(lm.path, tmp_path / "v64.gguf", "LLAMA_FTYPE_MOSTLY_Q4_0", repacked=False).path
    if not repack_probe(wide)["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    small = export_gguf(_model(dataclasses.replace(CFG, vocab_size=8)), tmp_path / "v8.gguf")
    assert repack_probe(_quantized(small, tmp_path / "v8q4.gguf", "LLAMA_FTYPE_MOSTLY_Q4_0", repacked=False).path)["runs"]


@pytest.mark.parametrize("plain_s, repacked_s, twin", [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_prompts_run_on_the_plain_layouts_where_the_probe_timed_them_faster(pair, tmp_path, monkeypatch,
                                                                            plain_s, repacked_s, twin):
    """Auto: the plain twin runs prompts only where the probe timed plain layouts faster."""
    import ssd.models.llamacpp as lc

    _, lm = pair
    path = _quantized(lm.path, tmp_path / "q4.gguf", "LLAMA_FTYPE_MOSTLY_Q4_0", repacked=False).path
    if not repack_probe(path)["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    monkeypatch.setattr(lc, "repack_probe", lambda gguf: {"runs": True, "plain_prefill_s": plain_s,
                                                         "repacked_prefill_s": repacked_s})
    model = LlamaCppModel(path)
    assert model.repacked and (model.plain_twin is not None) == twin
    assert LlamaCppModel(path, plain_prefill=False).plain_twin is None  # set: whatever the timing
    assert LlamaCppModel(path, plain_prefill=True).plain_twin is not None
    assert LlamaCppModel(path, use_extra_bufts=True).plain_twin is None  # llama.cpp's own: prompts in place


def test_the_benchs_plain_llamacpp_peer_decodes_as_our_ar(pair, tmp_path):
    """launch/bench.py's llama.cpp peer (llama.cpp's own context defaults and greedy
    sampler) makes the tokens our AR engine makes on this backend, so its speed is
    that of the same job."""
    from ssd.tools.bench.llamacpp import LlamaCppEngine

    _, lm = pair
    with LlamaCppEngine(lm.path, threads=1) as peer:
        got = peer.generate(_request(PROMPT, k=None))
    want = AREngine(lm, TinyTokenizer.from_config(CFG)).generate(_request(PROMPT))
    assert got.token_ids == want.token_ids and len(got.token_ids) == want.stats.new_tokens


def test_the_gguf_tokenizer_tokenizes_as_llama_cpp_python(pair):
    """The bench's tokenizer over the GGUF's own vocabulary (ssd.tools.bench.llamacpp, beside the
    peer) gives llama-cpp-python's ids and text for the same file: no BOS, specials as text."""
    import llama_cpp

    from ssd.tools.bench.llamacpp import GGUFTokenizer

    _, lm = pair
    tok, llm = GGUFTokenizer(lm), llama_cpp.Llama(model_path=str(lm.path), vocab_only=True, verbose=False)
    for text in ("(1 + 2) * 3 = 9?", "#0,1;2<3>4 " * 40, ""):  # the tiny vocabulary: bytes 0 to 63
        ids = tok.encode(text)
        assert ids == llm.tokenize(text.encode(), add_bos=False, special=False) and len(ids) == len(text)
        assert tok.decode(ids) == llm.detokenize(ids).decode(errors="replace") == text
    assert len(tok) == tok.vocab_size == CFG.vocab_size and tok.eos_token_id is None


def test_the_llamacpp_pair_bench_runs_its_parts_on_a_tiny_pair(pair, draft_pair):
    """launch/bench_llamacpp.py's parts (ssd.tools.bench.llamacpp_pair) on the tiny pair: every
    invariance variant reports, SD and SSD equal AR, and the speed table names every system."""
    import argparse

    from ssd.tools.bench import llamacpp_pair as bench

    models = {"target": pair[1], "draft": draft_pair[1]}
    tok = bench.GGUFTokenizer(models["target"])
    args = argparse.Namespace(tokens=8, n_ctx=64, sd_k=2, ssd_k=2, budget=2, threads=1, other_layout=False)
    lines: list[str] = []
    bench.report_invariance(models, PROMPTS, args, lines.append)
    bench.report_exactness(models, tok, PROMPTS, args, lines.append)
    bench.report_speed(models["target"].path, models, tok, PROMPTS, args, lines.append)
    assert sum(" verify " in line for line in lines) == 2 * len(bench.INVARIANCE_VARIANTS)
    assert sum(" == ar (8 tokens" in line for line in lines) == 2 * len(PROMPTS) and not any("PARTS" in x for x in lines)
    assert [line.split(":")[0].strip() for line in lines if line.startswith("  ") and "x plain" in line] == bench.SYSTEMS


def test_a_tiny_model_on_llamacpp_loads_from_its_config(tmp_path, monkeypatch):
    """model.backend llamacpp with the tiny model: written to GGUF once in the cache
    (the driver's prefetch), loaded as a LlamaCppModel whose logits are the torch model's."""
    from ssd.config import ModelConfig
    from ssd.models import load_model
    from ssd.models.loading import prefetch_model

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    cfg = ModelConfig(name="tiny", backend="llamacpp", tiny=dataclasses.replace(CFG, seed=5))
    assert prefetch_model(cfg) > 0 and len(list((tmp_path / "gguf").glob("tiny-*.gguf"))) == 1
    lm = load_model(cfg)
    assert isinstance(lm, LlamaCppModel) and lm.precision == "gguf f32" and lm.n_ctx == CFG.max_position_embeddings
    assert lm.generation_config.eos_token_id == []  # the tiny config names none (llama.cpp would assume one)
    want = _torch_logits(build_tiny_model(cfg.tiny, torch.float32), PROMPT)
    assert _rel(LlamaCppSequence(lm).forward(PROMPT), want) < REL_TOL
    assert lm.kv_type == "f32" and load_model(dataclasses.replace(cfg, llamacpp_kv="f16")).kv_type == "f16"


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_coupled_rows_equal_coupled_ar(pair, draft_pair, mode):
    """Coupled sampling (sampling.coupling: gumbel) on llama.cpp: rows batched
    in SD or SSD give AR's tokens for their seeds (the sampling is the backends' one pipeline)."""
    _, lm = pair
    _, draft = draft_pair
    samplings = [SamplingConfig(temperature=1.0, seed=s, coupling="gumbel") for s in range(len(PROMPTS))]
    spec = _ssd(3, budget=6) if mode == "ssd" else SpeculationConfig(mode="sd", k=3)
    requests = [dataclasses.replace(_request(p, s), speculation=spec) for p, s in zip(PROMPTS, samplings)]
    engine = SSDEngine.in_process(lm, draft, TOKENIZER, spec) if mode == "ssd" else SDEngine(lm, draft, TOKENIZER)
    try:
        got = _run_batch(engine, requests)
    finally:
        engine.close()
    assert got == [AREngine(lm, TOKENIZER).generate(_request(p, s)).token_ids for p, s in zip(PROMPTS, samplings)]


# --- prompt chunks: whole ubatches, at fixed positions -----------------------------------------
# A K-quant model wide enough for llama.cpp's K-quant kernels (hidden 256) behaves as the real
# q4_k_m pair does: ubatches of more than a few tokens take another matmul kernel, so a prompt's
# keys and values depend on how its chunks fell. Prompt chunks run as whole ubatches (fast), in
# calls of their own, from fixed positions; everything else in the invariant ubatches. Both
# weight layouts: plain (the kernels switch at 8 tokens on the real pair) and llama.cpp's
# repacked one (4 rows at a time from 4 tokens), where this host runs it.
K_QUANT = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512)
LONG = [(5 * i + 3) % CFG.vocab_size for i in range(40)]


@pytest.fixture(scope="module")
def k_quant_files(tmp_path_factory):
    """The K-quant target and draft as q4_k_m GGUF files."""
    path = tmp_path_factory.mktemp("kquant")
    files = []
    for name, cfg in (("t", K_QUANT), ("d", dataclasses.replace(K_QUANT, noise=0.03))):
        files.append(_quantized(export_gguf(_model(cfg), path / f"{name}.gguf"), path / f"{name}q4.gguf",
                                "LLAMA_FTYPE_MOSTLY_Q4_K_M", repacked=False).path)
    return files


@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["plain", "repacked", "repacked-plain-prompts"])
def k_quant_pair(k_quant_files, request):
    """(repacked, plain_prefill): the last runs prompt chunks on the plain layouts and
    moves their keys and values to the repacked context (`_prompt_chunk_apart`)."""
    repacked, plain_prefill = request.param
    if repacked and not repack_probe(k_quant_files[0])["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    return tuple(LlamaCppModel(f, use_extra_bufts=repacked, plain_prefill=plain_prefill) for f in k_quant_files)


def _next_logits(model, feeds, packed_with=None, kv_type=None):
    """Logits after `feeds` (last_only forwards, in turn) and one more token, on a fresh two-slot context;
    `packed_with`: ids another sequence feeds in the first forward."""
    context = LlamaCppContext(model, n_seq=2, kv_type=kv_type)
    row, other = LlamaCppSequence(context), LlamaCppSequence(context)
    for i, ids in enumerate(feeds):
        if i == 0 and packed_with:
            forward_rows([row, other], [ids, packed_with], [True, False])
        else:
            row.forward(ids, last_only=True)
    return row.forward([7, 8])[-1]


def test_a_prompt_chunk_is_one_call_of_its_own_whatever_else_runs(k_quant_pair):
    target, _ = k_quant_pair
    assert target.invariant_options()["n_ubatch"] < 16  # the kernels change within a chunk's length
    whole = _next_logits(target, [LONG])
    assert torch.equal(whole, _next_logits(target, [LONG], packed_with=[1, 2, 3, 4, 5]))
    # The premise: the same tokens in short chunks (the invariant ubatches) give other keys and values,
    # seen in an F16 cache (this tiny model's differences round away in the BF16 one the probe picks).
    # Not where prompts run repacked: there this prompt's keys and values came out the same for
    # every chunk length from 1 to 20 (measured); the next test's premise holds on every layout.
    if not target.repacked or target.plain_twin is not None:
        step = target.invariant_options()["n_ubatch"]
        chunked = _next_logits(target, [LONG[i : i + step] for i in range(0, 40, step)], kv_type="f16")
        assert not torch.equal(_next_logits(target, [LONG], kv_type="f16"), chunked)


def test_a_prompt_moved_from_the_plain_layouts_holds_their_keys_and_values(k_quant_files):
    """Prompt chunks on the plain twin, continued at a later start: the row's cache then holds
    bit for bit what a plain-layout context computes for the same chunks (its state's bytes),
    and the chunk's logits are the plain layouts' too."""
    if not repack_probe(k_quant_files[0])["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    target = LlamaCppModel(k_quant_files[0], use_extra_bufts=True, plain_prefill=True)
    plain = LlamaCppModel(k_quant_files[0], use_extra_bufts=False)
    assert target.plain_twin is not None and plain.plain_twin is None
    states, logits = [], []
    for model in (target, plain):
        context = LlamaCppContext(model, n_seq=3, n_ctx_seq=64, flash_attn=True, pad_single=False, n_ubatch=3)
        rows = [LlamaCppSequence(context) for _ in range(3)]
        rows[0].forward([1, 2])
        logits.append([rows[1].forward(LONG[:16], last_only=True), rows[1].forward(LONG[16:], last_only=True)])
        states.append(context._seq_state(rows[1].seq))
    assert states[0] == states[1] and all(torch.equal(a, b) for a, b in zip(*logits))


def test_restream_moves_a_rows_cells_between_stream_counts():
    from ssd.models.llamacpp import LlamaCppError, restream

    def state(seq, n_stream, stream, cells):
        words = [0xAF1424D8, seq, n_stream] + [0] * stream
        return np.array(words, dtype=np.uint32).tobytes() + cells + bytes(4 * (n_stream - stream - 1))

    cells = np.array([3, 7, 7, 9], dtype=np.uint32).tobytes()  # a cell count, then its cells
    assert restream(state(2, 4, 2, cells), 2, 0, 0, 1) == state(0, 1, 0, cells)
    assert restream(state(0, 1, 0, cells), 0, 5, 5, 8) == state(5, 8, 5, cells)
    empty = bytes(4)  # a cell count of 0
    assert restream(state(1, 3, 1, empty), 1, 0, 0, 1) == state(0, 1, 0, empty)
    with pytest.raises(LlamaCppError, match="laid out"):
        restream(state(2, 4, 2, cells), 1, 0, 0, 1)  # the cells are not in the stream named


def _tokens_and_logprobs(result):
    return result.token_ids, [t.logprob for t in result.logprobs]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_long_prompts_in_a_tight_batch_equal_each_alone(k_quant_pair, mode):
    """Prompts of 40 tokens in chunks of 16 beside other rows, a budget that makes chunks wait:
    every row's tokens and logprobs equal AR's alone, bit for bit. Power: cutting chunks to fit
    the budget (what the engine did before chunks started at fixed positions) fails it, on
    logprobs ~1e-11 apart; chunks as short as the invariant ubatches change them by more than 1e-4."""
    target, draft = k_quant_pair
    tok = TinyTokenizer(CFG.vocab_size)
    batching = BatchingConfig(prefill_chunk=16, max_batched_tokens=21)
    prompts = [LONG, LONG[::-1], [(3 * i + 1) % CFG.vocab_size for i in range(37)]]
    requests = [GenerationRequest(p, SamplingConfig(), GenerationConfig(max_new_tokens=12), logprobs=0)
                for p in prompts]
    want = [_tokens_and_logprobs(AREngine(target, tok, batching).generate(r)) for r in requests]
    if mode == "ar":
        engine = AREngine(target, tok, batching)
    elif mode == "sd":
        engine = SDEngine(target, draft, tok, SpeculationConfig(mode="sd", k=3), batching=batching)
    else:
        engine = SSDEngine.in_process(target, draft, tok, SpeculationConfig(mode="ssd", k=3), batching=batching)
    try:
        got = _run_batch(engine, requests, _tokens_and_logprobs)
    finally:
        getattr(engine, "close", lambda: None)()
    for (ids, logprobs), (want_ids, want_logprobs) in zip(got, want):
        assert ids == want_ids and logprobs == want_logprobs
    # The premise: chunks cut short (to the invariant ubatches) change the logprobs: by
    # 1.5e-6 in plain layouts and 1.2e-6 repacked (measured, BF16 cache), and any difference
    # fails the bit-for-bit check above.
    step = target.invariant_options()["n_ubatch"]
    other = AREngine(target, tok, BatchingConfig(prefill_chunk=step, max_batched_tokens=21))
    cut = [_tokens_and_logprobs(other.generate(r))[1] for r in requests]
    apart = max(abs(a - b) for c, (_, w) in zip(cut, want) for a, b in zip(c, w))
    assert apart > 0


def test_prompt_logprobs_match_the_torch_model(tmp_path):
    """The same on llama.cpp's kernels (an F32 GGUF of a torch model, prompt chunks of 3):
    the values to test_llamacpp's fp32 tolerance."""
    from tests.test_prompt_logprobs import BATCHING, reference

    model = _model()
    lm = LlamaCppModel(export_gguf(model, tmp_path / "tiny.gguf"))
    prompt = [1, 5, 7, 2, 9, 9, 3, 0, 4]
    request = GenerationRequest(prompt, SamplingConfig(), GenerationConfig(max_new_tokens=4), prompt_logprobs=0)
    got = AREngine(lm, TOKENIZER, BATCHING).generate(request).prompt_logprobs
    want = reference(model, prompt).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in got], dtype=torch.float64), want, rtol=0, atol=1e-4)


def test_asking_for_prompt_logprobs_leaves_a_llamacpp_rows_cache_as_it_was(k_quant_files, monkeypatch):
    """On Q4_K_M weights, in every layout this host runs (plain, repacked, prompts on the plain
    twin): a 40-token prompt in chunks of 16 runs as prompt chunks whether or not the request
    asks for its log-probabilities, so its cache is the same, and so are the output's tokens
    and, from the second on, their log-probabilities, bit for bit. The first token's logits come
    from the last chunk's forward, which then has 8 output rows instead of 1: another kernel,
    float rounding apart (measured 4.8e-7 in its log-probability). Power: scoring the prompt as
    packed invariant ubatches (what `decode` does with a plain "all" job) changes the cache
    (in an F16 cache)."""
    from ssd.models import llamacpp

    tok = TinyTokenizer(CFG.vocab_size)
    batching = BatchingConfig(prefill_chunk=16)

    def run(model, prompt_logprobs):
        req = GenerationRequest(LONG, SamplingConfig(), GenerationConfig(max_new_tokens=8), logprobs=0,
                                prompt_logprobs=prompt_logprobs)
        out = AREngine(model, tok, batching).generate(req)
        return out.token_ids, [e.logprob for e in out.logprobs], out.prompt_logprobs

    for repacked, plain_prefill in ((False, False), (True, False), (True, True)):
        if repacked and not llamacpp.repack_probe(k_quant_files[0])["runs"]:
            continue
        model = llamacpp.LlamaCppModel(k_quant_files[0], use_extra_bufts=repacked, plain_prefill=plain_prefill)
        ids, logprobs, none = run(model, None)
        asked_ids, asked_logprobs, scored = run(model, 0)
        assert none is None and [e.token for e in scored] == LONG[1:]
        assert asked_ids == ids and asked_logprobs[1:] == logprobs[1:], (repacked, plain_prefill)
        assert asked_logprobs[0] == pytest.approx(logprobs[0], abs=1e-5)
    original = llamacpp.LlamaCppContext._calls

    def packed(self, jobs):  # a prompt chunk that wants every row packed like any "all" job
        return original(self, [(s, p, i, "all" if w == "prompt" else w) for s, p, i, w in jobs])

    monkeypatch.setattr(llamacpp.LlamaCppContext, "_calls", packed)
    # seen in an F16 cache: this tiny model's differences round away in the BF16 one the probe picks
    monkeypatch.setattr(llamacpp.LlamaCppModel, "kv_type", property(lambda self: "f16"))
    model = llamacpp.LlamaCppModel(k_quant_files[0], use_extra_bufts=False)
    assert run(model, 0)[1][1:] != run(model, None)[1][1:]


def test_short_prompt_chunks_run_in_place_long_ones_on_the_plain_twin(k_quant_files, monkeypatch):
    """Moving a row's cache to the plain twin and back costs more than a short chunk saves there:
    chunks shorter than PLAIN_PREFILL_MIN run in place (a decision by length alone, so a prompt's
    cache still depends on the prompt alone)."""
    if not repack_probe(k_quant_files[0])["runs"]:
        pytest.skip("llama.cpp's repacked layouts do not run on this host")
    monkeypatch.setattr(llamacpp_module, "PLAIN_PREFILL_MIN", PLAIN_PREFILL_MIN)
    target = LlamaCppModel(k_quant_files[0], use_extra_bufts=True, plain_prefill=True)
    context = LlamaCppContext(target, n_seq=1, n_ctx_seq=256)
    moved = []
    real = context._prompt_chunk_apart
    monkeypatch.setattr(context, "_prompt_chunk_apart", lambda piece: moved.append(len(piece[3])) or real(piece))
    row = LlamaCppSequence(context)
    ids = [(5 * i + 3) % CFG.vocab_size for i in range(2 * PLAIN_PREFILL_MIN)]
    row.forward(ids[: PLAIN_PREFILL_MIN - 1], last_only=True)
    row.forward(ids[PLAIN_PREFILL_MIN - 1 :], last_only=True)
    assert moved == [PLAIN_PREFILL_MIN + 1]


def _long_rows(target, draft, mode="ar"):
    """Three 300-token prompts decoded together and each alone (greedy, logprobs): past 256
    positions llama.cpp's KV view holds 512 cells, where ggml's flash attention over an F16
    cache takes another path for a lone query row than for several."""
    from tests.test_prefix_cache import _engine, _outcome, _request
    prompts = [[(a * i + b) % CFG.vocab_size for i in range(300)] for a, b in ((5, 3), (7, 1), (3, 2))]
    batching = BatchingConfig(prefill_chunk=64, prefix_cache=False)
    engine = _engine(mode, target, draft, TinyTokenizer(CFG.vocab_size), batching)
    together = [_outcome(r) for r in run_together(engine, [_request(p, n=12) for p in prompts])]
    alone = [_outcome(_engine("ar", target, None, TinyTokenizer(CFG.vocab_size), batching).generate(_request(p, n=12)))
             for p in prompts]
    return together, alone


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_rows_past_256_positions_equal_each_alone_bit_for_bit(k_quant_pair, mode):
    """Batched AR rows, and SD's verifications, at 300-312 positions equal AR alone bit for
    bit, tokens and logprobs, with the probe's options (which it found past PROBE_LEAD)."""
    target, draft = k_quant_pair
    with torch_threads(2):
        together, alone = _long_rows(target, draft, mode)
    assert together == alone


def test_an_f16_cache_parts_rows_past_256_positions(k_quant_files):
    """The premise: with an F16 cache (llama.cpp's default, `model.llamacpp_kv: f16`) a lone
    decode step there takes the split-KV path, and the batched rows' logprobs part from each
    alone's; the probe picks BF16 keys over F16 values for this model."""
    target = LlamaCppModel(k_quant_files[0], use_extra_bufts=False, kv_type="f16")  # model.llamacpp_kv: f16
    assert target.kv_type == "f16" and LlamaCppModel(k_quant_files[0], use_extra_bufts=False).kv_type == "bf16/f16"
    with torch_threads(2):
        together, alone = _long_rows(target, None)
    apart = max(abs(a - b) for (_, got), (_, want) in zip(together, alone) for a, b in zip(got, want))
    assert apart > 0, apart


@pytest.mark.parametrize("kv", ["bf16/f16", "bf16"])
def test_either_exact_cache_keeps_rows_past_256_positions_equal_each_alone(k_quant_files, kv):
    """`model.llamacpp_kv: bf16` (BF16 values too: summed in F32, a step 5-20% dearer at
    1200-2400 positions) is as exact as the probe's BF16 keys over F16 values."""
    target = LlamaCppModel(k_quant_files[0], use_extra_bufts=False, kv_type=kv)
    with torch_threads(2):
        together, alone = _long_rows(target, None)
    assert together == alone


def test_ssd_drafts_a_prompt_longer_than_the_drafts_batch(tmp_path):
    """A prompt past n_batch (512) tokens: a llama.cpp sequence's forward takes it in n_batch
    pieces, so the speculator's draft prefill holds and the link stays up (hits), greedy equal
    to AR. As one llama_decode, the draft's prefill failed, the link was lost and the engine ran
    the target alone (no hits)."""
    cfg = dataclasses.replace(CFG, max_position_embeddings=1024)
    lm = LlamaCppModel(export_gguf(_model(cfg), tmp_path / "long.gguf"))
    draft = LlamaCppModel(export_gguf(_model(dataclasses.replace(cfg, noise=0.03)), tmp_path / "long-draft.gguf"))
    prompt = [(7 * i + 3) % CFG.vocab_size for i in range(600)]
    whole = LlamaCppSequence(draft).forward(prompt)  # a sequence takes any length: n_batch pieces
    in_pieces = LlamaCppSequence(draft)
    assert torch.equal(whole, torch.cat([in_pieces.forward(prompt[:512]), in_pieces.forward(prompt[512:])]))
    want = AREngine(lm, TOKENIZER).generate(_request(prompt)).token_ids
    engine = SSDEngine.in_process(lm, draft, TOKENIZER, _ssd(3, budget=6))
    try:
        got = engine.generate(dataclasses.replace(_request(prompt), speculation=_ssd(3, budget=6)))
        assert engine.link_up
    finally:
        engine.close()
    assert got.token_ids == want and got.stats.spec.hits > 0
