"""A busy neighbour: the other SSD role decoding on another core while one role is timed.

On CPUs both roles stream weights from the same memory, so a forward timed
alone is faster than the same forward in SSD, where the other role runs at
the same time. `busy_neighbour` starts a process pinned to `core` that loads
a model and runs forwards of `tokens` tokens in a loop until the context
exits: costs measured inside it are costs under load.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator

import torch

from ssd.config import ModelConfig
from ssd.models.kv import KVSequence
from ssd.models.loading import load_model

PREFIX_TOKENS = 200
_STOP, _LOADING, _READY = 0, 1, 2


def pin(core: int) -> None:
    """Run this process on `core` with one torch thread."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def arbitrary_ids(kv: KVSequence, n: int, offset: int = 0) -> list[int]:
    """n in-vocabulary ids: the content does not change a forward's cost."""
    vocab = kv.model.config.vocab_size
    return [(1000 + offset + i) % vocab for i in range(n)]


def prefilled(cfg: ModelConfig, prefix: int = PREFIX_TOKENS) -> KVSequence:
    kv = KVSequence(load_model(cfg))
    kv.forward(arbitrary_ids(kv, prefix), last_only=True)
    return kv


@contextlib.contextmanager
def busy_neighbour(cfg: ModelConfig, core: int, tokens: int, load_timeout_s: float = 600.0) -> Iterator[None]:
    """Inside the context, a process on `core` runs `tokens`-token forwards of `cfg`'s model nonstop."""
    state = mp.get_context("spawn").Value("i", _LOADING)
    worker = mp.get_context("spawn").Process(target=_loop, args=(cfg, core, tokens, state), daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + load_timeout_s
        while state.value != _READY:
            if not worker.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the neighbour process died or hung while loading; see its log")
            time.sleep(0.2)
        yield
    finally:
        state.value = _STOP
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()


def _loop(cfg: ModelConfig, core: int, tokens: int, state) -> None:
    pin(core)
    kv = prefilled(cfg)
    ids = arbitrary_ids(kv, tokens, offset=3)
    state.value = _READY
    while state.value != _STOP:
        length = kv.length
        kv.forward(ids)
        kv.rollback(length)
