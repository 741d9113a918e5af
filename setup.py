"""Packaging is in pyproject.toml; this file only builds the GGUF kernels during `pip install`.

`pip install -e '.[models]'` (the README's install command) then compiles
ssd/models/kernels/*.c (qmatmul.c, attention.c, layer.c) with the system C compiler into the kernels' cache
(~/.cache/ssd/kernels, or $SSD_KERNEL_CACHE), so the first `model.quantization:
gguf` load does not wait ~8 s for it. The builder is loaded by its path: it uses
the standard library only (pip builds in an environment without torch). Without a
compiler the install goes on and says so; the kernels build on first use, or stay
unavailable (llama.cpp is the CPU backend then).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup


def build_kernels() -> None:
    path = Path(__file__).resolve().parent / "ssd" / "models" / "kernels" / "build.py"
    try:
        spec = importlib.util.spec_from_file_location("_ssd_kernel_build", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(f"ssd: GGUF kernels built at {module.build()}", file=sys.stderr)
    except Exception as exc:  # never fails the install: the kernels are optional
        print(f"ssd: GGUF kernels not built now ({exc}); they build on first use", file=sys.stderr)


build_kernels()
setup()
