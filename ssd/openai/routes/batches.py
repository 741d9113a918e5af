"""OpenAI's Files and Batch APIs.

    POST   /v1/files                 upload (multipart: file, purpose, expires_after)
    GET    /v1/files                 list (purpose, order, limit, after)
    GET    /v1/files/{id}            retrieve
    GET    /v1/files/{id}/content    the bytes
    DELETE /v1/files/{id}            delete
    POST   /v1/batches               create (input_file_id, endpoint, completion_window, metadata)
    GET    /v1/batches               list (limit, after)
    GET    /v1/batches/{id}          retrieve
    POST   /v1/batches/{id}/cancel   cancel

A batch's lines run as the live requests they spell: each is posted to the front end's
own app in process (`asgi_post`), so routing, the token, validation, admission and the
reply are a live request's, and its rows join the same continuous batch as live traffic.
Batches run on an event loop of their own (a thread), not the HTTP server's.
At most serve.batch_lines run at once (--batch-concurrency; by default half the queue,
and one row fewer than the server has, so a live request finds a row free); a line the
queue turns away (429), or refused while the server is not serving (503), waits and
tries again. Queued lines wait behind every queued live request (ssd.serve.worker). `launch/run_batch.py` runs a file the same way without a
port (vLLM's `run-batch`).

Files and batches live in memory (serve.stored_file_bytes bytes of files; the last
BATCHES_KEPT batches). With serve.store_dir they are on disk too (ssd.openai.batch_disk)
and come back at the next start, where a batch that was running goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ssd.openai.batch_disk import BatchJournal, FileDisk, load_batches
from ssd.openai.batches import COMPLETION_WINDOWS, ENDPOINTS, Batch, BatchLine, read_lines
from ssd.openai.files import BATCH_FILE_S, EXPIRY_RANGE_S, PURPOSES, FileFull, FileStore, StoredFile
from ssd.openai.common import BATCH_LINE, ApiError, invalid, listed
from ssd.openai.responses import new_id
from ssd.openai.schema import Body, check_metadata
from ssd.openai.stored import Kept
from ssd.serve.service import InvalidArgument

log = logging.getLogger(__name__)

BATCHES_KEPT = 1024  # batches kept for retrieval, least recently used out first
MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI's limit on a batch input file
FILES_LISTED = 10_000  # OpenAI's file list: limit 1..10000, 10000 by default
BUSY_RETRY_S = 0.2  # a line the queue turned away (429), or refused while not serving (503), tries again after this
FILES_DIR, BATCHES_DIR = "files", "batches"  # under --store-dir
GAUGES = (
    ("ssd:batches_running", "Batches (/v1/batches) running."),
    ("ssd:batch_lines_pending", "Lines of running batches with no reply yet."),
    ("ssd:files_stored_bytes", "Bytes of files kept (--stored-file-bytes)."),
)


class ExpiresAfter(Body):
    anchor: str
    seconds: int


class BatchBody(Body):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None


async def asgi_post(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """POST `body` to the ASGI `app` in process: the status and the whole reply's bytes."""
    given = False
    never = asyncio.Event()  # the caller never leaves: a disconnect check waits and is cancelled

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {BATCH_LINE: True, "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers], "client": ("batch", 0), "server": ("batch", 0)}
    try:
        await app(scope, receive, send)
    except Exception as exc:  # the app answered 500 already (its error middleware re-raises)
        log.exception("a batch line failed")
        return 500, json.dumps(ApiError(500, f"internal error: {exc}", type_="server_error").body()).encode()
    return status, b"".join(chunks)


def _reply(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return {"error": {"message": data.decode(errors="replace"), "type": "server_error"}}


class BatchRoutes:
    """The routes, over one file store and one batch store; `authorize` and `parse` are the
    gate's (ssd.openai.common.Api), and lines run through the app `add_to` was given."""

    def __init__(self, options: Any, authorize: Callable[[Request], None], parse: Callable[..., Any],
                 rows: Callable[[], int] = lambda: 1) -> None:
        store_dir = None if options.store_dir is None else Path(options.store_dir)
        self.journals = None if store_dir is None else store_dir / BATCHES_DIR
        self.files = FileStore(options.stored_file_bytes, None if store_dir is None else FileDisk(store_dir / FILES_DIR))
        self.batches: Kept[Batch] = Kept(BATCHES_KEPT)
        self.options, self.rows = options, rows  # rows: the server's, in all (read when a batch starts)
        self.token = options.token
        self.authorize, self.parse = authorize, parse
        self.app: FastAPI | None = None
        self.running: dict[str, Running] = {}  # by batch id, until it ends
        self._loop: asyncio.AbstractEventLoop | None = None  # the batches' own (started on first use)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add_to(self, app: FastAPI) -> None:
        self.app = app
        app.add_api_route("/v1/files", self.upload, methods=["POST"])
        app.add_api_route("/v1/files", self.list_files, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.retrieve_file, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}/content", self.file_content, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"])
        app.add_api_route("/v1/batches", self.create, methods=["POST"])
        app.add_api_route("/v1/batches", self.list_batches, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])
        if self.journals is not None:
            self._restore()  # now that the lines have an app to run through

    def counts(self) -> tuple[int, int, int]:
        """GAUGES' values: batches running, their lines with no row yet, bytes of files kept."""
        running = list(self.running.values())
        pending = sum(r.batch.total - r.batch.rows() for r in running)
        return len(running), pending, self.files.used

    # --- files -------------------------------------------------------------------------

    def find_file(self, file_id: str, param: str | None = None) -> StoredFile:
        found = self.files.get(file_id)
        if found is None:
            where = f"{param}: " if param else ""
            raise ApiError(404, f"{where}no file {file_id!r} (never uploaded, deleted, or expired)",
                           param=param, code="file_not_found")
        return found

    async def upload(self, request: Request) -> JSONResponse:
        self.authorize(request)
        if self.files.capacity == 0:
            raise ApiError(400, "this server keeps no files (--stored-file-bytes 0)", code="files_off")
        limit = min(MAX_UPLOAD_BYTES, self.files.capacity)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + 64 * 1024:  # the form's own fields besides
            raise ApiError(413, f"file: larger than {limit} bytes", param="file", code="file_too_large")
        form = await self._form(request)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "file: a multipart file field is required", param="file",
                           code="missing_required_parameter")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}",
                           param="purpose", code="invalid_value")
        content = await upload.read(limit + 1)  # a chunked upload says no length: read no more than a byte past
        if len(content) > limit:
            raise ApiError(413, f"file: larger than {limit} bytes", param="file", code="file_too_large")
        lifetime = _lifetime(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"), "expires_after")
        try:  # in a thread: with --store-dir the file is written to disk
            stored = await asyncio.to_thread(self.files.add, upload.filename or "upload", purpose, content,
                                             lifetime or (BATCH_FILE_S if purpose == "batch" else None))
        except FileFull as exc:
            raise ApiError(400, f"file: {exc}", param="file", code="file_store_full") from None
        return JSONResponse(stored.public())

    @staticmethod
    async def _form(request: Request) -> Any:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "body: an upload is multipart/form-data (fields file and purpose)",
                           param="body", code="invalid_value")
        try:
            return await request.form(max_files=1, max_fields=8)
        except Exception as exc:  # starlette's MultiPartException and the parser's own errors
            raise ApiError(400, f"body: not a readable multipart form: {exc}", param="body",
                           code="invalid_value") from None

    async def list_files(self, request: Request) -> JSONResponse:
        self.authorize(request)
        purpose = request.query_params.get("purpose")
        return listed([f.public() for f in self.files.listed(purpose)], request, "the files",
                      most=FILES_LISTED, default=FILES_LISTED)

    async def retrieve_file(self, request: Request, file_id: str) -> JSONResponse:
        self.authorize(request)
        return JSONResponse(self.find_file(file_id).public())

    async def file_content(self, request: Request, file_id: str) -> Response:
        self.authorize(request)
        return Response(self.find_file(file_id).content, media_type="application/octet-stream")

    async def delete_file(self, request: Request, file_id: str) -> JSONResponse:
        self.authorize(request)
        if not self.files.delete(file_id):
            self.find_file(file_id)  # the 404
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # --- batches -----------------------------------------------------------------------

    def find(self, batch_id: str) -> Batch:
        running = self.running.get(batch_id)  # a running batch stays found, evicted or not
        found = self.batches.get(batch_id) or (running.batch if running is not None else None)
        if found is None:
            raise ApiError(404, f"no batch {batch_id!r} (never created, or evicted: the server keeps the last "
                           f"{BATCHES_KEPT})", code="batch_not_found")
        return found

    async def create(self, request: Request) -> JSONResponse:
        """A batch over an uploaded file: failed at once when a line is bad, else running."""
        self.authorize(request)
        body = await self.parse(request, BatchBody)
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}",
                           param="endpoint", code="invalid_value")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise ApiError(400, f"completion_window: must be 24h, got {body.completion_window!r}",
                           param="completion_window", code="invalid_value")
        try:
            metadata = check_metadata(body.metadata) if body.metadata is not None else None
        except InvalidArgument as exc:
            raise invalid(exc) from None
        expires = body.output_expires_after
        lifetime = _lifetime(expires.anchor, expires.seconds, "output_expires_after") if expires else None
        source = self.find_file(body.input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise ApiError(400, f"input_file_id: file {source.id!r} was uploaded with purpose "
                           f"{source.purpose!r}; a batch's input needs purpose 'batch'",
                           param="input_file_id", code="invalid_value")
        lines, errors = read_lines(source.content, body.endpoint)
        batch = Batch(new_id("batch"), body.endpoint, source.id, metadata, len(lines) + len(errors))
        journal = None if self.journals is None else BatchJournal.start(self.journals, batch, lifetime)
        self.batches.keep(batch.id, batch)
        running = Running(batch, lifetime or BATCH_FILE_S, journal)
        if errors:
            running.move("failed", errors)
        else:
            self._start(running, lines)
        return JSONResponse(batch.public())

    def _start(self, running: Running, lines: list[BatchLine]) -> None:
        """Run the batch on the batches' own event loop (a thread of its own: batch lines'
        handlers never take the HTTP server's loop from live requests)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="ssd-batches", daemon=True)
                self._thread.start()
        self.running[running.batch.id] = running
        asyncio.run_coroutine_threadsafe(self.run(running, lines), self._loop)

    async def run(self, running: Running, lines: list[BatchLine], on_line: Callable[[], None] | None = None) -> None:
        """Run the lines that have no row yet, serve.batch_lines at a time, then write the
        output and error files."""
        batch = running.batch
        running.loop = asyncio.get_running_loop()
        started = time.monotonic()
        log.info("batch %s: %d lines to %s", batch.id, batch.total - batch.rows(), batch.endpoint)
        try:
            if running.begin():  # else cancelled before it began: straight to the files
                todo = iter([line for line in lines if not batch.has(line.line)])  # each line taken once

                async def work() -> None:
                    for line in todo:
                        status, data = await self._post_line(batch.endpoint, line.body)
                        running.row(line.line, batch.record(line, status, _reply(data)))
                        if on_line is not None:
                            on_line()

                running.workers = [asyncio.create_task(work()) for _ in range(self.options.batch_lines(self.rows()))]
                if batch.status == "cancelling":  # a cancel between begin and now found no workers
                    running.stop_workers()
                await asyncio.gather(*running.workers, return_exceptions=True)
            self._finish(running, lines)
            counts = batch.public()["request_counts"]
            log.info("batch %s %s in %.1f s: %d completed, %d failed", batch.id, batch.status,
                     time.monotonic() - started, counts["completed"], counts["failed"])
        finally:
            self.running.pop(batch.id, None)

    async def _post_line(self, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """A line's reply; while the queue is full (429) or the server is not serving (503:
        loading, a target restarting, stopping) it waits and tries again, so a line never
        fails for that and a stop leaves it to run after the restart."""
        headers = [(b"authorization", f"Bearer {self.token}".encode())] if self.token else []
        data = json.dumps(body).encode()
        while True:
            status, reply = await asgi_post(self.app, endpoint, data, headers)
            if status not in (429, 503):
                return status, reply
            await asyncio.sleep(BUSY_RETRY_S)

    def _finish(self, running: Running, lines: list[BatchLine]) -> None:
        """Lines a cancel stopped are the error file's batch_cancelled; both files are kept."""
        batch = running.batch
        cancelled = batch.status == "cancelling"
        if cancelled:
            for line in lines:
                if not batch.has(line.line):
                    running.row(line.line, batch.record_unrun(line, "batch_cancelled",
                                                              "the batch was cancelled before this request ended"))
        running.move("finalizing")
        output, errors = batch.files()
        try:
            if output:
                batch.output_file_id = self.files.add(f"{batch.id}_output.jsonl", "batch_output", output,
                                                      running.lifetime_s).id
            if errors:
                batch.error_file_id = self.files.add(f"{batch.id}_error.jsonl", "batch_output", errors,
                                                     running.lifetime_s).id
        except FileFull as exc:
            running.move("failed", [{"code": "file_store_full", "line": None, "message": str(exc), "param": None}])
            return
        running.move("cancelled" if cancelled else "completed")

    def _restore(self) -> None:
        """Files and batches from --store-dir; a batch that was running goes on (its lines with
        no row yet run), one whose input file is gone fails."""
        self.files.restore(self.files.keeper.load())
        for batch, lifetime, journal in load_batches(self.journals, BATCH_FILE_S):
            self.batches.keep(batch.id, batch)
            if batch.ended:
                continue
            running = Running(batch, lifetime or BATCH_FILE_S, journal)
            source = self.files.get(batch.input_file_id)
            if source is None:
                running.move("failed", [{"code": "input_file_gone", "line": None, "param": "input_file_id",
                                         "message": f"the input file {batch.input_file_id!r} was not there after "
                                                    f"a restart"}])
                continue
            log.info("batch %s goes on after a restart: %d of %d lines to run", batch.id,
                     batch.total - batch.rows(), batch.total)
            self._start(running, read_lines(source.content, batch.endpoint)[0])

    def close(self) -> None:
        """Stop the batches' loop: running batches stay in_progress in their journals (with
        --store-dir they go on at the next start) and their rows end with the worker's."""
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)

    async def retrieve(self, request: Request, batch_id: str) -> JSONResponse:
        self.authorize(request)
        return JSONResponse(self.find(batch_id).public())

    async def list_batches(self, request: Request) -> JSONResponse:
        """Newest first, as OpenAI's list."""
        self.authorize(request)
        batches = sorted(self.batches.values(), key=lambda b: b.created_ns)
        return listed([b.public() for b in batches], request, "the batches")

    async def cancel(self, request: Request, batch_id: str) -> JSONResponse:
        """OpenAI's cancel: a running batch stops taking lines, the running ones are aborted, and
        it ends cancelled with the files of what finished; an ended one answers as it is."""
        self.authorize(request)
        batch = self.find(batch_id)
        running = self.running.get(batch_id)
        if running is not None and batch.status in ("validating", "in_progress"):
            running.move("cancelling")
            running.stop_workers()
        elif batch.status not in ("cancelling", "cancelled"):
            raise ApiError(400, f"batch {batch_id!r} is {batch.status}: only a running batch can be cancelled",
                           code="batch_not_cancellable")
        return JSONResponse(batch.public())


@dataclass
class Running:
    """A batch while it runs: its journal (with --store-dir), its files' lifetime, and the
    loop and tasks that run its lines (to cancel them from a handler's thread)."""

    batch: Batch
    lifetime_s: int | None
    journal: BatchJournal | None = None
    loop: asyncio.AbstractEventLoop | None = None
    workers: list[asyncio.Task] = field(default_factory=list)

    def move(self, status: str, errors: list[dict[str, Any]] | None = None) -> None:
        if errors is not None:
            self.batch.validation_errors = errors
        self.batch.move(status)
        if self.journal is not None:
            self.journal.status(self.batch)

    def begin(self) -> bool:
        began = self.batch.begin()
        if began and self.journal is not None:
            self.journal.status(self.batch)
        return began

    def row(self, line: int, row: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.row(line, row)

    def stop_workers(self) -> None:
        if self.loop is not None:
            for worker in self.workers:
                self.loop.call_soon_threadsafe(worker.cancel)


def _lifetime(anchor: Any, seconds: int | str | None, param: str) -> int | None:
    """OpenAI's expires_after (anchor created_at, 3600..2592000 s) in seconds; None when absent.
    `seconds`: the JSON body's integer, or a form field's text."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"{param}.anchor: must be created_at, got {anchor!r}", param=f"{param}.anchor",
                       code="invalid_value")
    low, high = EXPIRY_RANGE_S
    if isinstance(seconds, str) and seconds.isdigit():
        seconds = int(seconds)
    if not isinstance(seconds, int) or not low <= seconds <= high:
        raise ApiError(400, f"{param}.seconds: must be an integer in {low}..{high}, got {seconds!r}",
                       param=f"{param}.seconds", code="invalid_value")
    return seconds
