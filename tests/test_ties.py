"""The near-tie rule for low-precision greedy comparisons (tests/ties.py) has power."""

from types import SimpleNamespace

import pytest
import torch

from tests.ties import assert_equal_up_to_near_tie, first_difference

PROMPT = [1, 2]
EXPECTED = [3, 4, 5, 6]


class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits depend only on the context length."""

    def __init__(self, rows: dict[int, list[float]]) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, input_ids):
        return SimpleNamespace(logits=torch.tensor([[self.rows[input_ids.shape[1]]]]))


# After PROMPT + EXPECTED[:2] (length 4): tokens 5 and 7 are tied within 0.1, token 0 is far behind.
MODEL = FixedLogits({4: [1.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 8.9], 3: [0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0]})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_equal_or_parting_at_a_near_tie_passes():
    assert_equal_up_to_near_tie(MODEL, PROMPT, EXPECTED, EXPECTED, tol=0.5)
    assert_equal_up_to_near_tie(MODEL, PROMPT, EXPECTED, [3, 4, 7, 0, 0], tol=0.5)  # nothing after the tie counts


@pytest.mark.parametrize("got, tol", [
    ([3, 4, 7, 6], 0.05),  # the tie is wider than the tolerance
    ([3, 4, 0, 6], 0.5),  # a token far behind the best, though the top-2 are tied
    ([3, 7, 5, 6], 0.5),  # parting where the best logit leads by 8
    ([3, 4, 5], 0.5),  # one output stops early
])
def test_any_other_difference_fails(got, tol):
    with pytest.raises(AssertionError, match="part|stops"):
        assert_equal_up_to_near_tie(MODEL, PROMPT, EXPECTED, got, tol)
