"""The Channel interface between target rank 0 and the draft.

A message is a small header (plain data that msgpack can carry: op name,
ids, numbers, lists) plus typed tensors. Nothing is pickled, so the same
messages travel in-process and over torch.distributed.
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


class ChannelClosed(RuntimeError):
    """The other side shut the channel down."""


class ChannelTimeout(TimeoutError):
    """No message arrived within the timeout."""


@dataclass
class Message:
    op: str
    header: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


class Channel(ABC):
    """One end of a bidirectional, ordered, reliable message link."""

    @abstractmethod
    def send(self, message: Message) -> None: ...

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message:
        """The next message; ChannelTimeout after `timeout` seconds (None: wait)."""

    def pending(self) -> list[str]:
        """The ops of the messages waiting now, in order, none taken; empty
        where the carrier cannot tell without receiving (callers then go on)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional for carriers with nothing to free
        """Release the carrier's resources."""


def queued_ops(inbox: queue.Queue) -> list[str]:
    """The ops of the Messages in a queue, in order, without taking them."""
    with inbox.mutex:
        return [m.op for m in inbox.queue if isinstance(m, Message)]
