"""Build and load the C kernels (qmatmul.c, attention.c, layer.c) with the system compiler, once per source and host.

The shared library is compiled into the cache (~/.cache/ssd/kernels, or
$SSD_KERNEL_CACHE) by `pip install` (setup.py runs `build`), else on first use,
and reused while the source is unchanged; `python -m ssd.models.kernels.build`
builds it by hand. This module uses the standard library only: setup.py loads it
by its path, in pip's build environment, where torch is absent. No flags tie the
library to the building CPU: the instruction set (AVX512-VNNI, AVX2 or portable
C) is chosen at run time from the host's, so a cache shared between hosts stays
correct. Where no compiler is found, `load` raises KernelUnavailable saying so,
and model.backend auto keeps llama.cpp.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("qmatmul.c", "attention.c", "layer.c")]
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]
OPENMP = "-fopenmp"  # torch's OpenMP threads (see qmatmul.c); without it, one thread a product
ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX512-VNNI"}
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("SSD_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "ssd" / "kernels"


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc, gcc or clang on PATH."""
    for name in [os.environ.get("CC"), "cc", "gcc", "clang"]:
        if name and shutil.which(name):
            return name
    return None


def library_path() -> Path:
    code = b"".join(source.read_bytes() for source in SOURCES)
    digest = hashlib.sha256(code + " ".join(FLAGS + [OPENMP]).encode()).hexdigest()[:16]
    return cache_dir() / f"qmatmul-{digest}.so"


def build() -> Path:
    """The compiled library's path, compiling it now if the cache lacks it."""
    path = library_path()
    if path.is_file():
        return path
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC, or install gcc or clang); "
                                "model.quantization gguf needs one to build its kernels once")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        sources = [str(source) for source in SOURCES]
        run = subprocess.run([cc, *FLAGS, OPENMP, "-o", str(partial), *sources, "-lm"], capture_output=True, text=True)
        if run.returncode != 0:  # a compiler without OpenMP (clang without libomp): one thread a product
            log.warning("%s could not build the kernels with OpenMP; building them single-threaded", cc)
            run = subprocess.run([cc, *FLAGS, "-o", str(partial), *sources, "-lm"], capture_output=True, text=True)
        if run.returncode != 0:
            raise KernelUnavailable(f"{cc} could not build {', '.join(s.name for s in SOURCES)}:\n{run.stderr.strip()}")
        partial.replace(path)  # atomic: concurrent builders each install a complete file
    finally:
        partial.unlink(missing_ok=True)
    log.info("built %s with %s", path, cc)
    return path


def load() -> ctypes.CDLL:
    """The kernel library, built if needed, with its functions' signatures declared."""
    global _LIB
    if _LIB is not None:  # every layer's forward asks: no lock once loaded
        return _LIB
    with _LOCK:
        if _LIB is None:
            _LIB = _declare(ctypes.CDLL(str(build())))
        return _LIB


def available() -> bool:
    try:
        load()
    except KernelUnavailable as exc:
        log.info("GGUF kernels unavailable: %s", exc)
        return False
    return True


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ssd_prepare_rows.argtypes = [p, i64, i64, i64, p, ctypes.c_float, p, p, p]
    lib.ssd_prepare_rows.restype = i32
    lib.ssd_matmul.argtypes = [p, i32, i64, i64, p, p, p, i64, p, i64, i32]
    lib.ssd_matmul.restype = None
    for name in ("ssd_set_isa", "ssd_block_bytes"):
        getattr(lib, name).argtypes = [i32]
        getattr(lib, name).restype = i32
    lib.ssd_best_isa.argtypes = []
    lib.ssd_best_isa.restype = i32
    lib.ssd_attention_supports.argtypes = [i32]
    lib.ssd_attention_supports.restype = i32
    lib.ssd_attend_rows.argtypes = [p, i64, i64, p, p, i64, i32, i32, i32, i64, i64, ctypes.c_float, p, i64, i32]
    lib.ssd_attend_rows.restype = i32
    lib.ssd_rope.argtypes = [p, i64, i32, i32, i64, p, p]
    lib.ssd_rope.restype = None
    lib.ssd_silu_mul.argtypes = [p, i64, i64, p]
    lib.ssd_silu_mul.restype = None
    lib.ssd_decoder_layer.argtypes = [p, p, i64, p, p, p, p, i32]
    lib.ssd_decoder_layer.restype = i32
    lib.ssd_decoder_layer_workspace.argtypes = [p, i64]
    lib.ssd_decoder_layer_workspace.restype = i64
    return lib


def main() -> int:
    try:
        path = build()
    except KernelUnavailable as exc:
        print(f"ssd: GGUF kernels not built: {exc}", file=sys.stderr)
        return 0  # optional: llama.cpp stays the CPU backend
    print(f"ssd: GGUF kernels at {path} ({ISA_NAMES[load().ssd_best_isa()]} on this host)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
