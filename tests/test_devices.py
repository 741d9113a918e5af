"""Device helpers of the hot path (ssd.hardware): timing a device's work and
moving small tensors between host and device. 'meta' stands in for an
accelerator where there is none; the CUDA checks run only where one is."""

import copy
import warnings

import pytest
import torch

from ssd.config import FanoutConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from ssd.engine import AREngine, SDEngine
from ssd.saguaro.target import SSDEngine
from ssd.engine.request import GenerationRequest
from ssd.hardware import sync, to_device, to_host
from ssd.sampling import make_generator, sample, sample_ids, sample_rows
from ssd.verify import verify

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_to_host_is_a_no_op_on_the_host():
    t = torch.arange(6.0).reshape(2, 3)
    assert to_host(t) is t


def test_to_device_on_the_same_device_is_a_no_op():
    t = torch.arange(6.0)
    assert to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t


def test_to_device_towards_a_device_queues_the_copy():
    out = to_device(torch.arange(6.0), "meta")
    assert out.device.type == "meta" and out.shape == (6,)


def test_to_device_towards_the_host_goes_through_to_host():
    with pytest.raises(RuntimeError, match="meta"):  # 'meta' has no data to copy out
        to_device(torch.empty(3, device="meta"), "cpu")


@pytest.mark.parametrize("where", [None, "cpu", torch.device("meta"), torch.zeros(2), torch.empty(2, device="meta")])
def test_sync_is_a_no_op_off_cuda(where):
    sync(where)


@CUDA
def test_to_host_copies_a_cuda_tensor_into_pinned_memory():
    t = torch.randn(4, 1000, dtype=torch.float64, device="cuda")
    out = to_host(t)
    assert out.device.type == "cpu" and out.is_pinned() and torch.equal(out, t.cpu())
    strided = t[:, ::7]  # non-contiguous rows land contiguous
    assert torch.equal(to_host(strided), strided.cpu())


@CUDA
def test_to_device_round_trip_and_sync():
    t = torch.randn(3, 5, dtype=torch.float64)
    on_gpu = to_device(t, "cuda")
    sync(on_gpu)
    assert on_gpu.device.type == "cuda" and torch.equal(to_device(on_gpu, "cpu"), t)


# --- the hot path on a CUDA device (run where one is) ---------------------------------

def rows(n, v, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 1.5, -1).to(device)


@CUDA
def test_cuda_sampling_draws_what_the_host_draws():
    probs = rows(16, 1000, 0)
    assert torch.equal(sample_ids(probs.cuda(), make_generator(3)).cpu(), sample_ids(probs, make_generator(3)))
    assert sample_rows(probs.cuda(), make_generator(4)) == sample_rows(probs, make_generator(4))
    assert sample(probs[0].cuda(), make_generator(5)) == sample(probs[0], make_generator(5))


@CUDA
def test_cuda_verification_equals_the_hosts():
    for case in range(40):
        q, p = rows(4, 50, case), rows(5, 50, 100 + case)
        p[:4] = 0.7 * q + 0.3 * p[:4]
        gen = make_generator(case)
        drafted = [sample(r, gen) for r in q]
        host = verify(drafted, q, p, make_generator(case))
        assert verify(drafted, q.cuda(), p.cuda(), make_generator(case)) == host
        assert verify(drafted, None, p.cuda(), make_generator(case), greedy=True) == verify(drafted, None, p, None, greedy=True)


@CUDA
def test_cuda_verification_refuses_a_host_q():
    with pytest.raises(ValueError, match=r"q is on cpu but p is on cuda:0; move q to p's device"):
        verify([1, 2], rows(2, 10, 0), rows(3, 10, 1, "cuda"), make_generator(0))


@CUDA
@pytest.mark.parametrize("where", ["both", "target", "draft"])
def test_engines_on_cuda_give_the_hosts_output(tiny_models, tiny_tokenizer, where):
    """AR, SD and SSD (both decoders) with the models on a GPU, or split between a GPU and
    the host (q crossing in either direction): greedy and seeded sampled output equal the host's."""
    target, draft = tiny_models
    t_dev = copy.deepcopy(target).cuda() if where in ("both", "target") else target
    d_dev = copy.deepcopy(draft).cuda() if where in ("both", "draft") else draft

    def request(sampling):
        return GenerationRequest([1, 2, 3], sampling, GenerationConfig(max_new_tokens=24))

    cases = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, seed=7),
             SamplingConfig(temperature=0.7, top_k=5, seed=8), SamplingConfig(temperature=1.0, seed=9, coupling="gumbel")]
    for sampling in cases:
        ar_host = AREngine(target, tiny_tokenizer).generate(request(sampling)).token_ids
        assert AREngine(t_dev, tiny_tokenizer).generate(request(sampling)).token_ids == ar_host
        sd_host = SDEngine(target, draft, tiny_tokenizer, SpeculationConfig(mode="sd", k=3)).generate(request(sampling)).token_ids
        sd_dev = SDEngine(t_dev, d_dev, tiny_tokenizer, SpeculationConfig(mode="sd", k=3)).generate(request(sampling))
        assert sd_dev.token_ids == sd_host and sd_dev.stats.target_s > 0
        # A standard-sampled SSD row's draws follow its hits and misses, and an anytime build's cut
        # follows the clock (docs/exactness.md): builds that run whole make its seeded output a
        # function of the seed alone. Greedy and coupled output depend on neither.
        anytime = sampling.greedy or sampling.coupled
        for decoder in ("tree", "batched"):
            spec = SpeculationConfig(mode="ssd", k=3, fanout=FanoutConfig(budget=8, anytime=anytime), branch_decoder=decoder)
            with SSDEngine.in_process(target, draft, tiny_tokenizer, spec) as ssd:
                ssd_host = ssd.generate(request(sampling)).token_ids
            with SSDEngine.in_process(t_dev, d_dev, tiny_tokenizer, spec) as ssd:
                out = ssd.generate(request(sampling))
            assert out.token_ids == ssd_host, (sampling, decoder)
            assert out.stats.spec.lookups > 0
        if sampling.greedy or sampling.coupled:
            assert sd_host == ar_host == ssd_host


@CUDA
@pytest.mark.parametrize("k", [1, 4, 8])
def test_cuda_verification_waits_for_the_device_twice_at_most(k):
    """Host syncs per verification: the stopping position and the drawn token
    (greedy: the argmaxes alone), whatever K; the loop it replaced read two
    floats per reached position."""
    q, p = rows(k, 32000, k, "cuda"), rows(k + 1, 32000, 50 + k, "cuda")
    p[:k] = q  # every position accepts: the old loop's worst case
    gen = make_generator(0)
    drafted = [sample(r, gen) for r in q]
    torch.cuda.synchronize()
    counts = []
    for greedy in (False, True):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                verify(drafted, q, p, gen, greedy=greedy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts == [2, 1]
