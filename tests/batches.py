"""Running requests together on one engine, for tests that compare rows with each alone."""

from __future__ import annotations


def run_together(engine, requests, what=lambda result: result):
    """Admit every request before the first step, step until all left; `what` of each one's
    result, in order (a row's error fails the test)."""
    for request in requests:
        engine.admit(request)
    out = {}
    while engine.rows:
        for finished in engine.step():
            assert finished.error is None, finished.error
            out[id(finished.request)] = what(finished.result)
    return [out[id(r)] for r in requests]
