"""The paper's regime on one GPU: AR / SD / SSD at Qwen2.5-32B's shapes, random bf16 weights.

    python launch/gpu_bench.py --out docs/results/gpu/bench              # CUDA, ~3 minutes
    python launch/gpu_bench.py --device cpu --shapes tiny --out /tmp/b   # CPU, seconds
    python launch/gpu_bench.py --help

The run lives in ssd/tools/bench/gpu_bench.py (its flags) and ssd/tools/bench/regime.py.
"""

import sys
import time

STARTED = time.monotonic()  # before the imports: --deadline-s counts them

import _bootstrap  # noqa: F401,E402 - the repository root on sys.path

from ssd.tools.bench.gpu_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED))
