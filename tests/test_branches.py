"""Branch decoding off a shared KV prefix: tree mask and batched cache.

Every branch at every step must give the logits of decoding that branch alone
from scratch; `finish` must leave the sequence's cache exactly as it was.
"""

from __future__ import annotations

import random

import pytest
import torch

from ssd.config import TinyModelConfig
from ssd.models import build_tiny_model
from ssd.models.kv import KVSequence
from ssd.saguaro.branches import (
    BatchedBranchDecoder,
    TreeBranchDecoder,
    make_branch_decoder,
)

CONTEXT = [1, 2, 3, 4, 5, 6, 7]  # committed context C
SPEC = [8, 9, 10, 11]  # drafted s1..sK (K = 4), cached by the glue pass
GLUE = CONTEXT + SPEC
K = len(SPEC)
STEPS = K  # decode steps after the first token
IMPLS = [TreeBranchDecoder, BatchedBranchDecoder]
TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: only summation order may differ


def branches(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """n branches (prefix_len, first token): every k = 0..K, duplicate prefixes, distinct t."""
    rng = random.Random(seed)
    prefix = [len(CONTEXT) + k for k in range(K + 1)]
    prefix += [len(CONTEXT)] * 3 + [len(GLUE)] * 2 + [0]  # duplicates, and an empty prefix
    prefix += [rng.randint(len(CONTEXT), len(GLUE)) for _ in range(n)]
    prefix = prefix[:n]
    firsts = [(3 * b + 1) % 16 for b in range(n)]
    return prefix, firsts


def next_tokens(n: int, step: int) -> list[int]:
    return [(5 * b + 7 * step + 2) % 16 for b in range(n)]


def fresh_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits after the last of `ids`, from one forward with no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def glued_kv(model, fast: bool | None = None) -> KVSequence:
    kv = KVSequence(model, fast)
    kv.forward(GLUE)
    return kv


def run_all_steps(decoder, kv, prefix, firsts) -> list[torch.Tensor]:
    """Logits [B, V] per step: start plus STEPS steps, then finish."""
    out = [decoder.start(kv, prefix, firsts).clone()]
    for step in range(STEPS):
        out.append(decoder.step(next_tokens(len(prefix), step)).clone())
    decoder.finish()
    return out


def snapshot(kv: KVSequence) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in kv.prefix_kv(kv.cached)]


def unchanged(kv: KVSequence, before) -> bool:
    return kv.cached == len(GLUE) and all(
        torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv.prefix_kv(kv.cached), before)
    )


CARRIERS = pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])


@pytest.fixture
def draft(tiny_models):
    return tiny_models[1]


@CARRIERS
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 6, 16])
@pytest.mark.parametrize("max_steps", [1, 8])  # 1: the mask buffer must grow mid-way
def test_each_branch_matches_decoding_it_alone(draft, impl, n, max_steps, fast):
    kv = glued_kv(draft, fast)
    prefix, firsts = branches(n)
    steps = run_all_steps(impl(max_steps), kv, prefix, firsts)
    for b in range(n):
        history = GLUE[: prefix[b]] + [firsts[b]]
        for step, logits in enumerate(steps):
            if step:
                history.append(next_tokens(n, step - 1)[b])
            torch.testing.assert_close(logits[b], fresh_last_logits(draft, history), **TOL)


@CARRIERS
@pytest.mark.parametrize("impl", IMPLS)
def test_finish_restores_the_sequence_cache(draft, impl, fast):
    kv = glued_kv(draft, fast)
    before = snapshot(kv)
    prefix, firsts = branches(16)
    run_all_steps(impl(), kv, prefix, firsts)
    assert kv.tokens == GLUE and kv.length == len(GLUE) and unchanged(kv, before)
    # The sequence goes on as if no branch had ever been decoded.
    new = [12, 13, 14]
    torch.testing.assert_close(kv.forward(new), glued_kv(draft, fast).forward(new), rtol=0, atol=0)


@CARRIERS
def test_batched_never_writes_the_sequence_cache(draft, fast):
    kv = glued_kv(draft, fast)
    before = snapshot(kv)
    decoder = BatchedBranchDecoder()
    prefix, firsts = branches(8)
    decoder.start(kv, prefix, firsts)
    decoder.step(next_tokens(8, 0))
    assert unchanged(kv, before)  # while the branches are active, not only after
    decoder.finish()


@CARRIERS
def test_implementations_agree(draft, fast):
    prefix, firsts = branches(16, seed=3)
    tree = run_all_steps(TreeBranchDecoder(), glued_kv(draft, fast), prefix, firsts)
    batched = run_all_steps(BatchedBranchDecoder(), glued_kv(draft, fast), prefix, firsts)
    for a, b in zip(tree, batched):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_eager_attention_takes_an_additive_mask(impl):
    """Eager attention adds the mask to the scores: a bool mask would be silently wrong.

    Eager softmax runs in fp32 even for an fp64 model, so only fp32 agreement
    holds: measured 1.6e-6 on logits up to ~5, against an element-wise
    1e-5 + 1e-5 * |logit| before (6x margin on a logit near 0). The bound is now
    1e-4 of the row's largest logit (~300x margin); a mask that shows a branch
    one cached entry too many or too few moves its logits by O(1).
    """
    model = build_tiny_model(TinyModelConfig(vocab_size=16, seed=0), torch.float64)
    model.set_attn_implementation("eager")
    prefix, firsts = branches(6)
    # transformers' forward: the lean one (the default carrier) runs its own attention and
    # never reads the eager setting, so the tree decoder would not exercise it at all.
    steps = run_all_steps(impl(), glued_kv(model, fast=False), prefix, firsts)
    for b in range(6):
        history = GLUE[: prefix[b]] + [firsts[b]] + [next_tokens(6, s)[b] for s in range(STEPS)]
        want = fresh_last_logits(model, history)
        torch.testing.assert_close(steps[-1][b], want, rtol=0, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("impl", IMPLS)
def test_decoder_is_reusable_across_rounds(draft, impl):
    decoder = impl()
    kv = glued_kv(draft)
    first = run_all_steps(decoder, kv, *branches(4))
    again = run_all_steps(decoder, kv, *branches(4))
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@CARRIERS
@pytest.mark.parametrize("impl", IMPLS)
def test_failed_forward_restores_the_cache(draft, impl, fast):
    kv = glued_kv(draft, fast)
    before = snapshot(kv)
    decoder = impl()
    decoder.start(kv, [7, 9], [1, 2])
    with pytest.raises(IndexError):
        decoder.step([3, 999])  # out of vocabulary: the embedding lookup fails
    assert not decoder.active and unchanged(kv, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_misuse_is_refused(draft, impl):
    kv = glued_kv(draft)
    decoder = impl()
    with pytest.raises(RuntimeError, match="start"):
        decoder.step([1])
    with pytest.raises(ValueError, match="prefix"):
        decoder.start(kv, [len(GLUE) + 1], [1])
    with pytest.raises(ValueError, match="one first token"):
        decoder.start(kv, [3, 4], [1])
    with pytest.raises(ValueError, match="one first token"):
        decoder.start(kv, [], [])
    decoder.start(kv, [3, 4], [1, 2])
    with pytest.raises(RuntimeError, match="finish"):
        decoder.start(kv, [3], [1])
    with pytest.raises(ValueError, match="one token per branch"):
        decoder.step([1])
    decoder.finish()
    decoder.finish()  # idempotent
    assert kv.cached == len(GLUE)


def test_factory():
    assert isinstance(make_branch_decoder(), TreeBranchDecoder)
    assert isinstance(make_branch_decoder("batched"), BatchedBranchDecoder)
    with pytest.raises(ValueError, match="tree"):
        make_branch_decoder("beam")


def test_batched_branches_see_the_prefix_under_past_key_values(draft):
    """The batched decoder's cache reaches a forward that calls it `past_key_values` (transformers 5.17)."""
    from tests.test_kv import past_key_values_model

    old = past_key_values_model(draft)
    prefix, firsts = branches(6)
    got = run_all_steps(BatchedBranchDecoder(), glued_kv(old, fast=False), prefix, firsts)
    want = run_all_steps(BatchedBranchDecoder(), glued_kv(draft, fast=False), prefix, firsts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
