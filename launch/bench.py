"""AR, SD, SSD and HF assisted generation side by side, or the serving benchmark (--concurrency).

    python launch/bench.py --help

The benchmark lives in ssd/tools/bench/cli.py.
"""


import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
