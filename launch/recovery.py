"""Recovery times through the cluster when a role is killed (tiny pair, CPU cores as devices).

    python launch/recovery.py --trials 3
    python launch/recovery.py --help

The measurement lives in ssd/tools/bench/recovery.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.recovery import main  # noqa: E402

if __name__ == "__main__":
    main()
