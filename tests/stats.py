"""Chi-square goodness of fit for the distribution tests."""

from __future__ import annotations

from ssd.tools.bench.exact import chi_square_pvalue

__all__ = ["ALPHA", "chi_square_pvalue", "report_pvalue"]

ALPHA = 0.001


def report_pvalue(path: str, setting: str, variant: str, samples: int, pvalue: float) -> None:
    """One row of the p-value table: `pytest -s | grep '^| '` collects them."""
    print(f"\n| {path} | {setting} | {variant} | {samples} | {pvalue:.1e} |")
