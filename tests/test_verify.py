import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd.sampling import as_drawn, make_generator, sample, uniforms
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


# --- the vectorised routine against a plain loop ----------------------------------

def loop_verify(drafted, q, p, gen):
    """The textbook loop, one position at a time, on the same K uniforms drawn up front."""
    u = uniforms(gen, len(drafted))
    for i, x in enumerate(drafted):
        qx, px = float(q[i, x]), float(p[i, x])
        if qx <= 0.0:
            raise ProposerError(f"drafted token {x} at position {i} has q = {qx}")
        if float(u[i]) * qx < px:
            continue
        return Outcome(i, sample(residual(p[i], q[i]), gen))
    return Outcome(len(drafted), sample(p[-1], gen))


def sparse_rows(n: int, seed: int) -> torch.Tensor:
    """Rows with some zero entries (top-k-like), so drafts with q = 0 or p = 0 occur."""
    rows = random_rows(n, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    rows = rows * (torch.rand(n, V, generator=g) < 0.6)
    rows[:, 0] += 1e-3  # no empty row
    return rows / rows.sum(-1, keepdim=True)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_vectorised_verify_equals_the_loop(k):
    for case in range(60):
        q, p = sparse_rows(k, 100 * k + case), sparse_rows(k + 1, 7 + 100 * k + case)
        if case % 3 == 0:  # p == q on the drafted rows: long accepted runs
            p[:k] = q
        pick = torch.Generator().manual_seed(case)
        drafted = torch.randint(V, (k,), generator=pick).tolist()  # some with q = 0: proposer bugs
        results = []
        for run in (verify, loop_verify):
            gen = make_generator(case)
            try:
                results.append((run(drafted, q, p, gen), gen.get_state()))
            except ProposerError as exc:
                results.append((str(exc), gen.get_state()))
        (a, state_a), (b, state_b) = results
        assert a == b and torch.equal(state_a, state_b), (k, case)


def test_zero_q_past_the_first_rejection_is_not_looked_at():
    q = torch.stack([dist(1, 1, 1, 1, 1, 1), dist(1, 0, 1, 1, 1, 1)])
    p = torch.stack([dist(0, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1)])
    for seed in range(20):  # p[0, 0] = 0: position 0 always rejects; q[1, 1] = 0 never matters
        assert verify([0, 1], q, p, make_generator(seed)).k == 0


def test_zero_q_at_a_reached_position_is_a_proposer_bug():
    q = torch.stack([dist(1, 1, 1, 1, 1, 1), dist(1, 0, 1, 1, 1, 1)])
    p = torch.stack([one_hot(0)[0], dist(1, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1)])
    with pytest.raises(ProposerError, match="token 1 at position 1"):  # position 0 always accepts
        verify([0, 1], q, p, make_generator(0))


def exact_outcomes(q, p):
    """P(k, t*) when each draft is drawn from its q row: the accepted length and the token."""
    accept = torch.minimum(p[:-1], q).sum(-1)  # beta_i: the chance position i accepts
    law, reach = {}, 1.0
    for i in range(q.shape[0]):
        for t, r in enumerate(residual(p[i], q[i]).tolist()):
            law[(i, t)] = reach * (1 - float(accept[i])) * r
        reach *= float(accept[i])
    for t, r in enumerate(p[-1].tolist()):
        law[(q.shape[0], t)] = reach * r
    return {key: mass for key, mass in law.items() if mass > 0}


def test_outcome_law_is_the_exact_one():
    q, p = random_rows(3, 20), random_rows(4, 21)
    p[0] = 0.5 * p[0] + 0.5 * q[0]  # one position that accepts often
    out = []
    for seed in range(6000):
        gen = make_generator(seed)
        drafted = [sample(row, gen) for row in q]
        o = verify(drafted, q, p, gen)
        out.append((o.k, o.token))
    assert chi_square_pvalue(out, exact_outcomes(q, p)) > ALPHA


def test_shipped_rows_are_verified_as_the_law_they_were_drawn_from():
    """A draft draws from its bfloat16 row, upcast, divided by the row's own sum
    (ssd.sampling.as_drawn, sample); verification must read q at the drafted
    tokens and in the residual under that same law. Rows summing to 1.5
    stand for bfloat16 rounding, magnified so a wrong law shows."""
    q, p = random_rows(3, 20), random_rows(4, 21)
    shipped = as_drawn(1.5 * q)
    law = shipped.double() / shipped.double().sum(-1, keepdim=True)
    for seed in range(300):
        drafted = [sample(row, make_generator(10_000 + seed)) for row in shipped]
        assert verify(drafted, shipped, p, make_generator(seed)) == verify(drafted, law, p, make_generator(seed))


def test_outcome_law_test_has_power_against_a_skewed_acceptance():
    q, p = random_rows(3, 20), random_rows(4, 21)

    def too_lenient(drafted, q, p, gen):  # accepts with min(1, 1.3 p / q)
        return verify(drafted, q, torch.cat([1.3 * p[:-1], p[-1:]]), gen)

    out = []
    for seed in range(6000):
        gen = make_generator(seed)
        drafted = [sample(row, gen) for row in q]
        o = too_lenient(drafted, q, p, gen)
        out.append((o.k, o.token))
    assert chi_square_pvalue(out, exact_outcomes(q, p)) < ALPHA


def test_residual_works_row_by_row():
    p, q = random_rows(3, 30), random_rows(3, 31)
    q[1] = p[1]  # a row whose residual is empty: it falls back to p
    rows = residual(p, q)
    for i in range(3):
        torch.testing.assert_close(rows[i], residual(p[i], q[i]), rtol=0, atol=0)
    assert torch.equal(rows[1], p[1])


# --- devices ----------------------------------------------------------------------

@pytest.mark.parametrize("q_device, p_device", [("meta", "cpu"), ("cpu", "meta")])
def test_q_and_p_on_different_devices_are_refused(q_device, p_device):
    q = torch.empty(2, V, dtype=torch.float64, device=q_device)
    p = torch.empty(3, V, dtype=torch.float64, device=p_device)
    expected = f"q is on {q_device} but p is on {p_device}; move q to p's device"
    with pytest.raises(ValueError, match=expected):
        verify([1, 2], q, p, make_generator(0))


def test_greedy_never_looks_at_q_or_its_device():
    q = torch.empty(2, V, dtype=torch.float64, device="meta")
    assert verify([1, 2], q, one_hot(1, 3, 4), make_generator(0), greedy=True) == Outcome(1, 3)


def test_verification_runs_on_p_device_until_one_host_read():
    """'meta' stands in for an accelerator: gathers, tests and the reduction
    all run there; the first host read (the stopping position) is the one
    that fails, after exactly K uniforms were drawn on the CPU."""
    q = torch.empty(3, V, dtype=torch.float64, device="meta")
    p = torch.empty(4, V, dtype=torch.float64, device="meta")
    gen, reference = make_generator(0), make_generator(0)
    with pytest.raises(RuntimeError, match="meta"):
        verify([1, 2, 3], q, p, gen)
    uniforms(reference, 3)
    assert torch.equal(gen.get_state(), reference.get_state())
