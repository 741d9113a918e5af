"""One KV store per model, shared by its sequences: a row slot each, so a batch is one tensor.

A CUDA graph records addresses. For the packed batch to run as one
captured forward with one attention call per layer, every sequence of the
batch must live in one tensor the graph can index: per layer, keys and
values of shape [slots + 1, kv heads, capacity, head dim]. Each sequence
holds one slot (row) for its whole life (`SlotKV`, a StaticKV whose per-layer
tensors are views of its row), so a single sequence's forward and the
batched forward read and write the very same memory; the last row is
scratch, where padding rows of a batched forward write (never handed out,
never attended).

Bounded memory:
- slots are handed out lowest first and never move (a sequence's views and
  graphs stay valid), so `slots` is a power of two covering the highest
  slot in use; capacity is a power of two covering the longest context
  (`reserve`), at least INITIAL_CAPACITY.
- shrinking is triggered by a sequence leaving (`release`, when it is
  collected) and applied at the next slot hand-out or forward on the model
  (`_tidy_now`, never in the middle of a forward: a release may come from a
  garbage collection inside one): slots shrink to cover the highest slot
  still held, capacity to cover the longest context still held (each
  slot's last `reserve`), each only when it at least halves (no
  reallocation per step).
- a slot handed to a new sequence is zeroed first, and a released slot is
  zeroed before the next forward (padding rows read entry 0 of their
  slot): masking alone is not enough, because attention adds the
  mask to the scores (NaN + -inf is NaN) and multiplies masked weights by
  the values (0 * NaN is NaN), so one non-finite stale value would poison
  every row that shares its slot.

One lock per store: a model may run from several threads (each with its own
sequences), and a reallocation must not happen under another thread's
forward (`use`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator

import torch

from ssd.models.fast import INITIAL_CAPACITY, StaticKV


def power_of_two(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    out = 1
    while out < max(n, floor):
        out *= 2
    return out


class SharedKV:
    """The slots of one model's sequences (see the module docstring)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.lock = threading.RLock()
        self.version = 0  # bumped by every reallocation: views and graphs made before it are stale
        self._held: dict[int, int] = {}  # slot -> entries its sequence last reserved
        self._depth = 0  # forwards under way (`use`): no zeroing or reallocation by `_tidy_now` inside one
        self._stale: set[int] = set()  # released slots not zeroed yet
        self._released: collections.deque[int] = collections.deque()  # released, not booked yet (`release`)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(1, INITIAL_CAPACITY)

    @property
    def slots(self) -> int:
        """Slots a batched forward covers (the scratch row excluded): its row-count bucket."""
        return self.keys[0].shape[0] - 1

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def held(self) -> int:
        """Slots held by sequences (as of the last hand-out or forward: releases are booked then)."""
        return len(self._held)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def acquire(self) -> int:
        """A zeroed slot for a new sequence (the lowest free one; the store grows if none is)."""
        with self.lock:
            self._tidy_now()  # books the releases first
            slot = next(i for i in range(len(self._held) + 1) if i not in self._held)
            if slot >= self.slots:
                self._allocate(power_of_two(slot + 1), self.capacity)
            self._zero(slot)  # whatever was written to it since it was zeroed, a NaN included
            self._stale.discard(slot)
            self._held[slot] = 0
            return slot

    def release(self, slot: int) -> None:
        """`slot`'s sequence left: booked, zeroed and shrunk at the next hand-out or forward (`_tidy_now`).

        A release comes from a garbage collection, in any thread, at any
        point: in the middle of a forward, even of a CUDA graph capture (which
        would record a zeroing into the graph), or while its thread holds
        another lock (taking this store's lock then could deadlock with a
        forward that holds it). So it takes no lock and runs nothing on the
        device: a deque's append is atomic.
        """
        self._released.append(slot)

    def reserve(self, slot: int, length: int) -> None:
        """Room for `length` entries in every slot (capacity is shared); remembered for shrinking."""
        with self.lock:
            self._held[slot] = length
            if length > self.capacity:
                self._allocate(self.slots, power_of_two(length, self.capacity))

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Hold the store for one forward: no other thread's forward or reallocation meanwhile."""
        with self.lock:
            if self._depth == 0:
                self._tidy_now()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

    def _book(self) -> None:
        """Move the released slots from the deque to `_stale` (free, not zeroed yet)."""
        while self._released:
            slot = self._released.popleft()
            if self._held.pop(slot, None) is not None:
                self._stale.add(slot)

    def _tidy_now(self) -> None:
        """Zero the released slots, then shrink where the held slots and contexts allow."""
        self._book()
        if not self._stale or self._depth:
            return
        for slot in self._stale:
            self._zero(slot)
        self._stale.clear()
        slots = power_of_two(max(self._held, default=-1) + 1)
        capacity = power_of_two(max(self._held.values(), default=0), INITIAL_CAPACITY)
        slots = slots if 2 * slots <= self.slots else self.slots
        capacity = capacity if 2 * capacity <= self.capacity else self.capacity
        if (slots, capacity) != (self.slots, self.capacity):
            self._allocate(slots, capacity)

    # Normal tensors, never inference tensors, wherever the call comes from (a reallocation may
    # run inside a forward's inference mode): an inference tensor refuses in-place writes outside it.
    @torch.inference_mode(False)
    def _allocate(self, slots: int, capacity: int) -> None:
        """New tensors of `slots` (+ scratch) rows and `capacity` entries; held slots' entries kept."""
        shape = (slots + 1, self.kv_heads, capacity, self.head_dim)
        rows, cols = min(slots, self.slots if self.keys else 0), min(capacity, self.capacity if self.keys else 0)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if rows and cols:
                    new[:rows, :, :cols] = store[i][:rows, :, :cols]
                if i < len(store):
                    store[i] = new
                else:
                    store.append(new)
        self.version += 1

    @torch.inference_mode(False)
    def _zero(self, slot: int) -> None:
        for t in self.keys + self.values:
            t[slot].zero_()


class SlotKV(StaticKV):
    """One sequence's slot of a SharedKV, as a StaticKV: per layer views [kv heads, capacity, head dim].

    The views are made again after a reallocation of the store (its `version`).
    """

    def __init__(self, shared: SharedKV, slot: int) -> None:  # noqa: D107 - no StaticKV buffers of its own
        self.shared, self.slot = shared, slot
        self._version = -1
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def _views(self) -> None:
        if self._version != self.shared.version:
            self._keys = [t[self.slot] for t in self.shared.keys]
            self._values = [t[self.slot] for t in self.shared.values]
            self._version = self.shared.version

    @property
    def keys(self) -> list[torch.Tensor]:  # type: ignore[override]
        self._views()
        return self._keys

    @property
    def values(self) -> list[torch.Tensor]:  # type: ignore[override]
        self._views()
        return self._values

    @property
    def capacity(self) -> int:
        return self.shared.capacity

    def reserve(self, length: int, keep: int) -> None:
        """Room for `length` entries; the shared store keeps every held slot's entries when it grows."""
        self.shared.reserve(self.slot, length)
