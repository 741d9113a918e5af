"""Measure batched SD here and print the K-by-batch-size policy (speculation.k_policy)
that gives it the most tokens per second.

    python launch/calibrate.py --help

The calibration lives in ssd/tools/ablation/calibrate.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.calibrate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
