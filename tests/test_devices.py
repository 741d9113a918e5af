"""Device helpers of the hot path (ssd.hardware): timing a device's work and
moving small tensors between host and device. 'meta' stands in for an
accelerator where there is none; the CUDA checks run only where one is."""

import pytest
import torch

from ssd.hardware import sync, to_device, to_host

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
