"""AR, SD, SSD and HF assisted generation side by side, or the serving benchmark (--concurrency).

    python launch/bench.py --help

The benchmark lives in ssd/bench/cli.py.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from ssd.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
