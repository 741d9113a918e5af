"""Talk to a running server (launch/serve.py, launch/cluster.py): generate, abort, model info, stats.

    python launch/client.py --help      # the same command as `ssd client`

The command lives in ssd/app/client.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.app.client import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
