"""Benchmark branch decoding on the real draft: tree mask vs batched KV cache.

    python launch/bench_branches.py --help

The benchmark lives in ssd/tools/bench/branches.py (the quiet-machine wait: ssd/tools/bench/quiet.py).
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.branches import main  # noqa: E402

if __name__ == "__main__":
    main()
