"""Autoregressive decoding: one target forward per token. The reference."""

from __future__ import annotations

from ssd.engine.base import Engine, SequenceState


class AREngine(Engine):
    mode = "ar"

    def _round(self, req: SequenceState) -> list[int]:
        return self._target_step(req)
