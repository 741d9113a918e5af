"""Stored responses and conversations: OpenAI's `store`, `previous_response_id` and
`conversation` on the Responses API, and its Conversations API.

A finished response is kept with the conversation it ended: the items of the
responses it continued, its own input items and its output items. A later
request that names it as `previous_response_id` is that conversation followed
by its own input, so a chat goes on without sending its history again (and
the prefix cache, ssd.engine.prefix, serves the history's prompt chunks).
As on OpenAI, an earlier response's instructions are not carried over.

A conversation is a list of items that a response naming it starts from, and
to which its input and output items are added once it finishes (completed or
incomplete), as on OpenAI; its items can also be added, listed and deleted.

Both stores are the HTTP front end's memory: bounded by a count of responses
or conversations, least recently used out first, gone with the process (vLLM
keeps its Responses store in memory too) unless the server writes them out
while they change and at its stop, and reads them back at its start
(`dump_stores`, `load_stores`; --store-dir). No model, no I/O: testable in milliseconds.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class StoredResponse:
    """One response and its conversation. Read-only once stored: a chat's responses share their
    earlier items (the same dicts), so a long chat's store grows with its items, not their square."""

    response: dict[str, Any]  # the Response object, as the request returned it
    input_items: list[dict[str, Any]]  # its own input, as items with ids (GET .../input_items)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # the conversation before its input

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues this one starts from: earlier items, input, output."""
        return self.earlier + self.input_items + self.response["output"]


class Kept(Generic[T]):
    """Values by id, at most `capacity` of them, least recently used out first; thread-safe
    (handlers run on a pool)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()
        self.version = 0  # counts the keeps and deletes: what is kept has changed since a reader saw it

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: str, value: T) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self.version += 1
            self._kept[key] = value
            self._kept.move_to_end(key)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, key: str) -> T | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._kept.get(key)
            if value is not None:
                self._kept.move_to_end(key)
            return value

    def delete(self, key: str) -> bool:
        with self._lock:
            self.version += 1
            return self._kept.pop(key, None) is not None

    def values(self) -> list[T]:
        """Every value, least recently used first (keep() them in this order to restore it)."""
        with self._lock:
            return list(self._kept.values())


class ResponseStore(Kept[StoredResponse]):
    """Stored responses by id (read one, never change it)."""

    def put(self, stored: StoredResponse) -> None:
        self.keep(stored.response["id"], stored)


@dataclass
class Conversation:
    """OpenAI's conversation: items that responses naming it start from and add to."""

    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    version: int = field(default=0, compare=False)  # counts its changes (items, metadata)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def snapshot(self) -> list[dict[str, Any]]:
        """Its items now (a response starts from these; later additions do not change them)."""
        with self.lock:
            return list(self.items)

    def add(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            self.items.extend(items)
            self.version += 1

    def set_metadata(self, metadata: dict[str, str]) -> None:
        with self.lock:
            self.metadata = metadata
            self.version += 1

    def item(self, item_id: str) -> dict[str, Any] | None:
        with self.lock:
            return next((item for item in self.items if item["id"] == item_id), None)

    def remove(self, item_id: str) -> bool:
        with self.lock:
            kept = [item for item in self.items if item["id"] != item_id]
            removed, self.items = len(kept) < len(self.items), kept
            self.version += removed
            return removed


def dump_stores(responses: ResponseStore, conversations: Kept[Conversation]) -> dict[str, Any]:
    """Both stores as JSON data, least recently used first. An item that responses share
    (a chat's earlier items) is written once and referred to by its index."""
    items: list[dict[str, Any]] = []
    index: dict[int, int] = {}

    def refs(listed: list[dict[str, Any]]) -> list[int]:
        for item in listed:
            if id(item) not in index:
                index[id(item)] = len(items)
                items.append(item)
        return [index[id(item)] for item in listed]

    kept = [{"response": r.response, "input_items": refs(r.input_items), "earlier": refs(r.earlier)}
            for r in responses.values()]
    talks = [{"id": c.id, "created_at": c.created_at, "metadata": c.metadata, "items": c.snapshot()}
             for c in conversations.values()]
    return {"format": 1, "items": items, "responses": kept, "conversations": talks}


def stores_version(responses: ResponseStore, conversations: Kept[Conversation]) -> tuple[int, int, int]:
    """Changes whenever what dump_stores writes may have changed."""
    return responses.version, conversations.version, sum(c.version for c in conversations.values())


def load_stores(data: dict[str, Any], responses: ResponseStore, conversations: Kept[Conversation]) -> None:
    """Fill both stores from dump_stores()'s data (shared items shared again)."""
    if data.get("format") != 1:
        raise ValueError(f"unknown stored-responses format {data.get('format')!r}")
    items = data["items"]
    for r in data["responses"]:
        responses.put(StoredResponse(r["response"], [items[i] for i in r["input_items"]],
                                     [items[i] for i in r["earlier"]]))
    for c in data["conversations"]:
        conversations.keep(c["id"], Conversation(c["id"], c["created_at"], c["metadata"], c["items"]))


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as the items OpenAI lists for it: each with an id, a message's
    content as parts (input_text; an assistant's output_text)."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
    return [_listed(item) for item in items]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    item = {key: value for key, value in item.items() if value is not None}
    kind = item.setdefault("type", "message")
    if kind == "message":
        if isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("status", "completed")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
    item.setdefault("id", f"{prefix}_{uuid.uuid4().hex}")
    return item


def page(items: list[dict[str, Any]], order: str = "desc", limit: int = 20,
         after: str | None = None) -> dict[str, Any]:
    """OpenAI's list object over `items`: `order` asc or desc, `limit` of them after the item `after`.
    A cursor that names no item raises KeyError."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise KeyError(after)
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
