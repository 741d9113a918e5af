"""Per-generation metrics: speed, time to first token, speculation quality."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


@dataclass
class SpecStats:
    """SSD's own measures: cache hits, where speculations came from, timings."""

    lookups: int = 0  # rounds whose outcome was looked up in a cache
    hits: int = 0
    lookups_by_k: dict[int, int] = field(default_factory=dict)
    hits_by_k: dict[int, int] = field(default_factory=dict)
    ngram_hits: int = 0  # hits on the cache's free n-gram entries (speculation.ngram_candidates)
    rounds_after_hit: int = 0
    tokens_after_hit: int = 0  # tokens added by rounds verifying a cached speculation
    rounds_after_miss: int = 0
    tokens_after_miss: int = 0
    backups: dict[str, int] = field(default_factory=dict)  # speculations per backup kind
    wait_s: float = 0.0  # target blocked on the draft
    wait_hit_s: float = 0.0  # ... in rounds served from the cache
    verify_s: float = 0.0
    verify_hit_s: float = 0.0
    build_s: float = 0.0  # draft: cache construction
    backup_s: float = 0.0  # draft: backup speculation on misses
    degraded_rounds: int = 0  # rounds the target ran alone because the draft was lost

    def record(
        self, lookup_k: int | None, hit: bool, source: str, tokens: int,
        wait_s: float, verify_s: float, backup_s: float, build_s: float,
    ) -> None:
        if lookup_k is not None:
            self.lookups += 1
            self.hits += hit
            self.lookups_by_k[lookup_k] = self.lookups_by_k.get(lookup_k, 0) + 1
            self.hits_by_k[lookup_k] = self.hits_by_k.get(lookup_k, 0) + hit
        if hit:
            self.ngram_hits += source == "ngram"
            self.rounds_after_hit += 1
            self.tokens_after_hit += tokens
            self.wait_hit_s += wait_s
            self.verify_hit_s += verify_s
        else:
            self.rounds_after_miss += 1
            self.tokens_after_miss += tokens
            self.backups[source] = self.backups.get(source, 0) + 1
        self.wait_s += wait_s
        self.verify_s += verify_s
        self.backup_s += backup_s
        self.build_s += build_s

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def hit_rate_by_k(self) -> dict[int, float]:
        return {k: self.hits_by_k[k] / n for k, n in sorted(self.lookups_by_k.items())}

    @property
    def tokens_per_round_after_hit(self) -> float:
        return self.tokens_after_hit / self.rounds_after_hit if self.rounds_after_hit else 0.0

    @property
    def tokens_per_round_after_miss(self) -> float:
        return self.tokens_after_miss / self.rounds_after_miss if self.rounds_after_miss else 0.0

    @property
    def wait_fraction_on_hits(self) -> float:
        """Share of hit rounds' time (wait + verify) the target spent waiting."""
        busy = self.wait_hit_s + self.verify_hit_s
        return self.wait_hit_s / busy if busy else 0.0

    def summary(self) -> str:
        return (
            f"hit rate {self.hit_rate:.3f} ({self.hits}/{self.lookups}, {self.ngram_hits} n-gram), tokens/round "
            f"{self.tokens_per_round_after_hit:.2f} after hit, {self.tokens_per_round_after_miss:.2f} after miss, "
            f"backups {self.backups}, wait {self.wait_s:.2f}s, verify {self.verify_s:.2f}s, "
            f"build {self.build_s:.2f}s, backup {self.backup_s:.2f}s"
            + (f", degraded rounds {self.degraded_rounds}" if self.degraded_rounds else "")
        )


class RoundRatios:
    """Ratios over the counts every run keeps, live (GenerationStats) or
    replayed from a trace (ssd.tools.ablation.replay.ReplayResult): written once."""

    drafted: int
    accepted: int
    spec: SpecStats

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def hit_rate(self) -> float:
        return self.spec.hit_rate

    @property
    def hit_rate_by_k(self) -> dict[int, float]:
        return self.spec.hit_rate_by_k

    @property
    def tokens_per_round_after_hit(self) -> float:
        return self.spec.tokens_per_round_after_hit

    @property
    def tokens_per_round_after_miss(self) -> float:
        return self.spec.tokens_per_round_after_miss


@dataclass
class GenerationStats(RoundRatios):
    mode: str
    k: int = 0  # drafted tokens per round (0 for AR)
    precision: str = ""  # e.g. "target int8, draft int8"
    requests: int = 1  # generations counted here: 1, or more in a total (see `total`)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, served from an earlier request's cache (ssd.engine.prefix)
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    rounds: int = 0  # verification rounds (AR: decode steps after the first token)
    drafted: int = 0
    accepted: int = 0
    # accepted_at[i]: rounds whose drafted token i was accepted
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    # Target busy time over the rounds: its forward plus sampling/verification.
    target_s: float = 0.0
    spec: SpecStats = field(default_factory=SpecStats)  # SSD only
    # Prompt lookup (ssd.engine.lookup): rounds that verified the text's own prediction
    # instead of a plain step, and their tokens; not in drafted/accepted, the draft's.
    lookup_rounds: int = 0
    looked_up: int = 0
    lookup_accepted: int = 0

    def record_round(self, drafted: int, accepted: int, target_s: float = 0.0) -> None:
        self.rounds += 1
        self.target_s += target_s
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def record_lookup(self, proposed: int, accepted: int, target_s: float = 0.0) -> None:
        self.record_round(drafted=0, accepted=0, target_s=target_s)
        self.lookup_rounds += 1
        self.looked_up += proposed
        self.lookup_accepted += accepted

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (excludes prefill)."""
        decode_s = self.total_s - self.time_to_first_token_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean drafted tokens accepted per round (the round adds one more)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec"].update(
            hit_rate=self.spec.hit_rate,
            hit_rate_by_k=self.spec.hit_rate_by_k,
            tokens_per_round_after_hit=self.spec.tokens_per_round_after_hit,
            tokens_per_round_after_miss=self.spec.tokens_per_round_after_miss,
        )
        for name in (
            "tokens_per_s",
            "decode_tokens_per_s",
            "acceptance_rate",
            "mean_accepted_length",
            "acceptance_by_position",
        ):
            out[name] = getattr(self, name)
        return out

    @property
    def ran(self) -> str:
        """The mode that ran: `mode`, or "ar" where a speculating mode drafted nothing in any
        round (speculation.k_policy said K 0 at every step: the start-up plan turns it off
        where AR is faster), so a line never shows SD's or SSD's zeros for an AR run."""
        return "ar" if self.mode != "ar" and self.rounds and not self.drafted else self.mode

    def summary(self) -> str:
        ran = self.ran  # AR's figures only where nothing was drafted: no acceptance or hit rate of 0/0
        label = ran if ran == self.mode else f"ar ({self.mode} asked, nothing drafted)"
        line = (
            f"{label}{f' [{self.precision}]' if self.precision else ''}: {self.new_tokens} tokens in {self.total_s:.2f}s "
            f"({self.tokens_per_s:.2f} tok/s, decode {self.decode_tokens_per_s:.2f} tok/s), "
            f"TTFT {self.time_to_first_token_s * 1000:.0f} ms"
        )
        if ran == "ar":
            lost = self.spec.degraded_rounds
            return line + (f", degraded rounds {lost} (the draft lost)" if lost else "") + self._lookup_summary()
        if self.k:
            by_pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
            line += (
                f", K={self.k}, rounds {self.rounds}, acceptance {self.acceptance_rate:.3f}, "
                f"mean accepted {self.mean_accepted_length:.2f}/round, by position [{by_pos}]"
            )
        if self.mode == "ssd":
            line += f"; {self.spec.summary()}"
        return line + self._lookup_summary()

    def _lookup_summary(self) -> str:
        if not self.lookup_rounds:
            return ""
        return f"; prompt lookup: {self.lookup_accepted}/{self.looked_up} tokens accepted in {self.lookup_rounds} rounds"


# Fields that name what was measured; a total keeps the first generation's.
_LABELS = frozenset({"mode", "k", "precision"})


def add_into(total: Any, other: Any) -> None:
    """Add dataclass `other` into `total`, field by field: numbers sum, count
    dicts and per-position lists sum by key and index, nested stats recurse."""
    for f in dataclasses.fields(total):
        if f.name in _LABELS:
            continue
        mine, theirs = getattr(total, f.name), getattr(other, f.name)
        if dataclasses.is_dataclass(mine):
            add_into(mine, theirs)
        elif isinstance(mine, dict):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        elif isinstance(mine, list):
            mine += [0] * (len(theirs) - len(mine))
            for i, n in enumerate(theirs):
                mine[i] += n
        else:
            setattr(total, f.name, mine + theirs)


def total(stats: Iterable[GenerationStats], mode: str = "") -> GenerationStats:
    """The sum of several generations' stats; rates on it are pooled over all
    of them (hits / lookups, accepted / drafted), never means of rates.
    Labels (mode, K, precision) come from the first generation."""
    stats = list(stats)
    out = GenerationStats(mode=mode or (stats[0].mode if stats else ""), requests=0)
    if stats:
        out.k, out.precision = stats[0].k, stats[0].precision
    for s in stats:
        add_into(out, s)
    return out


class Stopwatch:
    """Monotonic seconds since construction."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
