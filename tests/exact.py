"""Exact target distributions of short continuations, by enumeration (ssd.tools.bench.exact)."""

from ssd.tools.bench.exact import exact_marginal

__all__ = ["exact_marginal"]
