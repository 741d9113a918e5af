"""OpenAI's Batch API, its pure part: the input file's lines, a batch's state, the output
file's lines. No model, no I/O: testable in milliseconds.

An input file is JSONL, one request per line, as OpenAI's:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Every line is checked before any runs (a custom_id unique in the file, the batch's
endpoint, a body that is a JSON object and asks for no stream or background run); a
file with any bad line fails the batch whole, with an error per line (up to
MAX_LINE_ERRORS), as OpenAI's validation does. A body's own fields are checked where a
live request's are, when its line runs: a bad one is that line's 400 in the error file.

Each line that ran has an output line, OpenAI's shape:

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "...", "body": {...}}}

200s go to the output file, the rest to the error file; a line that never ran (the batch
was cancelled first) has `response: null` and an `error` with code batch_cancelled, so
the two files account for every line.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ssd.openai.responses import new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = ("24h",)  # OpenAI's only one; a local server finishes as fast as it can
MAX_LINES = 50_000  # OpenAI's: requests in one input file
MAX_LINE_ERRORS = 100  # errors a failed validation lists (the first ones)
WINDOW_S = 24 * 3600


@dataclass(frozen=True)
class BatchLine:
    """One request of the input file: its 1-based line number, custom_id and body."""

    line: int
    custom_id: str
    body: dict[str, Any]


def _error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}


def _checked(number: int, text: str, endpoint: str) -> BatchLine | dict[str, Any]:
    """The line as a request, or its error."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _error(number, "invalid_json_line", f"not valid JSON: {exc}")
    if not isinstance(data, dict):
        return _error(number, "invalid_json_line", "must be a JSON object")
    custom_id, method, url, body = (data.get(key) for key in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        return _error(number, "missing_required_parameter", "custom_id: must be a non-empty string", "custom_id")
    if method != "POST":
        return _error(number, "invalid_value", f"method: must be POST, got {method!r}", "method")
    if url != endpoint:
        return _error(number, "mismatched_endpoint", f"url: the batch's endpoint is {endpoint}, got {url!r}", "url")
    if not isinstance(body, dict):
        return _error(number, "missing_required_parameter", "body: must be a JSON object", "body")
    for flag in ("stream", "background"):
        if body.get(flag):
            return _error(number, "invalid_value", f"body.{flag}: a batch's requests cannot ask for it",
                          f"body.{flag}")
    return BatchLine(number, custom_id, body)


def read_lines(content: bytes, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The file's requests, and its errors (OpenAI's BatchError objects; none: it may run).
    Blank lines are skipped."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [_error(0, "invalid_file", f"not UTF-8: {exc}")]
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        checked = _checked(number, raw, endpoint)
        if isinstance(checked, BatchLine) and checked.custom_id in seen:
            checked = _error(number, "duplicate_custom_id", f"custom_id: {checked.custom_id!r} is on an "
                             f"earlier line; each must be unique", "custom_id")
        if isinstance(checked, dict):
            errors.append(checked)
        else:
            seen.add(checked.custom_id)
            lines.append(checked)
    if not lines and not errors:
        errors.append(_error(0, "empty_file", "the file holds no requests"))
    if len(lines) + len(errors) > MAX_LINES:
        errors.insert(0, _error(0, "too_many_requests", f"the file holds {len(lines) + len(errors)} requests; "
                                                        f"a batch takes at most {MAX_LINES}"))
    return lines, errors[:MAX_LINE_ERRORS]


def output_line(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """The output (or error) file's line for a request that ran."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": new_id("batch_req"), "custom_id": custom_id, "error": None,
            "response": {"status_code": status_code, "request_id": request_id or new_id("req"), "body": body}}


def unrun_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The error file's line for a request that never ran."""
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def _usage_of(body: Any) -> tuple[int, int, int]:
    """(input, cached, output) tokens of a reply: chat/completions' usage or the Responses API's."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return usage["input_tokens"], details.get("cached_tokens", 0), usage.get("output_tokens", 0)
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), usage.get("completion_tokens", 0)


@dataclass
class Batch:
    """One batch's state, OpenAI's Batch object in `public()`. Its lines' results arrive on
    the runner's event loop; readers (handlers on a pool) take `public()` under the lock."""

    id: str
    endpoint: str
    input_file_id: str
    metadata: dict[str, str] | None
    total: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    created_ns: int = field(default_factory=time.monotonic_ns)  # orders batches created in one second
    status: str = "validating"
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, ...
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)  # by input line: 200s
    errors_out: dict[int, dict[str, Any]] = field(default_factory=dict)  # by input line: the rest
    validation_errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # input, cached, output
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def move(self, status: str) -> None:
        """To `status`, stamping its time (OpenAI's <status>_at)."""
        with self._lock:
            self._stamp(status)

    def _stamp(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    @property
    def ended(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "expired")

    def begin(self) -> bool:
        """To in_progress, unless a cancel came first (then False)."""
        with self._lock:
            if self.status == "cancelling":
                return False
            self._stamp("in_progress")
            return True

    def record(self, line: BatchLine, status_code: int, body: Any) -> dict[str, Any]:
        """A line ran: its reply joins the output file (200) or the error file. Returns its row."""
        row = output_line(line.custom_id, status_code, body)
        self.restore_row(line.line, row)
        return row

    def record_unrun(self, line: BatchLine, code: str, message: str) -> dict[str, Any]:
        row = unrun_line(line.custom_id, code, message)
        self.restore_row(line.line, row)
        return row

    def restore_row(self, line: int, row: dict[str, Any]) -> None:
        """Input line `line`'s output row (as `record` made it), into the file it belongs to."""
        response = row["response"]
        done = response is not None and response["status_code"] == 200
        with self._lock:
            (self.outputs if done else self.errors_out)[line] = row
            if done:
                for i, n in enumerate(_usage_of(response["body"])):
                    self.tokens[i] += n

    def rows(self) -> int:
        """Lines with their row (they ran, or will not)."""
        with self._lock:
            return len(self.outputs) + len(self.errors_out)

    def has(self, line: int) -> bool:
        """Whether input line `line` has its row (it ran, or will not)."""
        with self._lock:
            return line in self.outputs or line in self.errors_out

    def files(self) -> tuple[bytes, bytes]:
        """The output file's and the error file's contents, each in input order."""
        with self._lock:
            return (jsonl([self.outputs[k] for k in sorted(self.outputs)]),
                    jsonl([self.errors_out[k] for k in sorted(self.errors_out)]))

    def every_line(self) -> bytes:
        """Both files as one, in input order (vLLM's run-batch writes one file)."""
        with self._lock:
            rows = {**self.outputs, **self.errors_out}
        return jsonl([rows[k] for k in sorted(rows)])

    def public(self) -> dict[str, Any]:
        with self._lock:
            done, failed = len(self.outputs), len(self.errors_out)
            tokens = list(self.tokens)
            status, times = self.status, dict(self.times)
        errors = ({"object": "list", "data": list(self.validation_errors)} if self.validation_errors else None)
        data = {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
                "input_file_id": self.input_file_id, "completion_window": "24h", "status": status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.created_at + WINDOW_S,
                "request_counts": {"total": self.total, "completed": done, "failed": failed},
                "usage": {"input_tokens": tokens[0], "input_tokens_details": {"cached_tokens": tokens[1]},
                          "output_tokens": tokens[2], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": tokens[0] + tokens[2]},
                "metadata": self.metadata}
        for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                     "cancelling_at", "cancelled_at"):
            data[name] = times.get(name)
        return data
