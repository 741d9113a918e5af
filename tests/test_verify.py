import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd.sampling import make_generator, sample
from ssd.verify import RESIDUAL_EPS, Outcome, ProposerError, residual, verify
from tests.stats import ALPHA, chi_square_pvalue

V = 6


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float64)
    return t / t.sum()


def random_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5, -1)


# --- greedy -----------------------------------------------------------------

def one_hot(*ids: int) -> torch.Tensor:
    return torch.eye(V, dtype=torch.float64)[list(ids)]


def test_greedy_accepts_matching_prefix_then_corrects():
    out = verify([1, 2, 3], one_hot(1, 2, 3), one_hot(1, 2, 5, 4), make_generator(0), greedy=True)
    assert out == Outcome(2, 5)
    assert out.tokens([1, 2, 3]) == [1, 2, 5]


def test_greedy_all_accepted_gives_bonus():
    out = verify([1, 2], one_hot(1, 2), one_hot(1, 2, 4), make_generator(0), greedy=True)
    assert out == Outcome(2, 4)


def test_greedy_draws_no_random_numbers():
    gen = make_generator(0)
    state = gen.get_state()
    verify([1], one_hot(1), one_hot(0, 2), gen, greedy=True)
    assert torch.equal(gen.get_state(), state)


def test_stochastic_with_one_hot_target_equals_greedy():
    q = random_rows(3, 0)
    p = one_hot(1, 2, 5, 4)
    for seed in range(50):
        gen = make_generator(seed)
        drafted = [sample(row, gen) for row in q]
        greedy = verify(drafted, q, p, gen, greedy=True)
        assert verify(drafted, q, p, gen) == greedy


# --- stochastic edge cases -----------------------------------------------------

def test_p_equal_q_accepts_everything():
    rows = random_rows(4, 1)
    for seed in range(200):
        gen = make_generator(seed)
        drafted = [sample(row, gen) for row in rows[:3]]
        assert verify(drafted, rows[:3], rows, gen).k == 3


def test_zero_q_drafted_token_is_a_proposer_bug():
    q = dist(1, 1, 0, 1, 1, 1).unsqueeze(0)
    with pytest.raises(ProposerError, match="token 2"):
        verify([2], q, random_rows(2, 0), make_generator(0))


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"p \[K\+1, V\]"):
        verify([1, 2], random_rows(2, 0), random_rows(2, 1), make_generator(0))


def test_k_zero_samples_from_target():
    p = dist(0, 0, 1, 0, 0, 0).unsqueeze(0)
    assert verify([], p.new_zeros(0, V), p, make_generator(0)) == Outcome(0, 2)


def test_residual_of_rounding_noise_falls_back_to_p():
    p = dist(1, 2, 3, 4, 5, 6)
    q = p.clone()
    q[0] += 1e-17  # p <= q everywhere, up to rounding
    assert torch.equal(residual(p, q), p)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 10), min_size=V, max_size=V).filter(lambda w: sum(w) > 1e-3),
    st.lists(st.floats(0, 10), min_size=V, max_size=V).filter(lambda w: sum(w) > 1e-3),
)
def test_residual_is_a_distribution_supported_where_p_exceeds_q(pw, qw):
    p, q = dist(*pw), dist(*qw)
    r = residual(p, q)
    assert float(r.sum()) == pytest.approx(1.0)
    assert (r >= 0).all()
    if float(torch.clamp(p - q, min=0).sum()) > RESIDUAL_EPS:
        assert (r[p <= q] == 0).all()
    # The identity behind exactness: q*min(1, p/q) + (1 - accept mass)*r == p.
    accept_mass = torch.minimum(p, q)
    torch.testing.assert_close(accept_mass + (1 - accept_mass.sum()) * r, p)


# --- the outcome's distribution -------------------------------------------------

def emitted(verifier, q, p, n, seed0=0):
    """The first two emitted tokens of n rounds (q, p rows fixed, K = 2)."""
    out = []
    for seed in range(seed0, seed0 + n):
        gen = make_generator(seed)
        drafted = [sample(row, gen) for row in q]
        tokens = verifier(drafted, q, p, gen).tokens(drafted)
        if len(tokens) == 1:  # a rejection at position 0: the next token is a fresh draw from p[1]
            tokens.append(sample(p[1], gen))
        out.append(tuple(tokens[:2]))
    return out


def expected_pairs(p):
    return {(a, b): float(p[0, a] * p[1, b]) for a in range(V) for b in range(V)}


def accept_all(drafted, q, p, gen, greedy=False):
    return Outcome(len(drafted), sample(p[-1], gen))


def skip_ratio_test(drafted, q, p, gen, greedy=False):
    """The trap seen elsewhere: accept only drafts equal to the argmax of p."""
    return verify(drafted, q, torch.eye(V, dtype=torch.float64)[p.argmax(-1)], gen, greedy=True)


def test_verified_tokens_follow_target_distribution():
    q, p = random_rows(2, 10), random_rows(3, 11)
    assert chi_square_pvalue(emitted(verify, q, p, 6000), expected_pairs(p)) > ALPHA


@pytest.mark.parametrize("broken", [accept_all, skip_ratio_test])
def test_distribution_test_has_power_against_broken_verifiers(broken):
    q, p = random_rows(2, 10), random_rows(3, 11)
    assert chi_square_pvalue(emitted(broken, q, p, 6000), expected_pairs(p)) < ALPHA
