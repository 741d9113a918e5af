"""Healing: the watcher thread that keeps a cluster serving, a lost target's
restart, and the health that listeners hear (a part of ssd.cluster.runtime.Cluster)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import ray

from ssd.config import Config
from ssd.engine.request import GeneratorUnavailable

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0  # how often the watcher checks the actors between requests
STANDBY_WATCH_S = 0.5  # ... with a warm standby to take over: a lost target is worth finding early
RECOVERY_WAIT_S = 600.0  # how long a queued request waits for a lost target to come back

# (serving, why not): called when the cluster goes down or comes back.
HealthListener = Callable[[bool, str | None], None]


class Healing:
    """Watches and restarts the actors of one Cluster (the attributes are the Cluster's)."""

    config: Config
    name: str
    targets: list
    draft: Any
    target_restarts: int
    _followers: list
    _stopping: threading.Event
    _watching: threading.Event
    _up: threading.Event
    _why_down: str | None
    _tp_failure: tuple[int, str] | None
    _listeners: list[HealthListener]
    _listeners_lock: threading.Lock

    def _watch(self) -> None:
        """Heal off the request path: a lost target is restarted (the service is
        down meanwhile); a lost draft is re-linked while requests run degraded
        and pick the new link up at their next round."""
        while not self._stopping.is_set():
            self._watching.wait(STANDBY_WATCH_S if self.config.cluster.warm_standby else WATCH_INTERVAL_S)
            self._watching.clear()
            if self._stopping.is_set():
                return
            try:
                if not self._up.is_set() or not self.targets_alive():
                    self.restart_targets()
                elif (why := self.tp_broken()) is not None:
                    self._tp_failed(why)
                    self.restart_targets()
                elif self.draft is not None and not self.linked():
                    self.heal()
            except Exception:  # noqa: BLE001 - the watcher must outlive a failed attempt; it retries
                log.exception("healing the cluster failed; retrying")

    def add_health_listener(self, listener: HealthListener) -> None:
        """Call `listener(serving, why)` whenever the cluster goes down or comes back."""
        with self._listeners_lock:
            self._listeners.append(listener)

    @property
    def serving(self) -> bool:
        return self._up.is_set()

    def targets_alive(self) -> bool:
        """Every target rank answers (a dead rank raises at once; a hung one times out)."""
        try:
            ray.get([t.ready.remote() for t in self.targets], timeout=30)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def tp_broken(self) -> str | None:
        """Why the tensor-parallel group is broken (a forward failed on some rank), or None.

        A follower's run_follower call returns only when stopped, so one that
        has returned (with TPForwardError or any other end) means a broken group.
        """
        if len(self.targets) < 2:
            return None
        done, _ = ray.wait(self._followers, num_returns=len(self._followers), timeout=0)
        for ref in done:
            rank = self._followers.index(ref) + 1
            try:
                commands = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the follower's end, as text
                return (str(getattr(exc, "cause", None) or exc).strip().splitlines() or [f"target rank {rank} failed"])[0]
            return f"target rank {rank} stopped mirroring after {commands} commands"
        try:
            return ray.get(self.targets[0].tp_failed.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None  # a lost rank: targets_alive() handles it

    def look_now(self) -> None:
        """Have the watcher check the actors now rather than at its next interval."""
        self._watching.set()

    def _tp_failed(self, why: str) -> None:
        """Record a broken group (for the request that was running) and mark the service down."""
        self._tp_failure = (self.target_restarts, why)
        self._down(f"tensor-parallel forward failed ({why})")

    def forward_failure(self, restarts_before: int) -> str | None:
        """The TP forward failure found while the targets of `restarts_before` ran, if any."""
        if self._tp_failure is not None and self._tp_failure[0] == restarts_before:
            return self._tp_failure[1]
        return None

    def _down(self, why: str) -> None:
        """Mark the service down (once) and wake the watcher to restart the target."""
        if self._up.is_set():
            self._why_down = why
            self._up.clear()
            log.error("%s: target lost (%s): not serving until it is restarted", self.name, why)
            self._tell(False, why)
        self._watching.set()

    def _tell(self, serving: bool, why: str | None) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(serving, why)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the recovery
                log.exception("a health listener failed")

    def restart_targets(self) -> None:
        """Start every target rank again (a TP group cannot take one new rank), or
        hand over to the warm standby where one is loaded, re-link the draft, and
        report SERVING."""
        self._down(self._why_down or "a target rank does not answer")
        started = time.monotonic()
        for target in self.targets:
            ray.kill(target, no_restart=True)
        standby = self._take_standby()
        self.targets = [standby] if standby is not None else self._start_targets()
        if self.draft is not None:
            self._relink_after_target_loss()
        self.target_restarts += 1
        self._why_down = None
        self._up.set()
        log.info("%s: target %s in %.1f s; serving", self.name,
                 "taken over by the warm standby" if standby is not None else "restarted", time.monotonic() - started)
        self._tell(True, None)
        self._standby_in_background()  # the next one (cluster.warm_standby)

    def wait_serving(self) -> None:
        """Block while the target restarts (GeneratorUnavailable past RECOVERY_WAIT_S)."""
        self._wait_up()

    def target_lost(self, why: str) -> None:
        """A caller found the target gone: not serving until the watcher restarts it."""
        self._down(why)

    def _wait_up(self) -> None:
        """Block while the target restarts."""
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while not self._up.wait(0.2):
            if self._stopping.is_set() or time.monotonic() > deadline:
                raise GeneratorUnavailable(f"the target is not back ({self._why_down})")
