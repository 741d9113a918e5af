"""GPU smoke run: exactness and costs on one device, without Ray, a hub or a package registry.

    python launch/gpu_smoke.py --out results/smoke                 # CUDA if present, real shapes
    python launch/gpu_smoke.py --device cpu --shapes small --out /tmp/smoke   # CPU, seconds
    python launch/gpu_smoke.py --help

The run lives in ssd/tools/bench/gpu_smoke.py (its flags) and ssd/tools/bench/smoke.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.gpu_smoke import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
