import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd.config import ConfigError, SamplingConfig
from ssd.saguaro.sampling import saguaro_rescale_rows
from ssd.sampling import Bias, greedy_token, make_generator, probs_from_logits, sample, sample_ids, sample_rows, uniforms
from tests.stats import ALPHA, chi_square_pvalue

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_is_one_hot_on_argmax():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_greedy_ties_go_to_lowest_id():
    probs = probs_from_logits(torch.tensor([0.0, 3.0, 3.0]), SamplingConfig())
    assert probs.tolist() == [0.0, 1.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans(), st.integers(2, 40))
def test_a_plain_steps_greedy_token_is_the_pipelines(seed, with_bias, vocab):
    """greedy_token (an argmax, no row, no draw) == sampling the pipeline's one-hot row:
    float32 logits with ties (values on a coarse grid), an additive float64 bias with -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (vocab,), generator=gen).float() / 2
    bias = None
    if with_bias:
        bias = torch.randint(-2, 3, (vocab,), generator=gen).double() / 3
        bias[torch.rand(vocab, generator=gen) < 0.3] = float("-inf")
        bias = Bias(bias)
    greedy = SamplingConfig(temperature=0.0)
    assert greedy_token(logits, bias) == sample(probs_from_logits(logits, greedy, bias), make_generator(seed))


def test_temperature_scales_logits():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(LOGITS.double() / 0.5, -1))


def test_top_k_keeps_k_most_likely():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.softmax(LOGITS[:2].double(), -1)
    torch.testing.assert_close(probs[:2], expected)
    assert probs[2:].sum() == 0


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(LOGITS.double(), -1)
    top_p = float(full[:2].sum()) + 1e-6  # needs the third token to pass p
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_p=top_p))
    assert (probs[:3] > 0).all() and probs[3:].sum() == 0
    torch.testing.assert_close(probs[:3], full[:3] / full[:3].sum())


def test_top_p_always_keeps_the_most_likely_token():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_p=1e-9))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_keeps_the_tokens_within_its_share_of_the_likeliest(temperature):
    """vLLM's min-p: p >= min_p * max p on the tempered law, renormalised; just under a
    token's ratio keeps it, just over drops it."""
    full = torch.softmax(LOGITS.double() / temperature, -1)
    ratio = float(full[2] / full[0])
    for min_p, kept in ((ratio * (1 - 1e-9), 3), (ratio * (1 + 1e-9), 2)):
        probs = probs_from_logits(LOGITS, SamplingConfig(temperature=temperature, min_p=min_p))
        assert (probs[:kept] > 0).all() and probs[kept:].sum() == 0
        torch.testing.assert_close(probs[:kept], full[:kept] / full[:kept].sum())


def test_min_p_one_keeps_the_ties_of_the_likeliest_and_greedy_ignores_it():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.9])
    probs = probs_from_logits(logits, SamplingConfig(temperature=1.0, min_p=1.0))
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert probs_from_logits(logits, SamplingConfig(min_p=1.0)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_min_p_comes_before_top_p():
    """vLLM's order: top-p reads the mass min-p left. Here min-p drops tokens 2-5, so top-p
    0.6 keeps token 0 alone; on the unfiltered law (mass 0.54 at token 0) it needs token 1 too."""
    full = torch.softmax(LOGITS.double(), -1)
    assert float(full[0]) < 0.6 < float(full[0] / full[:2].sum())
    both = SamplingConfig(temperature=1.0, min_p=float(full[1] / full[0]) * 0.99, top_p=0.6)
    assert probs_from_logits(LOGITS, both).tolist() == [1.0, 0, 0, 0, 0, 0]


def test_rows_are_processed_independently():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = probs_from_logits(batch, SamplingConfig(temperature=1.0, top_k=3))
    assert probs[0, :3].sum() == pytest.approx(1) and probs[1, 3:].sum() == pytest.approx(1)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=float("nan"))])
def test_invalid_sampling_params_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingConfig(**bad)


def test_sample_never_returns_zero_mass_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float64)
    gen = make_generator(0)
    assert {sample(probs, gen) for _ in range(500)} == {1, 3}


def test_same_seed_same_draws():
    probs = torch.softmax(LOGITS.double(), -1)
    a = [sample(probs, make_generator(7)) for _ in range(3)]
    b = [sample(probs, make_generator(7)) for _ in range(3)]
    assert a == b


def test_sample_matches_distribution():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=0.8))
    gen = make_generator(1)
    draws = [sample(probs, gen) for _ in range(4000)]
    assert chi_square_pvalue(draws, dict(enumerate(probs.tolist()))) > ALPHA


def test_sample_distribution_test_has_power():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=0.8))
    wrong = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0))
    gen = make_generator(1)
    draws = [sample(wrong, gen) for _ in range(4000)]
    assert chi_square_pvalue(draws, dict(enumerate(probs.tolist()))) < ALPHA


def test_sample_rows_matches_each_row_distribution():
    probs = probs_from_logits(torch.stack([LOGITS, LOGITS.flip(0)]), SamplingConfig(temperature=0.8))
    gen = make_generator(4)
    draws = [sample_rows(probs, gen) for _ in range(3000)]
    for row in range(2):
        column = [d[row] for d in draws]
        assert chi_square_pvalue(column, dict(enumerate(probs[row].tolist()))) > ALPHA


def test_sample_rows_skips_zero_mass_tokens():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], dtype=torch.float64)
    gen = make_generator(0)
    seen = {tuple(sample_rows(probs, gen)) for _ in range(200)}
    assert {d[0] for d in seen} == {1} and {d[1] for d in seen} == {0, 2}


def test_saguaro_rescale_rows_scales_each_rows_top_f():
    q = torch.softmax(torch.stack([LOGITS, LOGITS.flip(0)]).double(), -1)
    out = saguaro_rescale_rows(q, 2, 0.5)
    for row in range(2):
        top = torch.topk(q[row], 2).indices
        expected = q[row].clone()
        expected[top] *= 0.5
        torch.testing.assert_close(out[row], expected / expected.sum())


def test_saguaro_c_one_is_identity_and_c_zero_keeps_an_all_top_row():
    q = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    assert torch.equal(saguaro_rescale_rows(q, 2, 1.0), q)
    out = saguaro_rescale_rows(q, 2, 0.0)
    torch.testing.assert_close(out[0], q[0])  # all mass on the top-2: nothing left to move to
    torch.testing.assert_close(out[1], torch.tensor([0, 0, 2 / 3, 1 / 3], dtype=torch.float64))


# --- devices: uniforms from the CPU generator, the inverse CDF where the probabilities are ---

def test_sample_ids_are_inverse_cdf_of_cpu_uniforms():
    probs = probs_from_logits(torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.3]), SamplingConfig(temperature=0.8))
    gen, reference = make_generator(5), make_generator(5)
    for _ in range(50):
        u = torch.rand(3, generator=reference, dtype=torch.float64)
        cdf = torch.cumsum(probs, -1)
        expected = [int(torch.searchsorted(cdf[b], u[b] * cdf[b, -1], right=True)) for b in range(3)]
        assert sample_ids(probs, gen).tolist() == expected
    assert torch.equal(gen.get_state(), reference.get_state())


def test_sample_and_sample_rows_read_the_same_ids_as_sample_ids():
    probs = probs_from_logits(torch.stack([LOGITS, LOGITS.flip(0)]), SamplingConfig(temperature=0.8))
    assert sample_rows(probs, make_generator(3)) == sample_ids(probs, make_generator(3)).tolist()
    assert sample(probs[1], make_generator(3)) == int(sample_ids(probs[1], make_generator(3)))


@pytest.mark.parametrize("shape", [(6,), (4, 6)])
def test_sampling_runs_on_the_probs_device_with_cpu_uniforms(shape):
    """'meta' stands in for an accelerator: the ids stay there; the generator
    (CPU) advances exactly as it does for host probabilities."""
    probs = torch.empty(shape, dtype=torch.float64, device="meta")
    gen, reference = make_generator(0), make_generator(0)
    ids = sample_ids(probs, gen)
    assert ids.device.type == "meta" and ids.shape == shape[:-1]
    uniforms(reference, shape[:-1])
    assert torch.equal(gen.get_state(), reference.get_state())


def test_sample_reads_the_host_only_for_the_id():
    """On a device the only failing step for 'meta' is the final host read (no device mismatch before)."""
    probs = torch.empty(6, dtype=torch.float64, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        sample(probs, make_generator(0))
    with pytest.raises(RuntimeError, match="meta"):  # NotImplementedError is one
        sample_rows(probs.expand(2, 6), make_generator(0))


def test_float64_uniforms_are_multiples_of_2_to_the_minus_53():
    """What sample_ids relies on: u = r * total, rounded, stays below the total."""
    r = uniforms(make_generator(0), 100_000)
    assert torch.equal(r * 2.0**53, torch.floor(r * 2.0**53)) and float(r.max()) < 1.0


@settings(max_examples=300, deadline=None)
@given(st.floats(1e-300, 1e300))
def test_the_largest_uniform_times_any_total_stays_below_it(total):
    assert (1.0 - 2.0**-53) * total < total


def test_the_largest_uniform_takes_the_last_live_token(monkeypatch):
    largest = 1.0 - 2.0**-53
    monkeypatch.setattr("ssd.sampling.uniforms", lambda gen, shape=(): torch.full(shape, largest, dtype=torch.float64))
    probs = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert sample_rows(probs, make_generator(0)) == [2, 1]
    assert sample(probs[0] * 3, make_generator(0)) == 2


def test_a_row_without_mass_is_refused():
    with pytest.raises(ValueError, match="probability mass"):
        sample(torch.zeros(4, dtype=torch.float64), make_generator(0))


def test_tiny_temperatures_approach_greedy_instead_of_overflowing():
    """logits / 1e-310 overflowed to inf and softmax gave nan (the last id, repeated)."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.9], [1.0, 7.0, 7.0, -1.0]], dtype=torch.float64)
    for t in (1e-6, 1e-300, 1e-310, 5e-324):
        probs = probs_from_logits(logits, SamplingConfig(temperature=t))
        assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))
        assert torch.equal(probs[1], torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64))  # exact ties share
