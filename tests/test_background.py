"""The bench's background load: one busy process at nice 19, gone when the block ends."""

import time

import psutil

from ssd.tools.bench.background import BACKGROUND_NICENESS, busy_background, describe


def test_busy_background_spins_at_nice_19_and_is_gone_after():
    with busy_background() as pid:
        process = psutil.Process(pid)
        assert process.nice() == BACKGROUND_NICENESS
        busy = sum(process.cpu_times()[:2])
        deadline = time.monotonic() + 20.0  # on a loaded machine nice 19 gets ~1.5% of a core: wait for it
        while (spent := sum(process.cpu_times()[:2]) - busy) <= 0.01 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert spent > 0.01, spent  # it spins
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "nice 19" in describe(True) and describe(False) == "background load: none"


def test_disabled_background_starts_nothing():
    with busy_background(enabled=False) as pid:
        assert pid is None


def test_omp_policy_rows_cover_each_policy_quiet_and_beside_a_busy_process(monkeypatch):
    import ssd.tools.bench.omp_policy as omp

    assert omp.probe("passive", 1, repeats=1) > 0  # one real probe: a fresh process under the policy
    asked = []
    monkeypatch.setattr(omp, "probe", lambda policy, threads, repeats: asked.append((policy, threads)) or 10.0 * threads)
    rows = omp.measure([1, 2], ["default", "passive"], rounds=2, repeats=1, progress=False)
    assert {(r.policy, r.threads, r.background) for r in rows} == {
        (p, t, b) for p, t in [("default", 1), ("default", 2), ("passive", 2)] for b in (False, True)
    }
    assert len(asked) == 2 * 2 * 3  # rounds x (quiet, busy) x cases: interleaved, none skipped
    assert omp.format_rows(rows).splitlines()[2].split("|")[1].strip() == "2"  # default at 2 threads
