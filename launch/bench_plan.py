"""Check SSD's start-up plan: the cluster with no flags against SD, AR and an SSD (K, budget) grid.

    python launch/bench_plan.py --help

The check lives in ssd/tools/bench/plan_check.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.plan_check import main  # noqa: E402

if __name__ == "__main__":
    main()
