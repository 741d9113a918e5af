"""Files and batches on disk under serve.store_dir (--store-dir), so they outlive a restart
and a batch that was running goes on where it stopped.

    DIR/files/<id>.data, <id>.json    a file's bytes, then its description (written last:
                                      a file is there once its description is)
    DIR/batches/<id>.jsonl            a batch's journal: its header, then each finished
                                      line's output row and each status it moved to

A journal is appended to as the batch runs (a line at a time, flushed), so a crash
loses at most the lines that were running; a torn last line is skipped when read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ssd.openai.batches import Batch
from ssd.openai.files import StoredFile

log = logging.getLogger(__name__)


def write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (written aside, then moved): a crash mid-write
    leaves the file as it was (the stores' file too, ssd.openai.store_file)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.partial")
    aside.write_bytes(data)
    os.replace(aside, path)


class FileDisk:
    """The file store's files under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, stored: StoredFile) -> None:
        described = {k: v for k, v in stored.__dict__.items() if k != "content"}
        write_whole(self.root / f"{stored.id}.data", stored.content)
        write_whole(self.root / f"{stored.id}.json", json.dumps(described).encode())

    def remove(self, file_id: str) -> None:
        for suffix in (".json", ".data"):  # the description first: a file without one is gone
            (self.root / f"{file_id}{suffix}").unlink(missing_ok=True)

    def load(self) -> list[StoredFile]:
        """Every file written and not expired (expired and unreadable ones are removed)."""
        now, files = int(time.time()), []
        for described in sorted(self.root.glob("*.json")):
            file_id = described.stem
            try:
                stored = StoredFile(content=(self.root / f"{file_id}.data").read_bytes(),
                                    **json.loads(described.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("file %s unreadable (%s); dropped", file_id, exc)
                self.remove(file_id)
                continue
            if stored.expires_at is not None and stored.expires_at <= now:
                self.remove(file_id)
                continue
            files.append(stored)
        return files


class BatchJournal:
    """One batch's append-only record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # the runner's loop and cancel handlers both append

    @classmethod
    def start(cls, root: Path, batch: Batch, lifetime_s: int | None) -> "BatchJournal":
        root.mkdir(parents=True, exist_ok=True)
        journal = cls(root / f"{batch.id}.jsonl")
        journal._append({"kind": "batch", "id": batch.id, "endpoint": batch.endpoint,
                         "input_file_id": batch.input_file_id, "metadata": batch.metadata, "total": batch.total,
                         "created_at": batch.created_at, "lifetime_s": lifetime_s})
        return journal

    def row(self, line: int, row: dict[str, Any]) -> None:
        self._append({"kind": "row", "line": line, "row": row})

    def status(self, batch: Batch) -> None:
        self._append({"kind": "status", "status": batch.status, "times": dict(batch.times),
                      "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
                      "errors": batch.validation_errors})

    def _append(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            try:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(text)
            except OSError as exc:
                log.error("could not write %s: %s", self.path, exc)


def load_batches(root: Path, default_lifetime_s: int) -> list[tuple[Batch, int | None, BatchJournal]]:
    """Every journaled batch as it last stood, with its files' lifetime and its journal. The
    journal of a batch that ended and whose files have expired is removed."""
    if not root.is_dir():
        return []
    loaded, now = [], time.time()
    for path in sorted(root.glob("*.jsonl")):
        try:
            batch, lifetime = _replay(path.read_text(encoding="utf-8").splitlines())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("batch journal %s unreadable (%s); skipped", path, exc)
            continue
        if batch.ended and batch.created_at + (lifetime or default_lifetime_s) <= now:
            path.unlink(missing_ok=True)
            continue
        loaded.append((batch, lifetime, BatchJournal(path)))
    return sorted(loaded, key=lambda entry: entry[0].created_at)


def _replay(records: list[str]) -> tuple[Batch, int | None]:
    head = json.loads(records[0])
    batch = Batch(head["id"], head["endpoint"], head["input_file_id"], head["metadata"], head["total"],
                  created_at=head["created_at"])
    for number, text in enumerate(records[1:], start=2):
        try:
            record = json.loads(text)
        except ValueError:
            if number == len(records):  # torn by a crash mid-write
                break
            raise
        if record["kind"] == "row":
            batch.restore_row(record["line"], record["row"])
        elif record["kind"] == "status":
            batch.status, batch.times = record["status"], record["times"]
            batch.output_file_id, batch.error_file_id = record["output_file_id"], record["error_file_id"]
            batch.validation_errors = record["errors"]
    return batch, head["lifetime_s"]
