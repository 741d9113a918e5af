"""OpenAI's Files API, its pure part: files kept in memory under a byte budget.

Files come from uploads (a batch's input, `purpose` "batch") and from batches (their
output and error files, "batch_output"). They stay until deleted, or until they expire
(OpenAI's `expires_after`; batch files 30 days by default, as OpenAI's); an upload that
would pass the budget is refused rather than evicting a file a batch may still need.
No model, no I/O (a `Keeper` does that, with --store-dir): testable in milliseconds.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

PURPOSES = ("batch", "user_data")  # what an upload may say here (the rest need APIs this server lacks)
BATCH_FILE_S = 30 * 24 * 3600  # OpenAI's default lifetime of batch files
EXPIRY_RANGE_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds on expires_after.seconds


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    expires_at: int | None

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.content), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class Keeper(Protocol):
    """Where files also go, to outlive the process (ssd.openai.batch_disk.FileDisk)."""

    def write(self, stored: StoredFile) -> None: ...

    def remove(self, file_id: str) -> None: ...


class FileFull(Exception):
    """Keeping the file would pass the store's byte budget."""


class FileStore:
    """Files by id within `capacity` bytes in all; thread-safe (handlers run on a pool)."""

    def __init__(self, capacity: int, keeper: Keeper | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.keeper = keeper
        self._files: dict[str, StoredFile] = {}
        self._lock = threading.Lock()

    def restore(self, files: list[StoredFile]) -> None:
        """Files kept before (a restart), as they were; past the budget they still count."""
        with self._lock:
            self._files.update((f.id, f) for f in sorted(files, key=lambda f: f.created_at))

    def __len__(self) -> int:
        return len(self._files)

    @property
    def used(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(len(f.content) for f in self._files.values())

    def add(self, filename: str, purpose: str, content: bytes, lifetime_s: int | None) -> StoredFile:
        """Keep a new file (FileFull when it does not fit)."""
        now = int(time.time())
        stored = StoredFile(f"file-{uuid.uuid4().hex}", filename, purpose, content, now,
                            None if lifetime_s is None else now + lifetime_s)
        with self._lock:
            self._drop_expired(now)
            used = self._bytes()
            if used + len(content) > self.capacity:
                raise FileFull(f"the file store holds {used} of {self.capacity} bytes (--stored-file-bytes); "
                               f"{len(content)} more do not fit: delete files first")
            self._files[stored.id] = stored
        if self.keeper is not None:
            self.keeper.write(stored)
        return stored

    def get(self, file_id: str) -> StoredFile | None:
        with self._lock:
            self._drop_expired(int(time.time()))
            return self._files.get(file_id)

    def delete(self, file_id: str) -> bool:
        with self._lock:
            found = self._files.pop(file_id, None) is not None
        if found and self.keeper is not None:
            self.keeper.remove(file_id)
        return found

    def listed(self, purpose: str | None = None) -> list[StoredFile]:
        """The files, oldest first (of one purpose, if given)."""
        with self._lock:
            self._drop_expired(int(time.time()))
            files = [f for f in self._files.values() if purpose is None or f.purpose == purpose]
        return sorted(files, key=lambda f: f.created_at)

    def _drop_expired(self, now: int) -> None:
        for file_id in [i for i, f in self._files.items() if f.expires_at is not None and f.expires_at <= now]:
            del self._files[file_id]
            if self.keeper is not None:
                self.keeper.remove(file_id)
