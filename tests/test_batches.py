"""OpenAI's Files and Batch APIs (ssd.openai.files, ssd.openai.batches, ssd.openai.routes.batches)
and `ssd run-batch` (launch/run_batch.py), through the official `openai` client.

Exactness is the live path's: each line of a batch runs as the request it spells, so
its reply equals the same body sent live (text, finish reason, logprobs, usage), for
random chat and completion bodies in every mode (SSD where the seed fixes the output,
as in tests/test_http_random.py). A line with a bad field gets the live request's 400
in the error file; a file with a malformed line fails the batch whole, naming the
lines; a cancelled batch ends with every line accounted for and no row left running.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ssd.app import run_batch
from ssd.openai import batches
from ssd.openai.batch_disk import BatchJournal, FileDisk, load_batches
from ssd.openai.batches import Batch, BatchLine, read_lines
from ssd.openai.files import FileFull, FileStore
from ssd.openai.routes.batches import BatchRoutes, Running
from tests.test_http import ChatBackend, base_url, oai, serving
from tests.test_http import backend, client  # noqa: F401  (module fixtures: this module's own)
from tests.test_http_random import http, server  # noqa: F401  (the same)
from tests.test_http_random import SETTINGS, _choice, assert_same_output, draw_body, whole
from tests.test_serve import wait_until

ROOT = Path(__file__).resolve().parents[1]


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions", **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


# --- the pure parts ------------------------------------------------------------------


def test_a_file_s_lines_are_requests_and_its_bad_lines_are_named():
    good = line("a", {"model": "m"})
    lines, errors = read_lines(f"{good}\n\n{line('b', {})}\n".encode(), "/v1/chat/completions")
    assert [(x.line, x.custom_id) for x in lines] == [(1, "a"), (3, "b")] and errors == []
    bad = "\n".join([good, "{", "[1]", line("", {}), line("c", {}, method="GET"), line("d", {}, "/v1/completions"),
                     json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": 1}),
                     line("a", {}), line("f", {"stream": True}), line("g", {"background": True})])
    lines, errors = read_lines(bad.encode(), "/v1/chat/completions")
    assert [x.custom_id for x in lines] == ["a"]
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None), (3, "invalid_json_line", None), (4, "missing_required_parameter", "custom_id"),
        (5, "invalid_value", "method"), (6, "mismatched_endpoint", "url"), (7, "missing_required_parameter", "body"),
        (8, "duplicate_custom_id", "custom_id"), (9, "invalid_value", "body.stream"),
        (10, "invalid_value", "body.background")]
    assert read_lines(b"\n \n", "/v1/completions")[1][0]["code"] == "empty_file"
    assert read_lines(b"\xff", "/v1/completions")[1][0]["code"] == "invalid_file"


def test_too_many_lines_fail_the_file(monkeypatch):
    monkeypatch.setattr(batches, "MAX_LINES", 2)
    text = "\n".join(line(str(i), {}) for i in range(3))
    assert read_lines(text.encode(), "/v1/chat/completions")[1][0]["code"] == "too_many_requests"


def test_a_batch_counts_its_lines_sums_their_usage_and_writes_them_in_input_order():
    batch = Batch("batch_1", "/v1/chat/completions", "file-1", None, 3)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    batch.record(BatchLine(3, "c", {}), 200, {"id": "x", "usage": usage})
    batch.record(BatchLine(1, "a", {}), 200, {"id": "y", "usage": {"input_tokens": 1, "output_tokens": 7}})
    batch.record(BatchLine(2, "b", {}), 400, {"error": {"message": "no"}})
    public = batch.public()
    assert public["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert public["usage"]["input_tokens"] == 6 and public["usage"]["output_tokens"] == 9
    assert public["usage"]["input_tokens_details"]["cached_tokens"] == 4
    output, errors = batch.files()
    assert [json.loads(r)["custom_id"] for r in output.splitlines()] == ["a", "c"]
    assert json.loads(errors)["response"]["status_code"] == 400
    assert [json.loads(r)["custom_id"] for r in batch.every_line().splitlines()] == ["a", "b", "c"]
    assert json.loads(output.splitlines()[0])["response"]["request_id"] == "y"


def test_the_file_store_keeps_its_budget_and_forgets_expired_files():
    store = FileStore(10)
    kept = store.add("a.jsonl", "batch", b"12345678", None)
    with pytest.raises(FileFull):
        store.add("b.jsonl", "batch", b"123", None)
    gone = store.add("c.jsonl", "user_data", b"12", 0)  # expires at once
    assert store.get(gone.id) is None and store.get(kept.id) is kept and store.used == 8
    assert [f.id for f in store.listed("batch")] == [kept.id] and store.listed("user_data") == []
    assert store.delete(kept.id) and not store.delete(kept.id) and store.used == 0


def test_a_line_turned_away_while_busy_or_not_serving_waits_and_a_crash_is_its_500(monkeypatch):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from ssd.openai.routes import batches as http_batches
    from ssd.serve.options import ServeOptions

    monkeypatch.setattr(http_batches, "BUSY_RETRY_S", 0.001)
    app, calls = FastAPI(), []

    async def busy_then_done() -> JSONResponse:
        calls.append(1)
        return JSONResponse({"id": "x"}, status_code=(429, 503, 200)[min(len(calls), 3) - 1])

    async def crash() -> JSONResponse:
        raise RuntimeError("boom")

    app.add_api_route("/v1/completions", busy_then_done, methods=["POST"])
    app.add_api_route("/v1/chat/completions", crash, methods=["POST"])
    routes = BatchRoutes(ServeOptions(), lambda request: None, None, rows=lambda: 8)
    routes.app = app
    lines = [BatchLine(1, "a", {})]
    batch = Batch("batch_1", "/v1/completions", "file-1", None, 1)
    asyncio.run(routes.run(Running(batch, None), lines))
    assert len(calls) == 3 and batch.public()["request_counts"]["completed"] == 1 and batch.status == "completed"
    batch = Batch("batch_2", "/v1/chat/completions", "file-1", None, 1)
    asyncio.run(routes.run(Running(batch, None), lines))
    row = json.loads(batch.every_line())
    assert row["response"]["status_code"] == 500 and "boom" in row["response"]["body"]["error"]["message"]


def test_batch_concurrency_is_half_the_queue_and_leaves_a_row_unless_set_within_the_queue():
    from ssd.config import ConfigError
    from ssd.serve.options import ServeOptions

    assert ServeOptions(max_queue=16).batch_lines(rows=32) == 8 and ServeOptions(max_queue=1).batch_lines(8) == 1
    assert ServeOptions(max_queue=16).batch_lines(rows=8) == 7 and ServeOptions().batch_lines(rows=1) == 1
    assert ServeOptions(max_queue=16, batch_concurrency=12).batch_lines(rows=8) == 12
    for bad in (0, 17):
        with pytest.raises(ConfigError, match="batch_concurrency"):
            ServeOptions(max_queue=16, batch_concurrency=bad)
    with pytest.raises(ConfigError, match="stored_file_bytes"):
        ServeOptions(stored_file_bytes=-1)


# --- through the server ----------------------------------------------------------------


def upload(client: openai.OpenAI, rows: list[str]) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO("\n".join(rows).encode())), purpose="batch").id


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    ended = lambda: client.batches.retrieve(batch_id).status in ("completed", "failed", "cancelled")  # noqa: E731
    assert wait_until(ended, timeout), f"batch {batch_id} still running"
    return client.batches.retrieve(batch_id)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {row["custom_id"]: row for row in map(json.loads, text.splitlines())}


def gauges(server) -> dict[str, float]:
    text = httpx.get(base_url(server) + "/metrics").text
    return {family.name: family.samples[0].value for family in text_string_to_metric_families(text)
            if family.name.startswith(("ssd:batch", "ssd:files"))}


def random_lines(seed: int, count: int, path: str) -> list[tuple[str, dict[str, Any]]]:
    """Random bodies of one endpoint, each in a mode where its seed fixes its output."""
    rng, drawn = random.Random(seed), []
    while len(drawn) < count:
        where, body = draw_body(rng)
        if where != path:
            continue
        seeded = body["temperature"] == 0 or body.get("coupling") == "gumbel"
        mode = rng.choice(list(SETTINGS) if seeded else ["ar", "sd"])
        drawn.append((f"r{len(drawn)}", {**body, "speculation": {**SETTINGS[mode](body["speculation"]),
                                                                 "mode": mode}}))
    return drawn


def as_whole(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A batch reply's body in tests.test_http_random's terms (as `whole` reads a live one)."""
    return {"choices": {c["index"]: _choice(c, path) for c in body["choices"]}, "usage": body["usage"]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_each_line_s_reply_is_the_same_body_sent_live(client, http, path):
    drawn = random_lines(7 if "chat" in path else 8, 12, path)
    bad = {**drawn[0][1], "max_tokens": -3}
    rows = [line(cid, body, path) for cid, body in drawn] + [line("bad", bad, path)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint=path, completion_window="24h",
                                  metadata={"run": "t"})
    assert batch.status in ("validating", "in_progress", "completed") and batch.metadata == {"run": "t"}
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 12, 1)
    done, failed = results(client, batch.output_file_id), results(client, batch.error_file_id)
    for custom_id, body in drawn:
        reply = done[custom_id]["response"]
        assert reply["status_code"] == 200 and reply["request_id"] == reply["body"]["id"]
        assert_same_output(as_whole(path, reply["body"]), whole(http, path, body), (custom_id, body))
    error = failed["bad"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "max_tokens"
    assert batch.usage.output_tokens == sum(done[c]["response"]["body"]["usage"]["completion_tokens"]
                                            for c, _ in drawn)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_the_comparison_sees_a_line_run_without_one_of_its_fields(client, http, server, monkeypatch):
    routes: BatchRoutes = server.http.front.batches
    post = routes._post_line

    async def without_max_tokens(endpoint, body):
        return await post(endpoint, {k: v for k, v in body.items() if k != "max_tokens"})

    monkeypatch.setattr(routes, "_post_line", without_max_tokens)
    path = "/v1/completions"
    drawn = random_lines(8, 4, path)
    batch = client.batches.create(input_file_id=upload(client, [line(c, b, path) for c, b in drawn]),
                                  endpoint=path, completion_window="24h")
    done = results(client, finished(client, batch.id).output_file_id)
    with pytest.raises(AssertionError):
        for custom_id, body in drawn:
            assert_same_output(as_whole(path, done[custom_id]["response"]["body"]), whole(http, path, body), body)


def test_a_responses_batch_runs_the_responses_api(client):
    rows = [line(f"q{i}", {"model": "tiny", "input": text, "max_output_tokens": 6}, "/v1/responses")
            for i, text in enumerate(["abc", "bca", "cab"])]
    batch = finished(client, client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/responses",
                                                   completion_window="24h").id)
    done = results(client, batch.output_file_id)
    for i, text in enumerate(["abc", "bca", "cab"]):
        live = client.responses.create(model="tiny", input=text, max_output_tokens=6)
        assert done[f"q{i}"]["response"]["body"]["output"][0]["content"][0]["text"] == live.output_text
    assert batch.usage.input_tokens > 0


def test_a_file_with_a_malformed_line_fails_the_batch_and_names_the_line(client):
    rows = [line("a", {"model": "tiny", "prompt": "ab"}, "/v1/completions"), "{oops",
            line("b", {"model": "tiny", "prompt": "ab"}, "/v1/chat/completions")]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json_line"), (3, "mismatched_endpoint")]


def test_a_cancelled_batch_accounts_for_every_line_and_leaves_no_row_running(client, server):
    rows = [line(f"c{i}", {"model": "tiny", "prompt": "ab", "max_tokens": 400, "temperature": 0.9, "seed": i,
                           "ignore_eos": True}, "/v1/completions") for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                  completion_window="24h")
    running = gauges(server)
    assert running["ssd:batches_running"] == 1 and 0 < running["ssd:batch_lines_pending"] <= 40
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed + counts.failed == counts.total == 40 and counts.failed > 0
    failed = results(client, batch.error_file_id)
    assert all(row["error"]["code"] == "batch_cancelled" for row in failed.values())
    assert len(results(client, batch.output_file_id)) + len(failed) == 40
    assert wait_until(lambda: server._worker.counts == (0, 0), 10)
    after = gauges(server)
    assert after["ssd:batches_running"] == after["ssd:batch_lines_pending"] == 0
    assert after["ssd:files_stored_bytes"] == server.http.front.batches.files.used > 0
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is
    done = finished(client, client.batches.create(input_file_id=upload(client, rows[:1]), endpoint="/v1/completions",
                                                  completion_window="24h").id)
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.cancel(done.id)
    assert info.value.body["code"] == "batch_not_cancellable"


def test_batches_are_listed_newest_first(client):
    rows = [line("a", {"model": "tiny", "prompt": "ab", "max_tokens": 1}, "/v1/completions")]
    made = [client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                  completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_files_are_uploaded_listed_read_and_deleted(client):
    made = client.files.create(file=("notes.jsonl", io.BytesIO(b"{}\n")), purpose="user_data",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert (made.filename, made.bytes, made.purpose) == ("notes.jsonl", 3, "user_data")
    assert made.expires_at == made.created_at + 3600
    assert client.files.retrieve(made.id).id == made.id and client.files.content(made.id).content == b"{}\n"
    assert made.id in [f.id for f in client.files.list(purpose="user_data")]
    more = [client.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}")), purpose="user_data").id for i in range(21)]
    assert set(more) <= {f.id for f in client.files.list(purpose="user_data").data}  # OpenAI's: 10000 a page
    assert [f.id for f in client.files.list(purpose="user_data", limit=2, order="asc").data] == [made.id, more[0]]
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)


@pytest.mark.parametrize("fields, param", [
    ({"purpose": "fine-tune"}, "purpose"),
    ({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "5"},
     "expires_after.seconds"),
    ({"purpose": "batch", "expires_after[anchor]": "now", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
])
def test_a_bad_upload_field_gets_a_400_naming_it(http, fields, param):
    reply = http.post("/v1/files", data=fields, files={"file": ("a.jsonl", b"{}")})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_an_upload_that_is_no_form_or_has_no_file_is_refused(http):
    assert http.post("/v1/files", json={"purpose": "batch"}).json()["error"]["param"] == "body"
    assert http.post("/v1/files", data={"purpose": "batch"}).json()["error"]["param"] == "body"  # urlencoded
    reply = http.post("/v1/files", data={"purpose": "batch", "file": "text"}, files={"other": ("o.jsonl", b"{}")})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "file"


@pytest.mark.parametrize("fields, param, status", [
    ({"endpoint": "/v1/embeddings"}, "endpoint", 400),
    ({"completion_window": "1h"}, "completion_window", 400),
    ({"input_file_id": "file-nope"}, "input_file_id", 404),
    ({"metadata": {"k" * 65: "v"}}, "metadata.", 400),
    ({"output_expires_after": {"anchor": "created_at", "seconds": 10}}, "output_expires_after.seconds", 400),
    ({"speed": "fast"}, "speed", 400),
])
def test_a_bad_batch_field_gets_an_error_naming_it(client, http, fields, param, status):
    source = upload(client, [line("a", {"model": "tiny", "prompt": "ab"}, "/v1/completions")])
    body = {"input_file_id": source, "endpoint": "/v1/completions", "completion_window": "24h", **fields}
    reply = http.post("/v1/batches", json=body)
    assert reply.status_code == status and reply.json()["error"]["param"].startswith(param), reply.text


def test_a_batch_needs_a_batch_file_and_the_store_keeps_its_budget(client, http, server, monkeypatch):
    other = client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="user_data").id
    reply = http.post("/v1/batches", json={"input_file_id": other, "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_file_id"
    files = server.http.front.batches.files
    monkeypatch.setattr(files, "capacity", 4)  # no upload may be larger than the whole store
    reply = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"12345")})
    assert reply.status_code == 413 and reply.json()["error"]["param"] == "file"
    monkeypatch.setattr(files, "capacity", files.used + 70 * 1024)
    reply = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"1" * 69 * 1024)})
    assert reply.status_code == 200
    reply = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"1" * 2048)})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "file_store_full"


def test_batch_lines_carry_the_server_s_token(backend):  # noqa: F811
    with serving(lambda: ChatBackend(backend), token="secret") as running:
        client = oai(running, token="secret")
        rows = [line("a", {"model": "tiny", "prompt": "ab", "max_tokens": 3}, "/v1/completions")]
        batch = finished(client, client.batches.create(input_file_id=upload(client, rows),
                                                       endpoint="/v1/completions", completion_window="24h").id)
        assert batch.request_counts.completed == 1
        with pytest.raises(openai.AuthenticationError):
            oai(running, token="wrong").files.list()


def test_batch_lines_queue_behind_live_requests_which_keep_their_priority():
    from tests.test_serve_batching import FakeBackend

    fake = FakeBackend(max_rows=1, gate=threading.Event())
    admitted: list[int] = []
    make = fake.batch_engine

    def logging_seeds(mode):
        engine = make(mode)
        admit = engine.admit
        engine.admit = lambda request: (admitted.append(request.sampling.seed), admit(request))[1]
        return engine

    fake.batch_engine = logging_seeds
    with serving(lambda: fake) as server, ThreadPoolExecutor(4) as pool, \
            httpx.Client(base_url=base_url(server), timeout=60) as live:
        def send(seed: int, priority: int = 0):
            body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "seed": seed, "priority": priority}
            return pool.submit(live.post, "/v1/completions", json=body)

        def waiting(n: int) -> None:
            assert wait_until(lambda: server._worker.counts == (1, n), 20)

        first = send(100)
        waiting(0)
        client = oai(server)
        rows = [line(f"b{seed}", {"model": "tiny", "prompt": "ab", "max_tokens": 2, "seed": seed, "priority": -5},
                     "/v1/completions") for seed in (1, 2)]
        batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                      completion_window="24h")
        waiting(2)
        later = [send(3), send(4, priority=-1)]
        waiting(4)
        fake.gate.set()
        assert all(f.result().status_code == 200 for f in [first, *later])
        assert finished(client, batch.id).request_counts.completed == 2
    assert admitted == [100, 4, 3, 1, 2]  # live first (by priority), then the batch's lines


def test_a_batch_leaves_a_live_request_a_row():
    import dataclasses

    from tests.test_serve_batching import FakeBackend

    fake = FakeBackend(max_rows=3, gate=threading.Event())
    config = fake.info.defaults
    fake.info = dataclasses.replace(fake.info, defaults=dataclasses.replace(
        config, batching=dataclasses.replace(config.batching, max_rows=3)))
    with serving(lambda: fake) as server, httpx.Client(base_url=base_url(server), timeout=60) as live:
        client = oai(server)
        rows = [line(f"b{i}", {"model": "tiny", "prompt": "ab", "max_tokens": 2, "seed": i}, "/v1/completions")
                for i in range(6)]
        batch = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                      completion_window="24h")
        assert wait_until(lambda: server._worker.counts == (2, 0), 20)
        time.sleep(0.05)
        assert server._worker.counts == (2, 0)  # two lines of three rows, none queued
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(live.post, "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2})
            assert wait_until(lambda: server._worker.counts == (3, 0), 20)  # the live request took the free row
            fake.gate.set()
            assert reply.result().status_code == 200
        assert finished(client, batch.id).request_counts.completed == 6


def test_a_running_batch_is_found_and_cancelled_after_the_store_forgot_it(monkeypatch):
    from ssd.openai.routes import batches as http_batches
    from tests.test_serve_batching import FakeBackend

    monkeypatch.setattr(http_batches, "BATCHES_KEPT", 1)
    fake = FakeBackend(gate=threading.Event())
    with serving(lambda: fake) as server:
        client = oai(server)
        rows = [line("a", {"model": "tiny", "prompt": "ab", "max_tokens": 2}, "/v1/completions")]
        first = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                                      completion_window="24h")
        client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/completions",
                              completion_window="24h")  # the store keeps this one only
        assert wait_until(lambda: client.batches.retrieve(first.id).status == "in_progress", 20)  # its loop began it
        assert client.batches.cancel(first.id).status in ("cancelling", "cancelled")
        fake.gate.set()
        routes = server.http.front.batches
        assert wait_until(lambda: not routes.running, 20)
        with pytest.raises(openai.NotFoundError):  # ended: as forgotten as the store keeps it
            client.batches.retrieve(first.id)


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, "high", 1.5, None])
def test_a_priority_that_is_no_32_bit_integer_is_a_400_naming_it(http, value):
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/v1/responses", {"input": "ab"})):
        reply = http.post(path, json={"model": "tiny", "max_tokens" if "comp" in path else "max_output_tokens": 2,
                                      "priority": value, **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority", reply.text


# --- over a restart (--store-dir) ----------------------------------------------------------


def test_files_on_disk_come_back_and_expired_or_torn_ones_do_not(tmp_path):
    disk = FileDisk(tmp_path)
    store = FileStore(100, disk)
    kept = store.add("a.jsonl", "batch", b"abc", None)
    gone = store.add("b.jsonl", "batch", b"de", 3600)
    store.delete(gone.id)
    store.add("c.jsonl", "batch", b"f", 0)  # expired by the next start
    (tmp_path / "file-torn.json").write_text("{")
    again = FileStore(100, disk)
    again.restore(disk.load())
    assert [(f.id, f.content) for f in again.listed()] == [(kept.id, b"abc")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{kept.id}.data", f"{kept.id}.json"]


def test_a_journal_gives_the_batch_back_as_it_last_stood(tmp_path):
    batch = Batch("batch_j", "/v1/completions", "file-1", {"k": "v"}, 3)
    running = Running(batch, 3600, BatchJournal.start(tmp_path, batch, 3600))
    running.begin()
    running.row(2, batch.record(BatchLine(2, "b", {}), 200, {"id": "x", "usage": {"prompt_tokens": 4}}))
    running.row(3, batch.record(BatchLine(3, "c", {}), 400, {"error": {}}))
    with (tmp_path / "batch_j.jsonl").open("a") as torn:
        torn.write('{"kind": "row", "li')  # a crash mid-write
    [(back, lifetime, _)] = load_batches(tmp_path, 60)
    assert lifetime == 3600 and back.public() == {**batch.public(), "created_at": back.created_at}
    assert back.has(2) and back.has(3) and not back.has(1) and back.status == "in_progress"
    assert back.files() == batch.files()
    old = Batch("batch_old", "/v1/completions", "file-1", None, 1, created_at=int(time.time()) - 120)
    Running(old, None, BatchJournal.start(tmp_path, old, None)).move("completed")
    assert [b.id for b, _, _ in load_batches(tmp_path, 60)] == ["batch_j"]  # its files expired: its journal too
    assert not (tmp_path / "batch_old.jsonl").exists()


def _stored_at(backend, store_dir):  # noqa: F811
    return serving(lambda: ChatBackend(backend), store_dir=str(store_dir))


def test_a_batch_running_at_a_stop_goes_on_after_the_restart(backend, tmp_path):  # noqa: F811
    path = "/v1/completions"
    rows = [line(f"s{i}", {"model": "tiny", "prompt": "ab"[: 1 + i % 2], "max_tokens": 300, "ignore_eos": True,
                           "temperature": 0, "seed": i}, path) for i in range(24)]
    with _stored_at(backend, tmp_path) as first:
        client = oai(first)
        done_before = finished(client, client.batches.create(
            input_file_id=upload(client, rows[:2]), endpoint=path, completion_window="24h").id)
        batch = client.batches.create(input_file_id=upload(client, rows), endpoint=path, completion_window="24h")
        assert wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 60)
        before = client.batches.retrieve(batch.id)
    assert before.status == "in_progress" and 3 <= before.request_counts.completed < 24
    journal = [json.loads(r) for r in (tmp_path / "batches" / f"{batch.id}.jsonl").read_text().splitlines()]
    rows_before = {r["row"]["custom_id"]: r["row"] for r in journal if r["kind"] == "row"}
    assert all(r["response"]["status_code"] == 200 for r in rows_before.values())  # no line failed for the stop
    with _stored_at(backend, tmp_path) as second:
        client = oai(second)
        after = finished(client, batch.id)
        assert after.status == "completed" and after.request_counts.completed == 24
        out = results(client, after.output_file_id)
        assert sorted(out) == sorted(f"s{i}" for i in range(24)) and after.error_file_id is None
        assert all(out[cid] == row for cid, row in rows_before.items())  # what ran before stays as it was
        single = whole(httpx.Client(base_url=base_url(second), timeout=60), path, json.loads(rows[5])["body"])
        assert as_whole(path, out["s5"]["response"]["body"]) == single
        old = client.batches.retrieve(done_before.id)
        assert old.status == "completed" and len(results(client, old.output_file_id)) == 2


def test_a_batch_whose_input_file_is_gone_at_the_restart_fails(backend, tmp_path):  # noqa: F811
    path = "/v1/completions"
    rows = [line(f"s{i}", {"model": "tiny", "prompt": "ab", "max_tokens": 300, "ignore_eos": True}, path)
            for i in range(24)]
    with _stored_at(backend, tmp_path) as first:
        client = oai(first)
        source = upload(client, rows[:3])
        batch = client.batches.create(input_file_id=source, endpoint=path, completion_window="24h")
        client.files.delete(source)  # a running batch has its lines already
        assert finished(client, batch.id).status == "completed"
        second_source = upload(client, rows)
        running = client.batches.create(input_file_id=second_source, endpoint=path, completion_window="24h")
        client.files.delete(second_source)
        # validating until the batches' loop begins it; 24 lines of 300 tokens: still in_progress at the stop
        assert wait_until(lambda: client.batches.retrieve(running.id).status == "in_progress", 30)
    with _stored_at(backend, tmp_path) as second:
        after = oai(second).batches.retrieve(running.id)
        assert after.status == "failed" and after.errors.data[0].code == "input_file_gone"


# --- `ssd run-batch` (launch/run_batch.py) -----------------------------------------------


def test_run_batch_writes_each_line_s_reply_in_input_order(tmp_path, client):
    path = "/v1/completions"
    drawn = random_lines(9, 6, path)
    rows = [line(cid, body, path) for cid, body in drawn] + [line("bad", {"model": "tiny", "prompt": "a", "n": 0}, path)]
    (tmp_path / "in.jsonl").write_text("\n".join(rows))
    assert run_batch.main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           "--config", str(ROOT / "configs" / "tiny.yaml")]) == 0
    out = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [cid for cid, _ in drawn] + ["bad"]
    served = results(client, finished(client, client.batches.create(
        input_file_id=upload(client, rows), endpoint=path, completion_window="24h").id).output_file_id)
    for row, (cid, _) in zip(out, drawn):
        assert_same_output(as_whole(path, row["response"]["body"]),
                           as_whole(path, served[cid]["response"]["body"]), cid)
    assert out[-1]["response"]["status_code"] == 400 and out[-1]["response"]["body"]["error"]["param"] == "n"


def test_run_batch_refuses_a_malformed_file_naming_the_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(line("a", {}, "/v1/completions") + "\nnot json\n")
    assert run_batch.main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           "--config", str(ROOT / "configs" / "tiny.yaml")]) == 2
    assert "in.jsonl:2: not valid JSON" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()
