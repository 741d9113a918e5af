"""The draft link: target rank 0 and the speculator over a fresh two-rank
torch.distributed group, (re)made at start-up, after a lost draft and after a
restarted target (a part of ssd.cluster.runtime.Cluster)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import ray

from ssd.config import Config

log = logging.getLogger(__name__)


class DraftLink:
    """Links and heals the speculator of one Cluster (the attributes are the Cluster's)."""

    config: Config
    name: str
    draft_node: str | None
    targets: list
    draft: Any
    link_round_trip_s: float | None
    link_address: tuple[str, int] | None
    _prefixes: Iterator[str]
    _serving: Any
    _draft_pid: int | None
    _linked_pid: int | None
    _start_timeouts: dict[str, float]
    _stopping: threading.Event

    def link(self) -> None:
        """(Re)connect target rank 0 and the speculator over a fresh two-rank group.

        The target adopts the new link before its next round, also in the
        middle of a request."""
        timeout = self.config.cluster.draft_timeout_s
        self._draft_pid = ray.get(self.draft.ready.remote(), timeout=60)  # heal: a failed link makes it stale
        # A speculator on a node of its own reaches the target at its node's address (TCP between hosts).
        host, port = ray.get(self.targets[0].link_address.remote(self.draft_node is not None))
        prefix = next(self._prefixes)
        precision = ray.get(self.draft.precision.remote(), timeout=60)  # the draft's own, as loaded
        self._serving = self.draft.serve.remote(port, prefix, timeout, host)
        self.link_round_trip_s = ray.get(self.targets[0].connect_draft.remote(port, prefix, timeout, host, precision))
        # Only now: until the target holds the new link, `linked()` must not
        # take the old one (dead, but not yet found so by an idle engine) for it.
        self._linked_pid = self._draft_pid
        self.link_address = (host, port)
        log.info("%s: draft linked (%s at %s:%d, round trip %.2f ms)", self.name, prefix, host, port,
                 self.link_round_trip_s * 1e3)

    @property
    def draft_pid(self) -> int | None:
        """The speculator process the target was last linked to."""
        return self._linked_pid

    def linked(self) -> bool:
        """The target holds a link to the speculator process that is running now."""
        try:
            pid = ray.get(self.draft.ready.remote(), timeout=10)
            return pid == self._linked_pid and ray.get(self.targets[0].link_up.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def wait_linked(self, timeout: float) -> bool:
        """Wait for the watcher to (re)link the draft; True once linked."""
        deadline = time.monotonic() + timeout
        while not self.linked():
            if time.monotonic() > deadline:
                return False
            self._watching.set()
            time.sleep(0.2)
        return True

    def _relink_after_target_loss(self) -> None:
        """The speculator's link ended with its peer: link the same process again
        once its serve call has returned, else restart it."""
        try:
            ray.get(self._serving, timeout=self.config.cluster.draft_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.heal()
            return
        except Exception:  # noqa: BLE001 - the link's end is expected to raise here
            pass
        try:
            self.link()
        except Exception:  # noqa: BLE001 - a speculator that cannot link is restarted
            log.warning("re-linking the speculator failed; restarting it", exc_info=True)
            self.heal()

    def heal(self) -> None:
        """After the target lost its draft: restart the speculator (unless Ray
        already did) and link it again. A lost target is restarted instead
        (which re-links the draft)."""
        if not self.targets_alive():
            self._down("a target rank does not answer")
            return
        try:
            # The same process, alive but unlinked: its state is not to be trusted.
            stale = ray.get(self.draft.ready.remote(), timeout=10) == self._draft_pid
        except ray.exceptions.GetTimeoutError:  # hung as a whole
            stale = True
        except ray.exceptions.RayActorError:  # dead or restarting: Ray brings it back (max_restarts=-1)
            stale = False
        if stale:
            log.warning("restarting the speculator")
            ray.kill(self.draft, no_restart=False)
        deadline = time.monotonic() + self._start_timeouts["draft"]  # Ray's restart loads the draft again
        while True:
            try:
                ray.get(self.draft.ready.remote(), timeout=30)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                if self._stopping.is_set():  # e.g. its --draft-node left: shut down without it
                    return
                time.sleep(0.5)
        self.link()
