"""One generation with the configured pair; prints the text and the stats.

    python launch/generate.py --help      # the same command as `ssd generate`

The command lives in ssd/app/generate.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.app.generate import main  # noqa: E402

if __name__ == "__main__":
    main()
