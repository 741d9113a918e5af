"""Chi-square goodness of fit for the distribution tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping

from scipy import stats

ALPHA = 0.001


def chi_square_pvalue(samples: list[Hashable], expected: Mapping[Hashable, float]) -> float:
    """p-value of `samples` against the exact probabilities `expected`.

    Cells with an expected count below 5 are pooled into one cell, so the
    chi-square approximation holds. A sample outside the support of `expected`
    fails the test outright (p-value 0).
    """
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(x, 0.0) <= 0.0 for x in counts):
        return 0.0
    observed, predicted = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for cell, prob in expected.items():
        if n * prob >= 5:
            observed.append(counts.get(cell, 0))
            predicted.append(n * prob)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += n * prob
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    if len(observed) < 2:
        raise ValueError("too few cells for a chi-square test; draw more samples")
    scale = sum(observed) / sum(predicted)  # absorbs float drift in `expected`
    return float(stats.chisquare(observed, [e * scale for e in predicted]).pvalue)


def report_pvalue(path: str, setting: str, variant: str, samples: int, pvalue: float) -> None:
    """One row of the p-value table: `pytest -s | grep '^| '` collects them."""
    print(f"\n| {path} | {setting} | {variant} | {samples} | {pvalue:.1e} |")
