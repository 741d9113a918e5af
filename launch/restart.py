"""Load times of the int8 pair with and without the int8 cache (ssd.models.qcache), in one process.

    python launch/restart.py --json docs/results/restart.json
    python launch/restart.py --help

The measurement lives in ssd/tools/bench/restart.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.restart import main  # noqa: E402

if __name__ == "__main__":
    main()
