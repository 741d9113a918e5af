"""A quiet machine for timings: which other processes keep a core busy, a wait until none
does, and a background watch of the cores they take while something is measured.

Other engineers benchmark on the same 2-core machines: a timing taken beside them is
inflated, and the tables say so (launch/bench_branches.py).
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def _cpu_ticks() -> dict[int, tuple[int, str]]:
    """pid -> (user + system clock ticks, command line) for every readable process."""
    ticks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        ticks[int(entry.name)] = (int(fields[11]) + int(fields[12]), cmd.strip())
    return ticks


def busy_processes(interval: float = 2.0, threshold: float = 0.3) -> list[tuple[float, int, str]]:
    """Other processes using more than `threshold` of a core over `interval` seconds.

    Measured over an interval: ps's %CPU is a lifetime average and still shows
    a finished burst as busy.
    """
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks()
    time.sleep(interval)
    after = _cpu_ticks()
    busy = []
    for pid, (ticks, cmd) in after.items():
        if pid == os.getpid() or pid not in before:
            continue
        share = (ticks - before[pid][0]) / hz / interval
        if share > threshold:
            busy.append((share, pid, cmd[:120]))
    return sorted(busy, reverse=True)


def wait_for_quiet(max_wait: float) -> bool:
    """Wait (up to max_wait s) until no other process keeps a core busy; True if quiet."""
    top = subprocess.run(["ps", "aux", "--sort=-%cpu"], capture_output=True, text=True).stdout
    logger.info("ps aux --sort=-%%cpu | head:\n%s", "\n".join(line[:160] for line in top.splitlines()[:10]))
    deadline = time.monotonic() + max_wait
    while busy := busy_processes():
        if time.monotonic() > deadline:
            logger.warning("machine still busy after %.0f s: %s", max_wait, busy)
            return False
        logger.info("waiting for a quiet machine: %s", busy)
        time.sleep(10)
    return True


class CpuWatch:
    """Samples, in a background thread, how many cores other processes keep busy."""

    def __init__(self, interval: float = 1.0) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, cores used by others)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            busy = busy_processes(interval, threshold=0.05)
            self.samples.append((time.monotonic(), sum(share for share, _, _ in busy)))

    def load_since(self, since: float) -> float:
        """Mean cores used by others in the samples taken after `since` (waits for one)."""
        while not (loads := [load for t, load in self.samples if t >= since]):
            if not self._thread.is_alive():
                return float("nan")
            time.sleep(0.1)
        return statistics.mean(loads)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
