"""The real model pair on the llama.cpp backend: loading, batch invariance, greedy exactness, speed.

    python launch/bench_llamacpp.py --help

The benchmark lives in ssd/tools/bench/llamacpp_pair.py (the llama.cpp peer and the
GGUF tokenizer it uses: ssd/tools/bench/llamacpp.py).
"""

import sys

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.bench.llamacpp_pair import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
