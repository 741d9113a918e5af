"""Imported first by every launch script: puts the repository root on sys.path,
so `python launch/NAME.py` runs from a fresh clone without installing."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
