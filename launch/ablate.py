"""SSD ablations from recorded traces (record, costs, sweep, fit, plan, compare, backups).

    python launch/ablate.py --help

The commands live in ssd/tools/ablation/cli.py.
"""


import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
