"""Aggregate throughput of 1 vs N replicas at a fixed number of clients (tiny pair, CPU, by default).

    python launch/bench_replicas.py --help

The benchmark lives in ssd/tools/bench/replicas.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.replicas import main  # noqa: E402

if __name__ == "__main__":
    main()
