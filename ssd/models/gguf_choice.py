"""model.backend auto for a model that ships as a GGUF file, on a CPU: ssd's GGUF kernels or llama.cpp.

Both run the file's own quantized weights (ssd.models.kernels; ssd.models.llamacpp).
Which is faster depends on the host (the kernels' AVX512-VNNI, AVX2 or portable
path; llama.cpp's build), so a probe times both once: a forward of one token and
one of 8 tokens after a 128-token prefix, on one thread, interleaved, in a child
process (no model stays loaded here, and a kernel the CPU lacks kills the child,
not us), cached per file, host and code. The kernels are chosen where their
one-token forward is within KERNELS_STEP_SLACK of llama.cpp's: their extra rows
cost a fraction of llama.cpp's (docs/kernels.md), so verification, batched
decoding and tree drafting gain on top. Where only one of the two can run the
file, it is that one; where neither, None (torch's own precisions).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from ssd.hardware import heartbeat

log = logging.getLogger(__name__)

KERNELS, LLAMACPP = "kernels", "llamacpp"
KERNELS_STEP_SLACK = 1.05
PROBE_TIMEOUT_S = 600  # the first load of a file repacks it for the kernels (~30 s for 1.5B on one core)

# Loads `name` on both backends, feeds the same 128-token prefix, then times a forward of 1 and of
# 8 tokens on each, 5 interleaved rounds (medians), on one thread; prints the answer as JSON.
_CHILD = """
import json, statistics, sys, time
import torch
from ssd.config import ModelConfig
from ssd.models import load_model
from ssd.models.backend import ops_of

torch.set_num_threads(1)
name = sys.argv[1]
configs = {"kernels": dict(backend="torch", quantization="gguf"), "llamacpp": dict(backend="llamacpp")}
seqs = {}
for backend, fields in configs.items():
    model = load_model(ModelConfig(name=name, **fields))
    ops = ops_of(model)
    vocab = ops.vocab_size(model)
    seqs[backend] = ops.new_sequence(ops.sequence_source(model, rows=1, max_tokens=16, kv_tokens=512), 0)
    seqs[backend].forward([(7 * i + 3) % vocab for i in range(128)])
times = {b: {1: [], 8: []} for b in seqs}
for _ in range(5):
    for backend, seq in seqs.items():
        seq.forward([11 % vocab])  # untimed: the other backend left the caches cold
        seq.rollback(128)
        for n in (1, 8):
            started = time.perf_counter()
            seq.forward([(5 * i + 1) % vocab for i in range(n)])
            times[backend][n].append(time.perf_counter() - started)
            seq.rollback(128)
print(json.dumps({b: {str(n): statistics.median(t) * 1e3 for n, t in rows.items()} for b, rows in times.items()}))
"""


@functools.lru_cache(maxsize=None)
def choose(name: str, llamacpp: bool) -> str | None:
    """KERNELS or LLAMACPP for GGUF model `name` on this CPU (None: neither can run it);
    `llamacpp`: whether llama-cpp-python is installed."""
    kernels = kernels_can_run(name)
    if kernels and llamacpp:
        return probe(name)["choice"]
    return KERNELS if kernels else LLAMACPP if llamacpp else None


def kernels_can_run(name: str) -> bool:
    """Whether ssd's GGUF kernels build here and read `name`'s architecture."""
    from ssd.models.offline import OFFLINE_MODELS

    try:
        from ssd.models.kernels import build
        from ssd.models.kernels.gguf_model import ARCHITECTURES
    except ImportError:  # the gguf package is absent (a GPU image)
        return False
    if not build.available():
        return False
    if name in OFFLINE_MODELS:
        return True  # the offline pair: Qwen2.5 (qwen2)
    return _architecture(Path(name).expanduser()) in ARCHITECTURES


def _architecture(path: Path) -> str | None:
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
        return None if field is None else str(field.contents())
    except (OSError, ValueError, ImportError) as exc:
        log.info("%s: no GGUF architecture read (%s)", path, exc)
        return None


def probe(name: str) -> dict[str, Any]:
    """Both backends timed on `name` (see the module docstring) and the choice, cached."""
    def run() -> dict[str, Any]:
        what = f"{name}: the GGUF kernels and llama.cpp timed once in a child process (one thread)"
        log.info("%s, to choose model.backend auto", what)
        try:
            with heartbeat(log, what):
                done = subprocess.run([sys.executable, "-c", _CHILD, name], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s: the backend probe ran past %d s; llama.cpp", name, PROBE_TIMEOUT_S)
            return {"choice": LLAMACPP, "why": "probe timed out"}
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            log.warning("%s: the backend probe failed (exit %d: %s); llama.cpp", name, done.returncode, tail[0])
            return {"choice": LLAMACPP, "why": f"probe failed: {tail[0]}"}
        ms = json.loads(done.stdout.strip().splitlines()[-1])
        return {"choice": decide(ms), "ms": ms}

    found = _cached(name, run)
    if "ms" in found:
        k, l = found["ms"][KERNELS], found["ms"][LLAMACPP]
        log.info("%s on one thread, ms for 1 / 8 tokens: GGUF kernels %.1f / %.1f, llama.cpp %.1f / %.1f: "
                 "model.backend auto -> %s", name, k["1"], k["8"], l["1"], l["8"],
                 "torch on the GGUF kernels" if found["choice"] == KERNELS else "llama.cpp")
    return found


def decide(ms: dict[str, dict[str, float]]) -> str:
    """The kernels where their one-token forward is within KERNELS_STEP_SLACK of llama.cpp's."""
    return KERNELS if ms[KERNELS]["1"] <= KERNELS_STEP_SLACK * ms[LLAMACPP]["1"] else LLAMACPP


def _cached(name: str, compute) -> dict[str, Any]:
    """compute()'s result, kept per GGUF file, host (not its thread count: a cluster's actors
    read what its driver found), kernels' build, llama.cpp version and probe code."""
    import llama_cpp

    from ssd import hardware
    from ssd.models.kernels.build import library_path
    from ssd.models.offline import OFFLINE_MODELS, cache_dir, cached_json, ensure_offline_gguf

    gguf = ensure_offline_gguf(name) if name in OFFLINE_MODELS else Path(name).expanduser()
    stat = gguf.stat()
    host = {k: hardware.describe()[k] for k in ("cpu_model", "torch_cpu_capability", "cores")}  # not threads
    key = hashlib.sha256(repr((str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, host,
                               library_path().name, llama_cpp.__version__, _CHILD, KERNELS_STEP_SLACK)).encode())
    path = cache_dir() / "backend" / f"{gguf.stem}-{key.hexdigest()[:16]}.json"
    return cached_json(path, compute, keep=lambda found: "ms" in found)  # a failed probe: asked again next start
