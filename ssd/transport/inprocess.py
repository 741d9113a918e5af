"""In-process Channel: two queues between threads of one process.

Tensors are copied on send, so neither side can see the other mutate a
tensor after it was sent: the same semantics as a real wire.
"""

from __future__ import annotations

import queue

from ssd.transport.channel import Channel, ChannelTimeout, Message, queued_ops


class InProcessChannel(Channel):
    def __init__(self, outbox: queue.Queue, inbox: queue.Queue) -> None:
        self._outbox = outbox
        self._inbox = inbox

    def send(self, message: Message) -> None:
        tensors = [t.clone() for t in message.tensors]
        self._outbox.put(Message(message.op, dict(message.header), tensors))

    def recv(self, timeout: float | None = None) -> Message:
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"no message within {timeout} s") from None


    def pending(self) -> list[str]:
        return queued_ops(self._inbox)


def inprocess_pair() -> tuple[InProcessChannel, InProcessChannel]:
    """Two connected ends: what one sends, the other receives."""
    a_to_b: queue.Queue = queue.Queue()
    b_to_a: queue.Queue = queue.Queue()
    return InProcessChannel(a_to_b, b_to_a), InProcessChannel(b_to_a, a_to_b)
