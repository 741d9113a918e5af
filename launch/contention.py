"""How much the two SSD roles slow each other when they share a machine.

    python launch/contention.py --help

The measurement lives in ssd/ablation/contention.py.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from ssd.ablation.contention import main  # noqa: E402

if __name__ == "__main__":
    main()
