"""Per-generation metrics: speed, time to first token, speculation quality."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    mode: str
    k: int = 0  # drafted tokens per round (0 for AR)
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    rounds: int = 0  # verification rounds (AR: decode steps after the first token)
    drafted: int = 0
    accepted: int = 0
    # accepted_at[i]: rounds whose drafted token i was accepted
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (excludes prefill)."""
        decode_s = self.total_s - self.time_to_first_token_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean drafted tokens accepted per round (the round adds one more)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in (
            "tokens_per_s",
            "decode_tokens_per_s",
            "acceptance_rate",
            "mean_accepted_length",
            "acceptance_by_position",
        ):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        line = (
            f"{self.mode}: {self.new_tokens} tokens in {self.total_s:.2f}s "
            f"({self.tokens_per_s:.2f} tok/s, decode {self.decode_tokens_per_s:.2f} tok/s), "
            f"TTFT {self.time_to_first_token_s * 1000:.0f} ms"
        )
        if self.k:
            by_pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
            line += (
                f", K={self.k}, rounds {self.rounds}, acceptance {self.acceptance_rate:.3f}, "
                f"mean accepted {self.mean_accepted_length:.2f}/round, by position [{by_pos}]"
            )
        return line


class Stopwatch:
    """Monotonic seconds since construction."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
