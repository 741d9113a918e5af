"""OpenAI's Conversations API (ssd.openai.routes.conversations) through the official `openai`
client: create, retrieve, update, delete, and items listed, added, retrieved and deleted;
a response that names a conversation starts from its items and adds its input and output.

Exactness is the chat path's, as for previous_response_id: each turn's text equals the
engine's greedy text for the whole chat the conversation holds. Random chats (text turns,
function calls and their outputs, modes) continued through either equal the same turns
with the history sent by hand.
"""

from __future__ import annotations

import contextlib
import random

import httpx
import openai
import pytest

from ssd.openai.stored import Conversation, Kept
from tests.test_http import base_url, oai, serving
from tests.test_openai_api import ToolTemplate, wide  # noqa: F401 - the fixture
from tests.test_responses_api import FUNCTIONS, expected


def test_a_conversation_adds_removes_and_snapshots_items():
    conversation = Conversation("conv_1", 0, {})
    conversation.add([{"id": "a"}, {"id": "b"}])
    before = conversation.snapshot()
    conversation.add([{"id": "c"}])
    assert [i["id"] for i in before] == ["a", "b"] and conversation.item("c") == {"id": "c"}
    assert conversation.remove("b") and not conversation.remove("b")
    assert [i["id"] for i in conversation.snapshot()] == ["a", "c"] and conversation.item("b") is None
    kept = Kept(1)
    kept.keep("x", conversation)
    kept.keep("y", Conversation("conv_2", 0, {}))
    assert kept.get("x") is None and kept.get("y").id == "conv_2"


def _texts(items) -> list[tuple[str, str]]:
    return [(item.role, item.content[0].text) for item in items]


def test_turns_in_a_conversation_are_the_whole_chats_output(wide):
    srv, backend = wide
    client = oai(srv)
    conversation = client.conversations.create(items=[{"role": "user", "content": "abc"}], metadata={"who": "t"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"who": "t"}
    first = client.responses.create(model="tiny", input="more", conversation=conversation.id, max_output_tokens=8)
    chat = [{"role": "user", "content": "abc"}, {"role": "user", "content": "more"}]
    assert first.output_text == expected(backend, chat, max_new=8) and first.conversation.id == conversation.id
    chat.append({"role": "assistant", "content": first.output_text})
    items = client.conversations.items.list(conversation.id, order="asc")
    assert _texts(items.data) == [(m["role"], m["content"]) for m in chat]
    second = client.responses.create(model="tiny", input=[{"role": "user", "content": "end"}], store=False,
                                     conversation={"id": conversation.id}, max_output_tokens=8)
    chat.append({"role": "user", "content": "end"})
    assert second.output_text == expected(backend, chat, max_new=8)
    assert len(client.conversations.items.list(conversation.id).data) == 5  # store=False still joins it


def test_items_are_added_retrieved_and_deleted_and_the_conversation_updated_and_deleted(wide):
    srv, _ = wide
    client = oai(srv)
    conversation = client.conversations.create(items=[{"role": "user", "content": "a"}])
    added = client.conversations.items.create(conversation.id, items=[
        {"role": "assistant", "content": "b"}, {"type": "message", "role": "user", "content": "c"}])
    assert _texts(added.data) == [("assistant", "b"), ("user", "c")] and not added.has_more
    listed = client.conversations.items.list(conversation.id)
    assert _texts(listed.data) == [("user", "c"), ("assistant", "b"), ("user", "a")]  # newest first
    one = client.conversations.items.list(conversation.id, order="asc", limit=1, after=listed.data[-1].id)
    assert _texts(one.data) == [("assistant", "b")] and one.has_more
    found = client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    assert found.id == added.data[0].id
    after = client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
    assert after.id == conversation.id
    assert _texts(client.conversations.items.list(conversation.id, order="asc").data) == [("user", "a"), ("user", "c")]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
    updated = client.conversations.update(conversation.id, metadata={"k": "v"})
    assert updated.metadata == {"k": "v"} == client.conversations.retrieve(conversation.id).metadata
    kept = _conversations_stored(srv)
    assert client.conversations.delete(conversation.id).deleted
    assert _conversations_stored(srv) == kept - 1 >= 0
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", input="x", conversation=conversation.id)
    assert info.value.body["param"] == "conversation" and info.value.body["code"] == "conversation_not_found"


def _conversations_stored(srv) -> float:
    lines = httpx.get(base_url(srv) + "/metrics").text.splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("ssd:conversations_stored "))


@pytest.mark.parametrize("method, path, body, param", [
    ("post", "", {"items": [{"role": "user", "content": "a"}] * 21}, "items"),
    ("post", "", {"items": [{"role": "robot", "content": "a"}]}, "items[0].role"),
    ("post", "", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("post", "", {"metadata": {"k": "v" * 513}}, "metadata.k"),
    ("post", "", {"colour": "red"}, "colour"),
    ("post", "/{id}", {}, "metadata"),
    ("post", "/{id}/items", {"items": []}, "items"),
    ("get", "/{id}/items?limit=0", None, "limit"),
    ("get", "/{id}/items?order=up", None, "order"),
    ("get", "/{id}/items?after=msg_none", None, "after"),
])
def test_bad_requests_name_the_field(wide, method, path, body, param):
    srv, _ = wide
    made = oai(srv).conversations.create()
    url = base_url(srv) + "/v1/conversations" + path.format(id=made.id)
    reply = httpx.post(url, json=body) if method == "post" else httpx.get(url)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_response_names_a_conversation_or_a_previous_response_not_both(wide):
    srv, _ = wide
    client = oai(srv)
    made = client.responses.create(model="tiny", input="abc", max_output_tokens=2)
    conversation = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", conversation=conversation.id, previous_response_id=made.id)
    assert info.value.body["param"] == "conversation"
    assert client.conversations.items.list(conversation.id).data == []  # a refused request adds nothing


def test_a_server_that_keeps_no_conversations_says_so(wide):
    _, backend = wide
    with serving(lambda: ToolTemplate(backend), stored_conversations=0) as srv:
        reply = httpx.post(base_url(srv) + "/v1/conversations", json={})
        assert reply.status_code == 400 and "--stored-conversations" in reply.json()["error"]["message"]


def test_streamed_and_background_responses_join_the_conversation_when_they_finish(wide):
    from tests.test_stored_responses import _polled

    srv, _ = wide
    client = oai(srv)
    conversation = client.conversations.create()
    events = list(client.responses.create(model="tiny", input="abc", max_output_tokens=6, stream=True,
                                          conversation=conversation.id))
    streamed = events[-1].response
    queued = client.responses.create(model="tiny", input="def", max_output_tokens=6, background=True,
                                     conversation=conversation.id)
    done = _polled(client, queued.id)
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert (items[1].id, items[3].id) == (streamed.output[0].id, done.output[0].id)
    assert _texts(items) == [("user", "abc"), ("assistant", streamed.output_text),
                             ("user", "def"), ("assistant", done.output_text)]


# --- random chats: continued by the server, against the history sent by hand ---------------------


def chat_chain(client, seed: int) -> None:
    """A random chat of 2-4 turns (text turns, forced function calls answered with their
    output, modes per turn), continued through `previous_response_id` or a `conversation`:
    each turn's output equals the same turn with the whole history sent by hand."""
    rng = random.Random(seed)
    via = rng.choice(["previous_response_id", "conversation"])
    conversation = client.conversations.create().id if via == "conversation" else None
    history: list[dict] = []
    previous = None
    for _ in range(rng.randint(2, 4)):
        turn = {"model": "tiny", "max_output_tokens": rng.randint(2, 12),
                "extra_body": {"speculation": {"mode": rng.choice(["ar", "sd", "ssd"])}}}
        if rng.random() < 0.3:
            turn.update(tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_weather"},
                        max_output_tokens=200, parallel_tool_calls=False)
        new = [{"role": "user", "content": "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 6)))}]
        if history and history[-1].get("type") == "function_call":  # the call's output comes first
            new.insert(0, {"type": "function_call_output", "call_id": history[-1]["call_id"], "output": "sunny"})
        continued = {"previous_response_id": previous} if via == "previous_response_id" and previous else {}
        if conversation is not None:
            continued = {"conversation": conversation}
        reply = client.responses.create(input=new, **continued, **turn)
        by_hand = client.responses.create(input=history + new, store=False, **turn)
        assert reply.output_text == by_hand.output_text, (seed, via, len(history))
        assert [item.type for item in reply.output] == [item.type for item in by_hand.output], (seed, via)
        history += new + [item.model_dump(exclude_none=True) for item in reply.output]
        previous = reply.id


CHAIN_SEEDS = range(8)


def test_random_chats_continued_by_the_server_equal_their_history_sent_by_hand(wide):
    client = oai(wide[0])
    for seed in CHAIN_SEEDS:
        chat_chain(client, seed)


def test_the_chats_see_a_server_that_forgets_the_oldest_item(wide, monkeypatch):
    """Power: continuing from all but the first item (of a stored response's or a
    conversation's) parts the turns from the history sent by hand."""
    from ssd.openai import stored

    monkeypatch.setattr(stored.StoredResponse, "conversation",
                        property(lambda self: (self.earlier + self.input_items + self.response["output"])[1:]))
    monkeypatch.setattr(stored.Conversation, "snapshot", lambda self: list(self.items)[1:])
    client = oai(wide[0])
    for via in ("previous_response_id", "conversation"):
        seeds = [s for s in CHAIN_SEEDS if random.Random(s).choice(["previous_response_id", "conversation"]) == via]
        with pytest.raises(AssertionError):
            for seed in seeds:
                chat_chain(client, seed)


def test_truncation_auto_drops_the_oldest_turns_past_the_message_cap(wide):
    """A conversation grown past --max-chat-messages (256) by the official client, 20 items at a
    time: truncation "auto" drops its oldest turns until both the cap and the context fit, and
    the output is the engine's for that chat; without truncation, a 400 naming `conversation`
    (not the gRPC field `chat`). A server with a cap of 16 keeps the last 16 messages: the cap
    alone decides where the chat fits the context whole."""
    srv, backend = wide
    template = ToolTemplate(backend)

    def grown(client, items: int):
        conversation = client.conversations.create()
        for _ in range(items // 20):
            client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "ab"}] * 20)
        return conversation.id, [{"role": "user", "content": "ab"}] * items + [{"role": "user", "content": "abc"}]

    for server, items, cap in ((srv, 300, 256), (None, 40, 16)):
        with (serving(lambda: ToolTemplate(backend), max_chat_messages=cap) if server is None
              else contextlib.nullcontext(server)) as live:
            client = oai(live)
            limit = client.models.retrieve("tiny").model_extra["max_model_len"]
            conversation, chat = grown(client, items)
            with pytest.raises(openai.BadRequestError) as info:
                client.responses.create(model="tiny", input="abc", conversation=conversation, max_output_tokens=8)
            error = info.value.body
            assert error["param"] == "conversation" and f"at most {cap} messages" in error["message"], error
            reply = client.responses.create(model="tiny", input="abc", conversation=conversation, max_output_tokens=8,
                                            truncation="auto")
            kept = next(chat[i:] for i in range(len(chat))
                        if len(chat) - i <= cap and len(template.apply_chat(chat[i:])) + 8 <= limit)
            assert reply.output_text == expected(backend, kept, max_new=8)
            assert reply.usage.input_tokens == len(template.apply_chat(kept))
            assert (len(kept) == cap) == (server is None)  # the small cap binds before the context
