"""How much the two SSD roles slow each other when they share a machine.

    python launch/contention.py --help

The measurement lives in ssd/tools/ablation/contention.py.
"""


import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.contention import main  # noqa: E402

if __name__ == "__main__":
    main()
