"""Exact target distributions of short continuations, by enumeration (ssd.tools.bench.exact)."""

from ssd.tools.bench.exact import exact_marginal, exact_marginal_stepwise

__all__ = ["exact_marginal", "exact_marginal_stepwise"]
