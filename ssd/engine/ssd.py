"""SSD, the target side: send each verification outcome to the draft, receive
the next speculation (ready at once on a cache hit), verify it. Written only
against the Channel interface; the draft side is ssd.spec.speculator."""

from __future__ import annotations

import itertools
import time

import torch

from ssd.config import SpeculationConfig
from ssd.engine.base import Engine, Request, Verifier
from ssd.engine.output import Tokenizer
from ssd.spec import protocol
from ssd.transport.channel import Channel
from ssd.verify import Outcome, verify


class SSDEngine(Engine):
    mode = "ssd"

    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Tokenizer,
        channel: Channel,
        spec: SpeculationConfig,
        verifier: Verifier = verify,
    ) -> None:
        super().__init__(target, tokenizer, verifier)
        self.channel = channel
        self.spec = spec
        self._seq_ids = itertools.count()
        self._seq = -1
        self._outcome = Outcome(0, 0)
        self._first_round = True

    @property
    def k(self) -> int:
        return self.spec.k

    def _start(self, req: Request) -> None:
        super()._start(req)
        self._seq = next(self._seq_ids)
        self.channel.send(protocol.prefill(self._seq, req.sequence, req.sampling, self.spec))

    def _first_token(self, req: Request) -> int:
        token = super()._first_token(req)
        self._outcome = Outcome(0, token)  # the prefill is round 0: nothing drafted, t* = token
        self._first_round = True  # no cache exists yet: not a lookup
        return token

    def _round(self, req: Request) -> list[int]:
        lookup_k = None if self._first_round else self._outcome.k
        self._first_round = False
        started = time.perf_counter()
        self.channel.send(protocol.round_(self._seq, self._outcome.k, self._outcome.token))
        reply = protocol.parse_speculation(self.channel.recv())
        waited = time.perf_counter() - started
        # Never verify past max_new_tokens: the round adds up to K + 1 tokens.
        k = min(len(reply.speculation.tokens), req.output.remaining - 1)
        drafted = reply.speculation.tokens[:k]
        q = None if reply.speculation.q is None else reply.speculation.q[:k]
        started = time.perf_counter()
        self._outcome = self._verify(req, drafted, q)
        req.stats.spec.record(
            lookup_k=lookup_k, hit=reply.hit, source=reply.speculation.source,
            tokens=self._outcome.k + 1,
            wait_s=waited, verify_s=time.perf_counter() - started,
            backup_s=reply.backup_s, build_s=reply.build_s,
        )
        return self._outcome.tokens(drafted)

    def _finish(self, req: Request) -> None:
        self.channel.send(protocol.release(self._seq))
