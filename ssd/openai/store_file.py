"""Stored responses and conversations over a restart: one JSON file in --store-dir.

Read once at the start; written by a thread every STORE_WRITE_S while either store
changes (so a crash loses at most that much), and once more at the stop. Each write
is whole or not at all (a file written aside, then moved: ssd.openai.batch_disk).
Without --store-dir nothing is read or written and no thread runs.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from ssd.openai.batch_disk import write_whole
from ssd.openai.stored import Conversation, Kept, ResponseStore, dump_stores, load_stores, stores_version

log = logging.getLogger(__name__)

STORE_FILE = "responses.json"  # in --store-dir
STORE_WRITE_S = 10.0  # how often the stores are written to --store-dir while they change (and at the stop)


class StoreFile:
    """The two stores' file, and the thread that keeps it up to date."""

    def __init__(self, store_dir: str | Path | None, responses: ResponseStore,
                 conversations: Kept[Conversation]) -> None:
        self.path = None if store_dir is None else Path(store_dir) / STORE_FILE
        self.responses, self.conversations = responses, conversations
        self._closing = threading.Event()
        self._writer: threading.Thread | None = None
        self._written = self._version()

    def start(self) -> None:
        """Read what the last run wrote, then keep writing (nothing without --store-dir)."""
        if self.path is None:
            return
        self._read()
        self._written = self._version()
        self._writer = threading.Thread(target=self._keep_writing, name="ssd-store", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Stop the thread and write the stores a last time."""
        self._closing.set()
        if self._writer is None:
            return
        self._writer.join(timeout=STORE_WRITE_S)
        self._write()
        log.info("wrote %d stored responses and %d conversations to %s", len(self.responses),
                 len(self.conversations), self.path)

    def _version(self) -> tuple[int, int, int]:
        return stores_version(self.responses, self.conversations)

    def _keep_writing(self) -> None:
        """Write the stores every STORE_WRITE_S while they change, so a crash loses at most that."""
        while not self._closing.wait(STORE_WRITE_S):
            if self._version() != self._written:
                self._write()

    def _read(self) -> None:
        """The responses and conversations the last run wrote, if any."""
        if not self.path.exists():
            return
        try:
            load_stores(json.loads(self.path.read_text()), self.responses, self.conversations)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("%s unreadable (%s); starting with no stored responses or conversations", self.path, exc)
            return
        log.info("read %d stored responses and %d conversations from %s", len(self.responses),
                 len(self.conversations), self.path)

    def _write(self) -> None:
        """Both stores, whole or not at all. Runs on the writer thread, and once more at the
        stop after it has ended."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            version = self._version()
            write_whole(self.path, json.dumps(dump_stores(self.responses, self.conversations)).encode())
            self._written = version
        except OSError as exc:
            log.error("could not write %s: %s", self.path, exc)
            return
        log.debug("wrote %d stored responses and %d conversations to %s", len(self.responses),
                  len(self.conversations), self.path)
