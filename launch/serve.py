"""Serve the configured pair over gRPC and, with --http-port, the OpenAI-compatible HTTP API.

    python launch/serve.py --help      # the same command as `ssd serve`

The command lives in ssd/app/serve.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.app.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
