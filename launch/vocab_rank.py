"""Token frequencies on the project's own text -> the draft's vocabulary ranking (FR-Spec).

    python launch/vocab_rank.py
    python launch/vocab_rank.py --sources 'docs/*.md' --out ranking.json

The command lives in ssd/tools/ablation/vocab.py.
"""

import _bootstrap  # noqa: F401 - first: the repository root on sys.path

from ssd.tools.ablation.vocab import main  # noqa: E402

if __name__ == "__main__":
    main()
