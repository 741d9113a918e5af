"""Stored responses: OpenAI's `store`, `previous_response_id`, GET/DELETE /v1/responses/{id}
and its input_items, through the official `openai` client.

A response that names an earlier one as previous_response_id is that response's
conversation (its earlier items, its input, its output) followed by its own
input, so exactness is the chat path's: each turn's text equals the engine's
greedy text for the whole chat, the same as sending the history by hand. The
store itself (ssd.openai.stored) is tested pure first.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import openai
import pytest

from ssd.openai.stored import ResponseStore, StoredResponse, input_items, page
from tests.test_http import base_url, oai, serving
from tests.test_openai_api import ToolTemplate, wide  # noqa: F401 - the fixture
from tests.test_responses_api import ASK, FUNCTIONS, answered_chat, expected
from tests.test_serve import ControlledBackend


def _stored(response_id: str, text: str = "hi") -> StoredResponse:
    output = [{"type": "message", "id": "msg_" + response_id, "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return StoredResponse({"id": response_id, "output": output}, input_items("q " + response_id))


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for name in "abc":
        store.put(_stored(name))
    assert store.get("a") is None and len(store) == 2  # the oldest went first
    store.get("b")  # now b is the most recently used: c goes next
    store.put(_stored("d"))
    assert store.get("c") is None and store.get("b") is not None and store.get("d") is not None
    assert store.delete("b") and not store.delete("b") and store.get("b") is None
    off = ResponseStore(0)
    off.put(_stored("x"))
    assert off.get("x") is None and len(off) == 0


def test_a_conversation_is_earlier_items_then_input_then_output():
    first = _stored("a", "one")
    second = StoredResponse({"id": "b", "output": [{"type": "message", "role": "assistant", "content": "two"}]},
                            input_items([{"role": "user", "content": "again"}]), first.conversation)
    texts = [item["content"][0]["text"] if isinstance(item["content"], list) else item["content"]
             for item in second.conversation]
    assert texts == ["q a", "one", "again", "two"]
    assert all(a is b for a, b in zip(second.conversation, first.conversation))  # shared, not copied


def test_input_items_get_ids_and_content_parts():
    items = input_items([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "id": "msg_1"},
                         {"type": "function_call_output", "call_id": "c", "output": "o", "id": None}])
    assert [item["content"][0]["type"] for item in items[:2]] == ["input_text", "output_text"]
    assert items[1]["id"] == "msg_1" and items[0]["id"].startswith("msg_") and items[2]["id"].startswith("fco_")
    assert items[0]["status"] == "completed" and "status" not in items[2]
    assert input_items("hello")[0]["content"] == [{"type": "input_text", "text": "hello"}]


def test_pages_follow_order_limit_and_cursor():
    items = [{"id": str(i)} for i in range(5)]
    assert [i["id"] for i in page(items)["data"]] == ["4", "3", "2", "1", "0"]
    first = page(items, "asc", 2)
    assert [i["id"] for i in first["data"]] == ["0", "1"] and first["has_more"] and first["last_id"] == "1"
    rest = page(items, "asc", 10, after=first["last_id"])
    assert [i["id"] for i in rest["data"]] == ["2", "3", "4"] and not rest["has_more"]
    assert page(items, "desc", 2, after="0")["data"] == [] and page([], "asc")["first_id"] is None
    with pytest.raises(KeyError):
        page(items, after="9")


# --- over HTTP ----------------------------------------------------------------------------------


def _text_of(reply) -> dict:
    return {"role": "assistant", "content": reply.output_text}


def test_turns_through_previous_response_id_are_the_whole_chats_output(wide):
    srv, backend = wide
    client = oai(srv)
    first = client.responses.create(model="tiny", input="abc", instructions="be brief", max_output_tokens=8)
    assert first.store and first.previous_response_id is None
    second = client.responses.create(model="tiny", input="more", previous_response_id=first.id, max_output_tokens=8)
    # The earlier instructions are not carried over (OpenAI's rule): no system message now.
    chat = [{"role": "user", "content": "abc"}, _text_of(first), {"role": "user", "content": "more"}]
    assert second.output_text == expected(backend, chat, max_new=8) and second.previous_response_id == first.id
    third = client.responses.create(model="tiny", input=[{"role": "user", "content": "end"}], instructions="x",
                                    previous_response_id=second.id, max_output_tokens=8)
    chat = [{"role": "system", "content": "x"}] + chat + [_text_of(second), {"role": "user", "content": "end"}]
    assert third.output_text == expected(backend, chat, max_new=8)
    by_hand = client.responses.create(model="tiny", instructions="x", max_output_tokens=8, store=False, input=[
        {"role": "user", "content": "abc"}, first.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "more"}, second.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "end"}])
    assert by_hand.output_text == third.output_text
    assert third.usage.input_tokens == by_hand.usage.input_tokens


def test_a_function_calls_output_goes_back_by_previous_response_id(wide):
    srv, backend = wide
    client = oai(srv)
    asked = client.responses.create(model="tiny", input=ASK, tools=FUNCTIONS, max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    [call] = asked.output
    answer = client.responses.create(
        model="tiny", previous_response_id=asked.id, tools=FUNCTIONS, tool_choice="none", max_output_tokens=12,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.output_text == expected(backend, answered_chat(call))


def test_a_stored_response_is_retrieved_listed_and_deleted(wide):
    srv, _ = wide
    client = oai(srv)
    made = client.responses.create(model="tiny", input=[{"role": "developer", "content": "d"},
                                                        {"role": "user", "content": "abc"}], max_output_tokens=6)
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    listed = client.responses.input_items.list(made.id, order="asc")
    assert [(item.role, item.content[0].text) for item in listed.data] == [("developer", "d"), ("user", "abc")]
    assert [i.id for i in client.responses.input_items.list(made.id).data] == [i.id for i in listed.data][::-1]
    one = client.responses.input_items.list(made.id, order="asc", limit=1)
    assert one.has_more and one.data[0].id == listed.data[0].id
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", input="x", previous_response_id=made.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_a_streamed_response_is_stored_as_its_last_event_shows_it(wide):
    srv, _ = wide
    client = oai(srv)
    events = list(client.responses.create(model="tiny", input="abc", max_output_tokens=6, stream=True))
    final = events[-1].response
    assert events[0].response.store and client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_store_false_is_not_kept(wide):
    srv, _ = wide
    client = oai(srv)
    made = client.responses.create(model="tiny", input="abc", max_output_tokens=4, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


@pytest.mark.parametrize("path, param", [
    ("/input_items?order=up", "order"), ("/input_items?limit=0", "limit"), ("/input_items?limit=101", "limit"),
    ("/input_items?after=msg_none", "after"),
])
def test_bad_queries_name_the_parameter(wide, path, param):
    srv, _ = wide
    made = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=2)
    reply = httpx.get(base_url(srv) + f"/v1/responses/{made.id}{path}")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_server_that_stores_nothing_refuses_store_true(wide):
    _, backend = wide
    with serving(lambda: ToolTemplate(backend), stored_responses=0) as srv:
        made = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=2)
        assert made.store is False
        reply = httpx.post(base_url(srv) + "/v1/responses", json={"model": "tiny", "input": "a", "store": True})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "store"


# --- background responses ------------------------------------------------------------------------


def _polled(client, response_id: str, until: tuple[str, ...] = ("completed", "incomplete", "failed", "cancelled")):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = client.responses.retrieve(response_id)
        if found.status in until:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{response_id} never reached {until}")


def test_a_background_response_answers_queued_then_is_polled_to_the_same_output(wide):
    srv, _ = wide
    client = oai(srv)
    queued = client.responses.create(model="tiny", input="abc", max_output_tokens=10, background=True)
    assert queued.background and queued.status in ("queued", "in_progress") and queued.output == []
    done = _polled(client, queued.id)
    plain = client.responses.create(model="tiny", input="abc", max_output_tokens=10, store=False)
    assert done.status == "incomplete" and done.output_text == plain.output_text and done.background
    assert done.usage == plain.usage
    later = client.responses.create(model="tiny", input="x", previous_response_id=done.id, max_output_tokens=4)
    assert later.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as info:  # it ended: nothing to cancel
        client.responses.cancel(done.id)
    assert info.value.body["code"] == "response_not_cancellable"
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(later.id)


def test_a_cancelled_background_response_stops_and_stays_cancelled(wide):
    _, backend = wide
    gate = threading.Event()  # the engine's steps wait here: the response cannot end before the cancel
    with serving(lambda: ControlledBackend(ToolTemplate(backend), gate=gate)) as srv:
        client = oai(srv)
        queued = client.responses.create(model="tiny", input="abc", max_output_tokens=50, background=True)
        gauges = _gauges(srv)
        assert gauges["ssd:responses_background_running"] == 1 and gauges["ssd:responses_stored"] >= 1
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and cancelled.id == queued.id and cancelled.output == []
        assert client.responses.cancel(queued.id).status == "cancelled"  # again: the same answer
        with pytest.raises(openai.BadRequestError) as info:  # nothing to go on from
            client.responses.create(model="tiny", input="x", previous_response_id=queued.id)
        assert info.value.body["param"] == "previous_response_id" and "cancelled" in info.value.body["message"]
        gate.set()
        deadline = time.monotonic() + 30
        while srv_running(srv) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.responses.retrieve(queued.id).status == "cancelled"
        assert _gauges(srv)["ssd:responses_background_running"] == 0
        events = _events(httpx.get(base_url(srv) + f"/v1/responses/{queued.id}", params={"stream": "true"}))
        assert events[0]["type"] == "response.created" and events[-1]["code"] == "cancelled"
        assert client.responses.create(model="tiny", input="abc", max_output_tokens=3).status == "incomplete"


def test_a_background_response_deleted_while_it_runs_stops_and_stays_deleted(wide):
    """Its run would otherwise store it again (in_progress, then completed) as it goes."""
    _, backend = wide
    gate = threading.Event()
    with serving(lambda: ControlledBackend(ToolTemplate(backend), gate=gate)) as srv:
        client = oai(srv)
        queued = client.responses.create(model="tiny", input="abc", max_output_tokens=50, background=True)
        client.responses.delete(queued.id)
        gate.set()
        deadline = time.monotonic() + 30
        while srv_running(srv) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not srv_running(srv)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(queued.id)
        reply = httpx.get(base_url(srv) + f"/v1/responses/{queued.id}", params={"stream": "true"})
        assert reply.status_code == 404, reply.text  # its events went with it
        assert _gauges(srv)["ssd:responses_stored"] == 0


def test_an_ended_background_responses_events_go_when_it_is_deleted(wide):
    srv, _ = wide
    client = oai(srv)
    queued = client.responses.create(model="tiny", input="abc", max_output_tokens=4, background=True)
    _polled(client, queued.id)
    url = base_url(srv) + f"/v1/responses/{queued.id}"
    assert httpx.get(url, params={"stream": "true"}).status_code == 200
    client.responses.delete(queued.id)
    assert httpx.get(url, params={"stream": "true"}).status_code == 404


def _gauges(srv) -> dict[str, float]:
    """The Responses gauges on /metrics."""
    text = httpx.get(base_url(srv) + "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("ssd:responses_")}


def srv_running(srv) -> bool:
    """Whether a background response still runs on the server's HTTP front end."""
    return bool(srv.http.front.responses.running)


def test_a_failed_background_response_is_stored_with_its_error(wide):
    _, backend = wide
    with serving(lambda: ControlledBackend(ToolTemplate(backend), fail_after_rounds=2)) as srv:
        client = oai(srv)
        queued = client.responses.create(model="tiny", input="abc", max_output_tokens=20, background=True)
        failed = _polled(client, queued.id)
        assert failed.status == "failed" and failed.error.code == "generation_failed"
        assert "injected engine fault" in failed.error.message


def test_background_needs_store(wide):
    reply = httpx.post(base_url(wide[0]) + "/v1/responses",
                       json={"model": "tiny", "input": "a", "background": True, "store": False})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "background", reply.text


def _events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in reply.text.splitlines() if line.startswith("data: ")]


def test_a_streamed_background_response_is_read_again_from_any_sequence_number(wide):
    """background + stream: the POST streams the events; a reader that left comes back with
    GET ?stream=true&starting_after=N and gets the rest, the same events; the stored response
    is the stream's last. A reader leaving does not stop the response."""
    srv, _ = wide
    body = {"model": "tiny", "input": "abc", "max_output_tokens": 12, "background": True, "stream": True}
    whole = _events(httpx.post(base_url(srv) + "/v1/responses", json=body, timeout=60))
    assert whole[0]["type"] == "response.created" and whole[-1]["type"] == "response.incomplete"
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    response_id = whole[0]["response"]["id"]
    url = base_url(srv) + f"/v1/responses/{response_id}"
    rest = _events(httpx.get(url, params={"stream": "true", "starting_after": 3}, timeout=60))
    assert rest == whole[4:]
    stored = httpx.get(url).json()
    assert stored == whole[-1]["response"] and stored["background"] and stored["output"][0]["content"][0]["text"]
    with httpx.stream("POST", base_url(srv) + "/v1/responses", json=body, timeout=60) as early:
        first = next(line for line in early.iter_lines() if line.startswith("data: "))  # then leave
    left_id = json.loads(first.removeprefix("data: "))["response"]["id"]
    assert _polled(oai(srv), left_id).status == "incomplete"  # it ran to its end without a reader
    bad = httpx.get(url, params={"stream": "true", "starting_after": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    plain = oai(srv).responses.create(model="tiny", input="abc", max_output_tokens=2)
    unstreamable = httpx.get(base_url(srv) + f"/v1/responses/{plain.id}", params={"stream": "true"})
    assert unstreamable.status_code == 400 and unstreamable.json()["error"]["param"] == "stream"


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits(wide):
    """A stored conversation past the context: truncation "disabled" (the default) is a 400
    naming input; "auto" drops whole user turns from the start, as few as fit the prompt and
    max_output_tokens, and the output is the engine's for exactly that shorter chat."""
    srv, backend = wide
    client, out = oai(srv), 8
    limit = client.models.retrieve("tiny").model_extra["max_model_len"]
    said = ["[" + "a" * 170 + "]", "{" + "b" * 170 + "}", "[" + "c" * 170 + "]", "abc"]
    chat, last = [], None
    for text in said[:-1]:
        reply = client.responses.create(model="tiny", input=text, previous_response_id=last, max_output_tokens=out,
                                        truncation="auto")
        chat += [{"role": "user", "content": text}, _text_of(reply)]
        last = reply.id
    chat.append({"role": "user", "content": said[-1]})
    template = ToolTemplate(backend)
    assert len(template.apply_chat(chat)) + out > limit  # the whole chat does not fit
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=said[-1], previous_response_id=last, max_output_tokens=out)
    assert info.value.body["param"] == "input"
    fitted = client.responses.create(model="tiny", input=said[-1], previous_response_id=last, max_output_tokens=out,
                                     truncation="auto")
    kept = next(chat[i:] for i in range(0, len(chat), 2) if len(template.apply_chat(chat[i:])) + out <= limit)
    assert 2 < len(kept) < len(chat) and fitted.truncation == "auto"
    assert fitted.output_text == expected(backend, kept, max_new=out)
    assert fitted.usage.input_tokens == len(template.apply_chat(kept))


# --- --store-dir: stored responses and conversations outlive a restart ---------------------------


def test_dumped_stores_load_back_in_order_with_shared_items_shared():
    from ssd.openai.stored import Conversation, Kept, dump_stores, load_stores

    responses, conversations = ResponseStore(8), Kept(8)
    first = _stored("a", "one")
    second = StoredResponse({"id": "b", "output": []}, input_items("again"), first.conversation)
    responses.put(first)
    responses.put(second)
    responses.get("a")  # now b is the least recently used
    conversations.keep("conv_1", Conversation("conv_1", 5, {"k": "v"}, input_items("x")))
    data = json.loads(json.dumps(dump_stores(responses, conversations)))
    assert len(data["items"]) == 3  # a's input, b's input, and a's output (in b's earlier), each once
    again, talks = ResponseStore(8), Kept(8)
    load_stores(data, again, talks)
    assert [r.response["id"] for r in again.values()] == ["b", "a"]
    assert again.get("b").conversation == second.conversation and again.get("a").input_items == first.input_items
    assert again.get("b").earlier[0] is again.get("a").input_items[0]  # shared again
    assert talks.get("conv_1").public() == conversations.get("conv_1").public()
    assert talks.get("conv_1").snapshot() == conversations.get("conv_1").snapshot()
    with pytest.raises(ValueError):
        load_stores({"format": 2}, ResponseStore(1), Kept(1))


def test_stored_responses_and_conversations_outlive_a_restart_with_store_dir(wide, tmp_path):
    _, backend = wide
    with serving(lambda: ToolTemplate(backend), store_dir=str(tmp_path)) as srv:
        client = oai(srv)
        first = client.responses.create(model="tiny", input="abc", max_output_tokens=6)
        conversation = client.conversations.create(items=[{"role": "user", "content": "hi"}], metadata={"a": "b"})
        client.responses.create(model="tiny", input="more", conversation=conversation.id, max_output_tokens=4)
        items = client.conversations.items.list(conversation.id).model_dump()
    assert (tmp_path / "responses.json").exists()
    with serving(lambda: ToolTemplate(backend), store_dir=str(tmp_path)) as srv:
        client = oai(srv)
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert client.conversations.items.list(conversation.id).model_dump() == items
        assert client.conversations.retrieve(conversation.id).metadata == {"a": "b"}
        later = client.responses.create(model="tiny", input="go on", previous_response_id=first.id,
                                        max_output_tokens=6)
        chat = [{"role": "user", "content": "abc"}, _text_of(first), {"role": "user", "content": "go on"}]
        assert later.output_text == expected(backend, chat, max_new=6)


def test_an_unreadable_store_file_is_logged_and_the_server_starts_empty(wide, tmp_path, caplog):
    _, backend = wide
    (tmp_path / "responses.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="ssd.openai.store_file"):
        with serving(lambda: ToolTemplate(backend), store_dir=str(tmp_path)) as srv:
            with pytest.raises(openai.NotFoundError):
                oai(srv).responses.retrieve("resp_none")
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "responses.json").read_text())["format"] == 1  # rewritten at the stop


def test_the_stores_are_written_while_they_change_so_a_crash_keeps_them(wide, tmp_path, monkeypatch):
    from ssd.openai import store_file

    monkeypatch.setattr(store_file, "STORE_WRITE_S", 0.05)
    _, backend = wide
    with serving(lambda: ToolTemplate(backend), store_dir=str(tmp_path)) as srv:
        client = oai(srv)
        made = client.responses.create(model="tiny", input="abc", max_output_tokens=4)
        conversation = client.conversations.create()
        client.conversations.update(conversation.id, metadata={"k": "v"})

        def written() -> dict:
            try:
                return json.loads((tmp_path / "responses.json").read_text())
            except (OSError, ValueError):
                return {}

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = written()
            if any(r["response"]["id"] == made.id for r in data.get("responses", [])) and \
                    [c["metadata"] for c in data["conversations"]] == [{"k": "v"}]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"not written while serving: {written()}")
