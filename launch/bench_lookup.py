"""What prompt lookup buys the target alone on this host: AR against AR whose rounds verify
what the text so far predicts (speculation.prompt_lookup), one request at a time, interleaved.

    python launch/bench_lookup.py --help

The benchmark lives in ssd/tools/bench/lookup.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.lookup import main  # noqa: E402

if __name__ == "__main__":
    main()
