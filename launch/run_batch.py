"""Run a file of OpenAI batch requests through the configured pair, with no port to serve.

    python launch/run_batch.py --help      # the same command as `ssd run-batch`

The command lives in ssd/app/run_batch.py.
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.app.run_batch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
