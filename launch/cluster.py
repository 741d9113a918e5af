"""Start the distributed runtime (Ray actors, torch.distributed link, gRPC frontend).

    python launch/cluster.py --help

The launcher lives in ssd/app/launcher.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.app.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
