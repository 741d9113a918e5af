"""One busy process beside a benchmark: robustness measured, not assumed.

A shared host always runs something else. A single busy process matters
more than its share here: Ray starts actors at nice 15 (ssd.cluster.runtime
now starts them at the driver's priority), and two torch threads under
OpenMP's default spin-wait can lose most of their speed to one background
process (measured 112 small int8 matmuls: 28 ms on one thread, 901 ms on
two). `busy_background` runs a pure-Python busy loop at nice 19 for the
length of a `with` block, the lightest load a host ever has.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True:\n    pass\n"
BACKGROUND_NICENESS = 19


@contextlib.contextmanager
def busy_background(enabled: bool = True, niceness: int = BACKGROUND_NICENESS) -> Iterator[int | None]:
    """Inside the block, one process at `niceness` spins on a core; yields its pid (None: disabled)."""
    if not enabled:
        yield None
        return
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.nice(niceness))
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait(timeout=30)


def describe(enabled: bool) -> str:
    """The line every table carries: which condition its rows were measured under."""
    return f"background load: one busy process at nice {BACKGROUND_NICENESS}" if enabled else "background load: none"
