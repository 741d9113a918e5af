"""Stored responses: OpenAI's `store` and `previous_response_id` on the Responses API.

A finished response is kept with the conversation it ended: the items of the
responses it continued, its own input items and its output items. A later
request that names it as `previous_response_id` is that conversation followed
by its own input, so a chat goes on without sending its history again (and
the prefix cache, ssd.engine.prefix, serves the history's prompt chunks).
As on OpenAI, an earlier response's instructions are not carried over.

The store is the HTTP front end's memory: bounded by a count of responses,
least recently used out first, gone with the process (vLLM keeps its
Responses store in memory too). No model, no I/O: testable in milliseconds.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


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


class ResponseStore:
    """Responses by id, at most `capacity` of them; thread-safe (handlers run on a pool)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._kept[stored.response["id"]] = stored
            self._kept.move_to_end(stored.response["id"])
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (read it, never change it), now the most recently used."""
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None


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
