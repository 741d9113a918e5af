"""The draft side's one host: a speculator serving a draft model on a link
until the target shuts it down.

Every place that runs SSD's draft side runs `serve`; they differ only in
where the process comes from and what carries the link:
- `DraftThread`: a thread of this process over the in-process channel (SSD in
  one process: the server's engines, launch/generate.py, the tests);
- `serve_link`: rank 1 of a two-rank gloo link, in a Ray actor
  (ssd.cluster.workers.DraftWorker) or in a spawned second process
  (ssd.tools.bench.draft_process, the GPU smoke run).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from ssd.saguaro import protocol
from ssd.saguaro.speculator import Speculator
from ssd.transport import inprocess_pair
from ssd.transport.channel import Channel
from ssd.transport.distributed import DistributedChannel

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
JOIN_TIMEOUT_S = 30.0  # a speculator mid-build finishes it before it reads the shutdown


def serve(model: torch.nn.Module, channel: Channel) -> None:
    """Answer the target on `channel` until it sends shutdown (blocks); the channel is closed after."""
    try:
        Speculator(model, channel).serve()
    finally:
        channel.close()


def serve_link(
    model: torch.nn.Module, port: int, prefix: str, timeout_s: float, backend: str = "gloo", host: str = LOOPBACK,
    local_host: str | None = None,
) -> None:
    """Join the link under `prefix` as rank 1 (the target is rank 0, at `host`) and `serve` on it (blocks).
    `local_host`: this end's address the target can reach, for a link between hosts."""
    channel = DistributedChannel.connect(
        host, port, rank=1, backend=backend, timeout_s=timeout_s, prefix=prefix, local_host=local_host
    )
    serve(model, channel)


class DraftThread:
    """`serve` on a daemon thread of this process; `channel` is the target's end.

    `stream`: a CUDA stream the draft computes on (the thread makes it current),
    so that its forwards can overlap the target's verification on the same GPU;
    the handoff is ordered by events (ssd.transport.inprocess) and every wait is
    stream-level (ssd.hardware.sync). None: the thread's default stream, which
    on CUDA serialises the two roles.
    """

    def __init__(self, draft: torch.nn.Module, stream: torch.cuda.Stream | None = None,
                 speculator: Callable[[torch.nn.Module, Channel], Speculator] = Speculator) -> None:
        """`speculator`: what serves (a benchmark's instrumented Speculator; the class itself elsewhere)."""
        self.channel, draft_end = inprocess_pair()
        self.speculator = speculator(draft, draft_end)
        self.stream = stream
        self.thread = threading.Thread(target=self._serve, name="ssd-speculator", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.stream is None:
            self.speculator.serve()
            return
        with torch.cuda.stream(self.stream):
            self.speculator.serve()

    def stop(self) -> None:
        """Shut the speculator down (through our own end: the engine may have dropped its link)."""
        if self.thread.is_alive():
            self.channel.send(protocol.shutdown())
            self.thread.join(JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                log.warning("the speculator thread did not stop within %.0f s", JOIN_TIMEOUT_S)
