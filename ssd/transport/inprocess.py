"""In-process Channel: two queues between threads of one process.

Tensors are copied on send, so neither side can see the other mutate a
tensor after it was sent: the same semantics as a real wire.

The two threads may compute on different CUDA streams (SSD in one process:
the draft on a stream of its own, ssd.saguaro.host). A CUDA tensor's copy is
queued on the sender's stream, so the message carries an event recorded
after the copies, and the receiver's stream waits on that event (a
stream-level wait: neither thread blocks the device) and marks the tensors
as used there, so the caching allocator does not hand their memory to the
sender's stream while the receiver may still read it.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from ssd.transport.channel import Channel, ChannelTimeout, Message, queued_ops


@dataclass
class _HandedOver(Message):
    """A message whose CUDA tensors are ready once `ready` has fired on the sender's stream."""

    ready: torch.cuda.Event | None = None


class InProcessChannel(Channel):
    def __init__(self, outbox: queue.Queue, inbox: queue.Queue) -> None:
        self._outbox = outbox
        self._inbox = inbox

    def send(self, message: Message) -> None:
        tensors = [t.clone() for t in message.tensors]
        self._outbox.put(_HandedOver(message.op, dict(message.header), tensors, _ready_event(tensors)))

    def recv(self, timeout: float | None = None) -> Message:
        try:
            message = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"no message within {timeout} s") from None
        if isinstance(message, _HandedOver) and message.ready is not None:
            _take_over(message)
        return message

    def pending(self) -> list[str]:
        return queued_ops(self._inbox)


def _ready_event(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """An event after the sender's copies of its CUDA tensors; None when there are none."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _take_over(message: _HandedOver) -> None:
    """Order the receiver's stream after the sender's copies, and tie the tensors' memory to it."""
    device = next(t.device for t in message.tensors if t.is_cuda)
    stream = torch.cuda.current_stream(device)
    stream.wait_event(message.ready)
    for t in message.tensors:
        if t.is_cuda:
            t.record_stream(stream)


def inprocess_pair() -> tuple[InProcessChannel, InProcessChannel]:
    """Two connected ends: what one sends, the other receives."""
    a_to_b: queue.Queue = queue.Queue()
    b_to_a: queue.Queue = queue.Queue()
    return InProcessChannel(a_to_b, b_to_a), InProcessChannel(b_to_a, a_to_b)
