"""SSD ablations from recorded traces (record, costs, sweep, fit, plan, compare, backups).

    python launch/ablate.py --help

The commands live in ssd/ablation/cli.py.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from ssd.ablation.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
