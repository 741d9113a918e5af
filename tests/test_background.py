"""The bench's background load: one busy process at nice 19, gone when the block ends."""

import time

import psutil

from ssd.bench.background import BACKGROUND_NICENESS, busy_background, describe


def test_busy_background_spins_at_nice_19_and_is_gone_after():
    with busy_background() as pid:
        process = psutil.Process(pid)
        assert process.nice() == BACKGROUND_NICENESS
        busy = process.cpu_times()
        time.sleep(0.3)
        spent = sum(process.cpu_times()[:2]) - sum(busy[:2])
        assert spent > 0.01, spent  # it spins (some CPU even on a loaded machine, where nice 19 gets little)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "nice 19" in describe(True) and describe(False) == "background load: none"


def test_disabled_background_starts_nothing():
    with busy_background(enabled=False) as pid:
        assert pid is None
