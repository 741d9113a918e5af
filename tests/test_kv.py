import pytest
import torch

from ssd.models.kv import KVSequence

SEQ = [1, 2, 3, 4, 5, 6, 7, 8]


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_incremental_forwards_match_one_full_forward(tiny_models):
    target, _ = tiny_models
    kv = KVSequence(target)
    rows = torch.cat([kv.forward(SEQ[:3]), kv.forward(SEQ[3:4]), kv.forward(SEQ[4:])])
    torch.testing.assert_close(rows, full_logits(target, SEQ))
    assert kv.length == len(SEQ) and kv.tokens == SEQ


def test_rollback_then_score_matches_fresh_forward(tiny_models):
    target, _ = tiny_models
    kv = KVSequence(target)
    kv.forward(SEQ)
    kv.rollback(5)
    assert kv.tokens == SEQ[:5] and kv.cache.get_seq_length() == 5
    other = [9, 10, 11]
    torch.testing.assert_close(kv.forward(other), full_logits(target, SEQ[:5] + other)[5:])


def test_last_only_returns_the_last_row(tiny_models):
    target, _ = tiny_models
    kv = KVSequence(target)
    last = kv.forward(SEQ, last_only=True)
    assert last.shape[0] == 1
    torch.testing.assert_close(last[0], full_logits(target, SEQ)[-1])


def test_catch_up_feeds_only_the_missing_tail(tiny_models):
    target, _ = tiny_models
    kv = KVSequence(target)
    kv.forward(SEQ[:4])
    torch.testing.assert_close(kv.catch_up(SEQ), full_logits(target, SEQ)[-1])
    assert kv.tokens == SEQ


def test_catch_up_refuses_a_diverged_cache(tiny_models):
    kv = KVSequence(tiny_models[0])
    kv.forward([1, 2, 3])
    with pytest.raises(ValueError, match="prefix"):
        kv.catch_up([1, 9, 3, 4])
    with pytest.raises(ValueError, match="prefix"):
        kv.catch_up([1, 2, 3])  # nothing left to feed


def test_rollback_bounds(tiny_models):
    kv = KVSequence(tiny_models[0])
    kv.forward([1, 2])
    with pytest.raises(ValueError):
        kv.rollback(3)
    kv.rollback(2)  # no-op
    kv.reset()
    assert kv.length == 0 and kv.cache.get_seq_length() == 0
