"""Start the distributed runtime (Ray actors, torch.distributed link, gRPC frontend).

    python launch/cluster.py --help

The launcher lives in ssd/cluster/launcher.py.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a fresh clone without installing
    sys.path.insert(0, str(ROOT))

from ssd.cluster.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
