"""Speed and quality of each target precision on this host.

    python launch/precision.py --help

The measurement lives in ssd/tools/bench/precision.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.precision import main  # noqa: E402

if __name__ == "__main__":
    main()
