"""KVSequence on both carriers: the lean forward over a preallocated cache and
transformers' forward over a DynamicCache, against one full forward."""

import copy
import inspect

import pytest
import torch
from transformers import Qwen2ForCausalLM

from ssd.config import ModelConfig, TinyModelConfig
from ssd.models import load_model
from ssd.models.kv import KVSequence, UnsupportedModelError, cache_kwargs
from ssd.models.quant import int8_supported

SEQ = [1, 2, 3, 4, 5, 6, 7, 8]


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture(params=[True, False], ids=["fast", "transformers"])
def fast(request):
    return request.param


def test_incremental_forwards_match_one_full_forward(tiny_models, fast):
    target, _ = tiny_models
    kv = KVSequence(target, fast)
    rows = torch.cat([kv.forward(SEQ[:3]), kv.forward(SEQ[3:4]), kv.forward(SEQ[4:])])
    torch.testing.assert_close(rows, full_logits(target, SEQ))
    assert kv.length == len(SEQ) and kv.tokens == SEQ


def test_rollback_then_score_matches_fresh_forward(tiny_models, fast):
    target, _ = tiny_models
    kv = KVSequence(target, fast)
    kv.forward(SEQ)
    kv.rollback(5)
    assert kv.tokens == SEQ[:5] and kv.cached == 5
    other = [9, 10, 11]
    torch.testing.assert_close(kv.forward(other), full_logits(target, SEQ[:5] + other)[5:])


def test_last_only_returns_the_last_row(tiny_models, fast):
    target, _ = tiny_models
    kv = KVSequence(target, fast)
    last = kv.forward(SEQ, last_only=True)
    assert last.shape[0] == 1
    torch.testing.assert_close(last[0], full_logits(target, SEQ)[-1])


def test_catch_up_feeds_only_the_missing_tail(tiny_models, fast):
    target, _ = tiny_models
    kv = KVSequence(target, fast)
    kv.forward(SEQ[:4])
    torch.testing.assert_close(kv.catch_up(SEQ), full_logits(target, SEQ)[-1])
    assert kv.tokens == SEQ


def test_catch_up_refuses_a_diverged_cache(tiny_models, fast):
    kv = KVSequence(tiny_models[0], fast)
    kv.forward([1, 2, 3])
    with pytest.raises(ValueError, match="prefix"):
        kv.catch_up([1, 9, 3, 4])
    with pytest.raises(ValueError, match="prefix"):
        kv.catch_up([1, 2, 3])  # nothing left to feed


def test_rollback_bounds(tiny_models, fast):
    kv = KVSequence(tiny_models[0], fast)
    kv.forward([1, 2])
    with pytest.raises(ValueError):
        kv.rollback(3)
    kv.rollback(2)  # no-op
    kv.reset()
    assert kv.length == 0 and kv.cached == 0


def test_the_lean_forward_is_used_where_supported(tiny_models):
    assert KVSequence(tiny_models[0]).cached == 0
    assert KVSequence(tiny_models[0])._fast is not None  # Qwen2 layout: the default carrier


def test_the_preallocated_cache_grows_past_its_first_capacity(tiny_models):
    target, _ = tiny_models
    ids = [(7 * i) % 16 for i in range(300)]  # more than the initial 256 entries
    kv = KVSequence(target, fast=True)
    rows = torch.cat([kv.forward(ids[:250]), kv.forward(ids[250:])])
    torch.testing.assert_close(rows, full_logits(target, ids))


@pytest.mark.skipif(not int8_supported(), reason="needs torch's x86 int8 kernels")
def test_verified_rows_are_bit_identical_to_decoded_rows(fast):
    """On an int8 model (row-independent linears), scoring several tokens in one
    forward gives each row exactly as one-token steps do, on either carrier."""
    target = load_model(ModelConfig(name="tiny", quantization="int8", tiny=TinyModelConfig(hidden_size=64)))
    chunk, steps = KVSequence(target, fast), KVSequence(target, fast)
    chunk.forward(SEQ[:3])
    steps.forward(SEQ[:3])
    together = chunk.forward(SEQ[3:])
    alone = torch.cat([steps.forward([t]) for t in SEQ[3:]])
    assert torch.equal(together, alone)


# What the installed transformers calls the cache argument (5.24: `cache`; 5.17: `past_key_values`).
CACHE_ARG = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


class PastKeyValuesLM(Qwen2ForCausalLM):
    """transformers 5.17's interface: the cache is `past_key_values`, and an
    unknown keyword (like 5.24's `cache=`) vanishes into **kwargs."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=logits_to_keep, **{CACHE_ARG: past_key_values})


def past_key_values_model(model):
    old = copy.deepcopy(model)
    old.__class__ = PastKeyValuesLM
    return old


def test_the_cache_reaches_a_forward_that_names_it_past_key_values(tiny_models):
    """Decode steps on transformers' carrier see their context whatever the
    installed version calls the cache argument (a swallowed one: no context)."""
    old = past_key_values_model(tiny_models[0])
    kv = KVSequence(old, fast=False)
    rows = torch.cat([kv.forward(SEQ[:3]), kv.forward(SEQ[3:4]), kv.forward(SEQ[4:])])
    torch.testing.assert_close(rows, full_logits(tiny_models[0], SEQ))


def test_a_forward_without_a_known_cache_argument_is_refused(tiny_models):
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    with pytest.raises(UnsupportedModelError, match="not supported"):
        cache_kwargs(NoCache(), object())
