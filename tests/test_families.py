"""The lean forward against transformers' own forward, for every family it takes.

Tiny random qwen2, qwen3, llama and mistral models (tests.families) in fp64:
every cache operation the engines use (tests.test_gpu_paths.script: prefill,
decode, verification, rollback, a long prefill, tree-masked rows) gives
transformers' logits on the lean carrier, its one-call attention and its
static-shape (CUDA graph) twin; greedy SD equals AR. (The same on a
tensor-parallel target: tests/test_tp.py, in its spawned world.) A model the lean path cannot take is named at load, once.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ssd.models import fast as fast_module
from ssd.models.fast import FastForward, lean_refusal, note_lean_path
from ssd.models.graphs import GraphedForward, causal_mask
from ssd.models.kv import KVSequence
from tests.families import DRAFT_NOISE, FAMILIES, NEW_TOKENS, PROMPTS, build_family, generations, reference
from tests.test_gpu_paths import script, sequence

TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: only summation order may differ


def static_script(model) -> list[torch.Tensor]:
    """Decode and verification rows through the static-shape forward (what CUDA graphs capture), eagerly."""
    fast = FastForward(model)
    kv = KVSequence(model, fast=True)
    out = [kv.forward([1, 2, 3, 4, 5, 6, 7])]
    runner = GraphedForward(fast, kv.cache, graphs=False)
    for ids in ([8], [9, 10, 11]):
        start, m = kv.cached, len(ids)
        slots = torch.arange(start, start + m)
        out.append(runner(torch.tensor(ids), slots, slots, causal_mask(start, m, kv.cache.capacity, "cpu")))
        kv.tokens.extend(ids)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_forward_gives_transformers_logits(family: str) -> None:
    model = build_family(family)
    assert lean_refusal(model) is None
    want = reference(model)
    for one_call in (False, True):
        for got, ref in zip(script(sequence(model, one_call)), want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
    ref = KVSequence(model, fast=False)
    expected = [ref.forward([1, 2, 3, 4, 5, 6, 7]), ref.forward([8]), ref.forward([9, 10, 11])]
    for got, ref_logits in zip(static_script(model), expected, strict=True):
        torch.testing.assert_close(got, ref_logits, **TOL)


def test_qwen3_without_its_head_norms_fails_the_comparison(monkeypatch) -> None:
    """The check's power: the lean forward with q_norm/k_norm skipped is caught."""
    model = build_family("qwen3")
    want = reference(model)
    real = FastForward.qkv

    def no_norms(self, attn, h, cos, sin):
        class Bare:  # the attention module without its norms
            q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        return real(self, Bare, h, cos, sin)

    monkeypatch.setattr(FastForward, "qkv", no_norms)
    got = script(sequence(model, False))
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_sd_equals_ar(family: str) -> None:
    target, draft = build_family(family), build_family(family, noise=DRAFT_NOISE)
    tokens = generations(target, draft)
    half = len(PROMPTS)
    assert tokens[:half] == tokens[half:]
    assert all(len(t) == NEW_TOKENS for t in tokens)


def test_a_model_the_lean_path_cannot_take_is_named_once(caplog) -> None:
    sliding = build_family("mistral", sliding_window=4)
    assert "sliding-window" in lean_refusal(sliding)
    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0))
    assert "architecture gpt2" in lean_refusal(other)
    with caplog.at_level(logging.INFO, logger=fast_module.__name__):
        for _ in range(2):
            note_lean_path(sliding)
            note_lean_path(other)
    warnings = [  # this module's records only: transformers' own warnings propagate in some test orders
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == fast_module.__name__
    ]
    assert len(warnings) == 2 and "sliding-window" in warnings[0] and "gpt2" in warnings[1], warnings
    assert not KVSequence(sliding).lean


def test_a_tensor_parallel_plan_the_lean_forward_cannot_take_is_refused() -> None:
    model = build_family("llama")
    standard = {f"model.layers.*.{k}": v for k, v in fast_module.TP_LAYER_PLAN.items()}
    model._tp_size, model._tp_plan = 2, standard
    assert "holds 32 output rows, not heads / 2 = 16" in lean_refusal(model)  # not actually sharded
    for name in ("q_proj", "k_proj", "v_proj"):  # as a rank's shards would be
        proj = getattr(model.model.layers[0].self_attn, name)
        proj.weight = torch.nn.Parameter(proj.weight[: proj.weight.shape[0] // 2])
    assert lean_refusal(model) is None
    model._tp_plan = {**standard, "model.layers.*.self_attn.o_proj": "colwise"}
    assert "tensor-parallel plan" in lean_refusal(model)
    model._tp_plan = standard
    model._tp_size = 4  # 2 kv heads cannot be split 4 ways
    assert "num_key_value_heads" in lean_refusal(model)
