"""What machine a figure came from: CPU model, torch's CPU capability, native bf16.
And the few device helpers the hot path needs: timing a device's work
(`sync`) and moving small tensors between host and device (`to_host`,
`to_device`). And `heartbeat`: a line every few seconds from a start-up step
that takes long on a slow or busy host (probes, the plan), so it never looks hung.

Machines of one kind differ in CPU, and the fastest precision differs with
them (bf16 matmuls are native on AMX / AVX512-BF16 cores and emulated, about
4x slower for multi-token forwards, on AVX2-only ones). Every benchmark
result records `describe()`, and the "auto" precision reads `native_bf16()`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

HEARTBEAT_S = 5.0  # the longest a start-up step stays silent (the first run's bar: a line every 10 s)

# cpuinfo flags (x86) and Features (arm64) that mean bf16 matmuls run natively.
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
_VNNI_FLAGS = {"avx512_vnni", "avx_vnni"}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware."""
    return bool(cpu_flags() & _BF16_FLAGS)


def int8_dot_product() -> bool:
    """Whether this x86 CPU sums u8 x s8 products in 32 bits in one instruction (VNNI):
    then full 8-bit activations cannot saturate an int16 intermediate."""
    return bool(cpu_flags() & _VNNI_FLAGS)


def describe() -> dict[str, Any]:
    """The facts a benchmark row needs to be compared with another machine's."""
    return {
        "cpu_model": cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(),
        "int8_dot_product": int8_dot_product(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


@contextlib.contextmanager
def heartbeat(logger: logging.Logger, what: str, every_s: float | None = None) -> Iterator[None]:
    """Log "<what>: <N> s so far" every `every_s` seconds (default HEARTBEAT_S) while the block
    runs. Start-up probes take seconds on a quiet host and minutes on a busy one; a line that
    says what is running and for how long tells a newcomer it is not hung."""
    every_s = HEARTBEAT_S if every_s is None else every_s
    done = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            logger.info("%s: %.0f s so far", what, time.perf_counter() - started)

    thread = threading.Thread(target=beat, name="ssd-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def summary() -> str:
    """One line for logs and report headers."""
    d = describe()
    bf16 = "native bf16" if d["native_bf16"] else "no native bf16"
    gpus = f", GPUs: {', '.join(d['cuda_devices'])}" if d["cuda_devices"] else ""
    return f"{d['cpu_model']} ({d['cores']} cores, torch CPU capability {d['torch_cpu_capability']}, {bf16}){gpus}"


def uptime() -> str:
    """`uptime`'s line (how busy the host is, for the record with any figure), or the load average."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --- devices ---------------------------------------------------------------------


def sync(where: torch.Tensor | torch.device | str | None) -> None:
    """Wait until the calling thread's current stream on `where`'s device (a tensor's, or a
    device) has run its queued work.

    A host timer read after this covers the caller's device work, not only its
    launch. The current stream, not the whole device: SSD in one process runs
    the draft on a stream of its own beside the target (ssd.saguaro.host), and
    a device-wide wait in either role would wait for the other's work too and
    undo the overlap. Where every role uses the default stream the two are the
    same. A no-op off CUDA (the CPU runs eagerly).
    """
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where or "cpu")
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory. A CUDA tensor goes through a pinned buffer with one
    non-blocking copy and one wait for it; a host tensor is returned as is."""
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()  # the copy must land before the host reads it
    return out


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. Towards a device the copy is queued (non-blocking: the
    device's later work is ordered after it); towards the host it is `to_host`."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cpu":
        return to_host(t)
    return t.to(device, non_blocking=True)
