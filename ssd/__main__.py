"""`python -m ssd COMMAND ...`: the `ssd` console command without installing (ssd/main.py)."""

import sys

from ssd.main import main

if __name__ == "__main__":
    sys.exit(main())
