"""Coupled (Gumbel) against standard sampling in SSD: acceptance, cache hit rate, tokens/s.

    python launch/ablate_coupling.py --help

The study lives in ssd/tools/ablation/coupling.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.coupling import main  # noqa: E402

if __name__ == "__main__":
    main()
