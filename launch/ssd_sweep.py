"""SSD cache behaviour across fan-out schedules, temperatures and Saguaro C (live, in process).

    python launch/ssd_sweep.py                                 # default pair, K=4, B=16
    python launch/ssd_sweep.py --help

The sweep lives in ssd/tools/ablation/cache_sweep.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.cache_sweep import main  # noqa: E402

if __name__ == "__main__":
    main()
