"""Plain-text tables, CSV and JSON for the ablation results (launch/ablate.py prints these)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

# (row key, header, format)
Column = tuple[str, str, str]

REPLAY_COLUMNS: list[Column] = [
    ("kind", "fanout", "<10"), ("k", "K", ">3"), ("budget", "B", ">4"), ("c", "C", ">5.2f"),
    ("hit_rate", "hit rate", ">8.3f"), ("acceptance_rate", "accept", ">7.3f"),
    ("tokens_per_round", "tok/round", ">9.2f"), ("tokens_per_round_after_hit", "after hit", ">9.2f"),
    ("tokens_per_round_after_miss", "after miss", ">10.2f"), ("lookups", "lookups", ">8"),
]
SPEED_COLUMNS: list[Column] = [
    ("tokens_per_s", "tok/s", ">8.2f"), ("speedup_vs_ar", "vs AR", ">6.2f"), ("speedup_vs_sd", "vs SD", ">6.2f"),
]


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """Aligned text table; columns missing from every row are left out."""
    cols = [c for c in columns if any(c[0] in r for r in rows)]
    widths = [max(len(h), _width(f)) for _, h, f in cols]
    lines = [" ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, ((_, h, _), w) in enumerate(zip(cols, widths)))]
    for r in rows:
        cells = []
        for (key, _, fmt), w in zip(cols, widths):
            value = r.get(key)
            text = "-" if value is None else format(value, fmt)
            cells.append(text.ljust(w) if fmt.startswith("<") else text.rjust(w))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _width(fmt: str) -> int:
    digits = "".join(ch for ch in fmt.split(".")[0] if ch.isdigit())
    return int(digits) if digits else 0


def write_json(data: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable))
    return path


def write_csv(rows: Sequence[dict], path: Path) -> Path:
    """One CSV of all rows; nested values (hit rate by k) are written as JSON text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
